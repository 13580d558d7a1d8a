"""The pieces of the composition (discrete.py) against direct computations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from opacus_rc.accountants.analysis.discrete import (
    MgfBound,
    chernoff_window,
    coarsen,
    discretise,
    product,
)
from opacus_rc.accountants.analysis.prv import RandomizedClippingPRV


def step(lam: float, mesh: float = 1e-2):
    prv = RandomizedClippingPRV(noise_multiplier=1.0, sample_rate=0.1, sketch_dim=32)
    return discretise(prv.with_cap(3.0), mesh, lam, 0, 1)


def untilted(pmf) -> tuple[np.ndarray, np.ndarray]:
    t = pmf.offset + pmf.mesh * np.arange(pmf.v.size)
    return t, pmf.v * np.exp(pmf.log_mgf - pmf.lam * t)


def test_discretisation_preserves_the_mean_within_half_a_cell() -> None:
    """Cell-centred rounding then one shift: the discrete mean is the clamped step's mean, the
    total finite mass is 1 - pm_inf, and the rounding error has width one mesh (nu2 = mesh^2)."""
    prv = RandomizedClippingPRV(noise_multiplier=1.0, sample_rate=0.1, sketch_dim=32).with_cap(3.0)
    pmf, _ = discretise(prv, 1e-2, 0.0, 0, 1)
    t, p = untilted(pmf)
    assert p.sum() == pytest.approx(1.0 - pmf.p_inf, rel=1e-12)
    assert np.dot(t, p) / p.sum() == pytest.approx(prv.mean(), abs=1e-12)
    assert pmf.nu2 == 1e-4


@pytest.mark.parametrize("lam", [0.0, 3.0])
def test_product_is_the_convolution(lam: float) -> None:
    """Three copies by one circular FFT on a window that holds the whole support: the untilted
    result is the direct convolution, tilted or not (tilting commutes with convolution)."""
    one, mgf = step(lam)
    three = product([(one, 3)], [mgf], log_tail=200.0)
    _, p1 = untilted(one)
    direct = np.convolve(np.convolve(p1, p1), p1)
    t3, p3 = untilted(three)
    assert t3[0] == pytest.approx(3 * one.offset, abs=1e-12)
    np.testing.assert_allclose(p3[: direct.size], direct, rtol=1e-9, atol=1e-16)
    assert three.misplaced == 0.0


@pytest.mark.parametrize("lam", [0.0, 3.0])
def test_coarsening_is_unbiased_given_each_point(lam: float) -> None:
    """Unbiased rounding to the two neighbours of a mesh four times coarser: total mass and
    mean are exactly those of the fine vector, the variance grows by at most mesh^2 / 4, and the
    tilted computation untilts to the same vector."""
    fine, _ = step(lam)
    coarse = coarsen(fine, 4e-2)
    tf, pf = untilted(fine)
    tc, pc = untilted(coarse)
    assert pc.sum() == pytest.approx(pf.sum(), rel=1e-12)
    mean_f, mean_c = np.dot(tf, pf) / pf.sum(), np.dot(tc, pc) / pc.sum()
    assert mean_c == pytest.approx(mean_f, abs=1e-12)
    var_f = np.dot((tf - mean_f) ** 2, pf) / pf.sum()
    var_c = np.dot((tc - mean_c) ** 2, pc) / pc.sum()
    assert var_f <= var_c <= var_f + (4e-2) ** 2 / 4 + 1e-15
    assert coarse.nu2 == pytest.approx(fine.nu2 + 1.6e-3, rel=1e-12)
    if lam:
        _, reference = untilted(coarsen(step(0.0)[0], 4e-2))
        np.testing.assert_allclose(pc, reference, rtol=1e-9, atol=1e-16)


def test_step_mgf_bounds_sandwich_the_exact_log_mgf() -> None:
    """Binned bounds (Hoeffding's lemma within a bin above, Jensen below) enclose the exact
    log-MGF of the discretised step at every exponent."""
    pmf, mgf = step(0.0, mesh=1e-3)
    t, p = untilted(pmf)
    for theta in (-300.0, -10.0, -1.0, 0.5, 5.0, 50.0, 500.0):
        exact = math.log(np.sum(p * np.exp(theta * t - np.max(theta * t)))) + np.max(theta * t)
        assert mgf.lower(np.array([theta]))[0] <= exact + 1e-12
        assert exact <= mgf.upper(np.array([theta]))[0] + 1e-12


def test_chernoff_window_holds_all_but_its_tail() -> None:
    """The window of 200 copies at tail 1e-9 leaves at most 1e-9 of the (exactly convolved)
    mass outside it on each side."""
    one, mgf = step(0.0, mesh=2e-3)
    lo, hi = chernoff_window(MgfBound((200.0,)), [mgf], 0.0, -math.log(1e-9))
    full = product([(one, 200)], [mgf], log_tail=200.0)  # the exact support
    t, p = untilted(full)
    assert p[t < lo].sum() <= 1e-9 and p[t > hi].sum() <= 1e-9
    assert lo > t[0] and hi < t[-1]  # and it does cut
