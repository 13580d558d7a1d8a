"""The per-step privacy loss random variable of DP-SGD-RC: laws, cap, RDP bound
(docs/privacy/prv.md#prv, docs/privacy/adjacency.md#adjacency,
docs/privacy/reference_numbers.md#reference-tail)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
from prv_accountant import PoissonSubsampledGaussianMechanism
from scipy import integrate, special

from opacus_rc.accountants.analysis.prv import CAP_GRID, RandomizedClippingPRV, choose_t_cap


def _reference():  # tests/reference/theory_tables.py, loaded by path (pytest uses importlib mode)
    path = Path(__file__).resolve().parents[1] / "reference" / "theory_tables.py"
    spec = importlib.util.spec_from_file_location("_opacus_rc_theory_tables", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REF = _reference()


def prv(**kw) -> RandomizedClippingPRV:
    kw.setdefault("noise_multiplier", 1.0)
    kw.setdefault("sample_rate", 0.01)
    return RandomizedClippingPRV(**kw)


@pytest.mark.parametrize(("q", "sigma"), [(0.01, 1.0), (0.01, 0.5), (0.2, 2.0), (1.0, 1.0)])
def test_exact_clipping_remove_cdf_is_prv_accountants_psg(q: float, sigma: float) -> None:
    """k = None, remove direction: the CDF equals prv_accountant's closed form (< 1e-12)."""
    ours = prv(noise_multiplier=sigma, sample_rate=q)
    t0 = math.log1p(-q) if q < 1 else -30.0
    t = np.concatenate([t0 + np.logspace(-9, 0, 200), np.linspace(t0 + 1e-3, 30.0, 3000)])
    ref = PoissonSubsampledGaussianMechanism(q, sigma).cdf(t)
    np.testing.assert_allclose(ours.cdf(t), np.asarray(ref, dtype=float), rtol=0, atol=1e-12)


def test_kl_divergences_are_the_prv_means() -> None:
    """E Y_R = KL(Q||P) and E Y_A = KL(P||Q) = 1/(2 sigma^2) for the Gaussian mechanism; both
    are >= 0 for randomized clipping."""
    for direction in ("remove", "add"):
        assert prv(sample_rate=1.0, direction=direction).mean() == pytest.approx(0.5, abs=1e-10)
        assert prv(sketch_dim=32, direction=direction).mean() > 0.0


@pytest.mark.parametrize("mode", ["hidden", "revealed"])
@pytest.mark.parametrize("k", [None, 8, 32])
def test_cdfs_are_monotone_with_the_right_support(k: int | None, mode: str) -> None:
    """Both CDFs are nondecreasing; the remove PRV lives on (log(1-q), inf) and the add PRV on
    (-inf, -log(1-q)) (docs/privacy/prv.md#prv-hidden)."""
    q = 0.01
    edge = -math.log1p(-q)
    t = np.linspace(-15.0, 15.0, 20001)
    rem = prv(sketch_dim=k, threat_model=mode)
    add = prv(sketch_dim=k, threat_model=mode, direction="add")
    for p in (rem, add):
        c = p.cdf(t)
        assert np.all(np.diff(c) >= -1e-15)
        assert np.all((c >= 0) & (c <= 1))
    assert np.all(rem.cdf(t[t <= -edge]) == 0.0)
    assert rem.cdf(-edge + 1e-3) > 0.0
    assert np.all(add.cdf(t[t >= edge]) == 1.0)
    assert add.cdf(edge - 1e-3) < 1.0


@pytest.mark.parametrize("mode", ["hidden", "revealed"])
def test_add_and_remove_densities_satisfy_the_prv_identity(mode: str) -> None:
    """For a dominating pair, f_A(-t) = e^{-t} f_R(t) (the add PRV is the reflected,
    exponentially tilted remove PRV). Central differences with h = 1e-4 have relative
    truncation error ~h^2 f'''/f ~ 1e-7 here."""
    rem = prv(sketch_dim=16, threat_model=mode)
    add = prv(sketch_dim=16, threat_model=mode, direction="add")
    h = 1e-4
    for t in (-0.005, 0.0, 0.3, 1.0, 2.0):
        s_r = rem.sf(np.array([t - h, t + h]))
        f_r = (s_r[0] - s_r[1]) / (2 * h)
        c_a = add.cdf(np.array([-t - h, -t + h]))
        f_a = (c_a[1] - c_a[0]) / (2 * h)
        assert f_a == pytest.approx(math.exp(-t) * f_r, rel=1e-5), t


def test_remove_tail_matches_theory_g4() -> None:
    """P(Y_R > t), k = 32, sigma = 1, q = 0.01, to the five printed digits."""
    p = prv(sketch_dim=32)
    for t, (ref, _, _) in REF.PRV_TAIL_MC.items():
        assert float(p.sf(t)) == pytest.approx(ref, rel=2e-5), t


def test_remove_tail_monte_carlo_g4() -> None:
    """Monte Carlo of the mechanism itself (not of the quadrature): X = B S + N with
    B ~ Bernoulli(q), S = max(1, (chi2_k / k)^(-1/2)) drawn from numpy's chi-square sampler and
    N ~ N(0, sigma^2); Y_R > t iff X > x*(t) (L is increasing). Stratified on B:
    P(Y_R > t) = (1 - q) Phi(-x*/sigma) + q p1 with p1 = P(S + N > x*) estimated from n draws.
    The binomial standard error of the estimate is q sqrt(p1 (1 - p1) / n); we allow 4.5 of them
    (two-sided normal tail 7e-6 per check for a correct implementation; fixed seed)."""
    q, sigma, k, n = 0.01, 1.0, 32, 2_000_000
    p = prv(sketch_dim=k)
    model = p._table.model
    rng = np.random.default_rng(20260524)
    s = np.maximum(1.0, (rng.chisquare(k, n) / k) ** -0.5)
    x1 = s + sigma * rng.standard_normal(n)
    for t in (0.0, 0.5, 1.0):
        z = math.log((math.exp(t) - (1 - q)) / q)
        x_star = float(model.x_of_z(np.array([z]))[0])
        p1 = float(np.mean(x1 > x_star))
        mc = (1 - q) * special.ndtr(-x_star / sigma) + q * p1
        se = q * math.sqrt(max(p1 * (1 - p1), 1.0 / n) / n)
        assert abs(float(p.sf(t)) - mc) <= 4.5 * se, (t, float(p.sf(t)), mc, se)


def test_cap_rule_c3() -> None:
    """T = 1000, delta = 1e-5, sigma = 1: t_cap = 3.0 for k = 32 and 140 for k = 8
    (docs/privacy/prv.md#prv-tail-cap);
    the capped PRV moves the tail to pm_inf = eta + (1 - eta) P(Y > t_cap)."""
    for k, expected in ((32, 3.0), (8, 140.0)):
        p = prv(sketch_dim=k)
        cap = choose_t_cap(p, steps=1000, delta=1e-5)
        assert cap == expected
        c = p.with_cap(cap)
        tail = float(p.sf(cap))
        assert 1000 * tail <= 1e-3 * 1e-5 < 1000 * float(p.sf(cap - 0.5))
        assert c.pm_inf == pytest.approx(1e-15 + (1 - 1e-15) * tail, rel=1e-12)
        assert float(c.cdf(cap)) == 1.0 and float(c.sf(cap)) == 0.0
        assert float(c.cdf(1.0)) == pytest.approx(float(p.cdf(1.0)) / float(p.cdf(cap)), rel=1e-14)


def test_add_direction_needs_no_cap_below_2() -> None:
    """The add PRV is bounded by -log(1 - q) < 2: the cap moves nothing (pm_inf = eta)."""
    p = prv(sketch_dim=8, direction="add")
    assert choose_t_cap(p, steps=10**6, delta=1e-10) == CAP_GRID[0]
    assert p.with_cap(2.0).pm_inf == 1e-15
    assert prv(direction="add").with_cap(2.0).pm_inf == 0.0  # exact clipping: eta = 0


def test_rdp_is_a_finite_upper_bound_for_capped_prvs_only() -> None:
    """rdp (only used to size the domain) bounds the capped PRV's Renyi divergence from above:
    it is >= the same moment computed on a 10^6-point grid with masses at left cell edges."""
    p = prv(sketch_dim=32)
    c = p.with_cap(choose_t_cap(p, steps=1000, delta=1e-5))
    t = np.linspace(math.log1p(-0.01), c.t_cap, 1_000_001)
    cdf = c.cdf(t)
    mass = np.diff(cdf)
    vals = [c.rdp(a) for a in (1.5, 2.0, 5.0, 10.0, 32.0, 63.0)]
    assert all(np.diff(vals) >= -1e-12) and vals[0] >= 0.0
    for a, v in zip((1.5, 2.0, 5.0, 10.0, 32.0, 63.0), vals):
        keep = mass > 0
        lower = special.logsumexp(np.log(mass[keep]) + (a - 1) * t[:-1][keep]) / (a - 1)
        assert lower <= v + 1e-12
        assert v <= lower + 0.05
    with pytest.raises(ValueError, match="infinite"):
        p.rdp(2.0)


def test_partial_expectation_matches_integration_by_parts() -> None:
    """E[Y 1{a < Y <= b}] = a (F(b) - F(a)) + integral_a^b (F(b) - F(t)) dt (written this way to
    avoid cancellation), against the spline-integrated partial mean used by the discretisation."""
    for mode in ("hidden", "revealed"):
        p = prv(sketch_dim=16, threat_model=mode)
        a, b = -0.01, 2.0
        fa, fb = float(p.cdf(a)), float(p.cdf(b))
        integral, _ = integrate.quad(
            lambda x, p=p, fb=fb: fb - float(p.cdf(x)),
            a,
            b,
            points=[-0.005, 0.0, 0.01, 0.1, 0.5],
            limit=1000,
            epsabs=1e-16,
            epsrel=1e-13,
        )
        ref = a * (fb - fa) + integral
        assert p.partial_expectation(a, b) == pytest.approx(ref, rel=1e-10)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"noise_multiplier": 0.0}, "noise_multiplier must be a finite number > 0"),
        ({"noise_multiplier": -1.0}, "noise_multiplier must be a finite number > 0"),
        ({"noise_multiplier": math.nan}, "noise_multiplier must be a finite number > 0"),
        ({"noise_multiplier": math.inf}, "noise_multiplier must be a finite number > 0"),
        ({"sample_rate": 0.0}, r"sample_rate must be in \(0, 1\]"),
        ({"sample_rate": 1.5}, r"sample_rate must be in \(0, 1\]"),
        ({"sketch_dim": 0}, "sketch_dim must be >= 1"),
        ({"direction": "both"}, "direction must be one of"),
        ({"threat_model": "shared"}, "threat_model must be one of"),
        ({"envelope": "gauss"}, "envelope must be one of"),
    ],
)
def test_bad_prv_parameters(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        prv(**kwargs)
