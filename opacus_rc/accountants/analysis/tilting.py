"""The exponential tilt of a composition and ``delta(eps)`` of the tilted result.

Item 5 of :mod:`~opacus_rc.accountants.analysis.compose`'s docstring: the composition is
computed on an exponentially tilted copy (``p_i e^{lambda t_i}``) so that the tail that decides
``delta`` is resolved to relative precision. This module holds the choice of ``lambda`` from
the steps' cumulants (:func:`saddle_epsilon`, :func:`tilt_for`, :func:`tilt_reference`, on the
grid :data:`TILTS`) and the evaluation and inversion of ``delta(eps)`` on the tilted vector
(:func:`delta_solver`, :func:`smallest_root`), free of overflow at any epsilon.

Pure numpy/scipy; no Opacus import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import signal

from opacus_rc.accountants.analysis.discrete import StepMgf, TiltedPmf

__all__ = [
    "TILTS",
    "cumulants",
    "delta_solver",
    "saddle_epsilon",
    "smallest_root",
    "tilt_for",
    "tilt_reference",
]

_EXP_MAX = 600.0  # largest exponent kept in the final sums (e^600 ~ 1e260)


#: The grid of tilts ``lambda`` searched (0 and 181 log-spaced values in ``[1e-5, 1e4]``).
TILTS = np.concatenate([[0.0], np.geomspace(1e-5, 1e4, 181)])


def cumulants(
    mgfs: Sequence[StepMgf], counts: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(K, K', K'')`` of the composition on the tilt grid ``TILTS`` (approximate)."""
    k = np.zeros(TILTS.size)
    k1 = np.zeros(TILTS.size)
    k2 = np.zeros(TILTS.size)
    for s, n in zip(mgfs, counts):
        a, b, c = s.moments(TILTS)
        k, k1, k2 = k + n * a, k1 + n * b, k2 + n * c
    return k, k1, k2


def saddle_epsilon(mgfs: Sequence[StepMgf], counts: Sequence[int], target: float) -> float:
    """A first guess of the epsilon at which the finite part of delta equals ``target``.

    ``log delta(eps) ~ K(l) - l K'(l) - log(l (1 + l) sqrt(2 pi K''(l)))`` at ``K'(l) = eps``
    (a saddle-point approximation of the hockey-stick divergence), solved for ``l > 0``.
    """
    k, k1, k2 = cumulants(mgfs, counts)
    goal = math.log(max(target, 1e-300))
    lams = TILTS[1:]
    approx = k[1:] - lams * k1[1:] - np.log(lams * (1.0 + lams) * np.sqrt(2.0 * math.pi * k2[1:]))
    below = np.nonzero(approx <= goal)[0]
    i = int(below[0]) if below.size else lams.size - 1
    return float(k1[1:][i])


def tilt_for(mgfs: Sequence[StepMgf], counts: Sequence[int], eps: float, log_goal: float) -> float:
    """The smallest tilt whose Chernoff factor ``e^{K(l) - l eps}`` is at most ``e^log_goal``.

    Round-off and cut window tails of the tilted computation enter delta multiplied by this
    factor (item 5 of :mod:`~opacus_rc.accountants.analysis.compose`). The smallest
    sufficient tilt (0 for moderate deltas) distorts the law least, which keeps heavy-tailed
    steps on small windows; if none suffices, the saddle point ``K'(l) = eps`` minimises the
    factor.
    """
    k, k1, _ = cumulants(mgfs, counts)
    saddle = int(min(np.searchsorted(k1, eps), TILTS.size - 1))
    factor = k[: saddle + 1] - TILTS[: saddle + 1] * eps
    ok = np.nonzero(factor <= log_goal)[0]
    return float(TILTS[int(ok[0]) if ok.size else saddle])


def tilt_reference(mgfs: Sequence[StepMgf], counts: Sequence[int], lam: float) -> float:
    """``K'(lambda)``: the mean of the tilted composition (where the tilted vector peaks)."""
    total = 0.0
    for s, n in zip(mgfs, counts):
        total += n * float(s.moments(np.array([lam]))[1][0])
    return total


def delta_solver(pmf: TiltedPmf, reference: float):
    """``(finite_part, grid, lo_eps)``: the finite part of ``delta(eps)`` of ``pmf``.

    ``delta_hat(eps) = p_inf + sum_{t_k >= eps} p_k (1 - e^{eps - t_k})`` with ``p_k`` from the
    tilted vector (negative round-off clipped to 0, which can only raise it), evaluated on
    ``eps >= lo_eps`` where the untilting factors stay below ``e^600``.

    No factor can overflow at any ``eps``: with ``a_k = p_k e^{-log_scale}`` and ``i`` the
    first grid point ``>= eps``, the sum is ``e^{log_scale} (A_i - e^{eps - t_i} B_i)``, where
    ``A_i = sum_{k >= i} a_k`` and ``B_i = sum_{k >= i} a_k e^{-(t_k - t_i)}`` (the reverse
    recursion ``B_i = a_i + e^{-mesh} B_{i+1}``, every term in ``[0, A_i]``), and
    ``e^{eps - t_i} <= 1``; the product with ``e^{log_scale}`` is formed as a sum of
    logarithms. A large epsilon (far above the tilted mean ``reference``) is therefore as
    exact as a small one.
    """
    lam = pmf.lam
    t = pmf.offset + pmf.mesh * np.arange(pmf.v.size)
    v = np.maximum(pmf.v, 0.0)
    reach = 0.5 * _EXP_MAX / max(lam, 1.0)  # the untilting factor below e^300
    first = int(np.searchsorted(t, reference - reach))
    t, v = t[first:], v[first:]
    with np.errstate(under="ignore"):
        a = v * np.exp(-lam * (t - reference))
    s1 = np.cumsum(a[::-1])[::-1]
    # B_i = a_i + r B_{i+1}, r = e^{-mesh}: an exact first-order recursion, run backwards
    s2 = signal.lfilter([1.0], [1.0, -math.exp(-pmf.mesh)], a[::-1])[::-1]
    log_scale = pmf.log_mgf - lam * reference

    def finite_part(eps: float) -> float:
        i = int(np.searchsorted(t, eps, side="left"))
        if i >= t.size:
            return 0.0
        val = s1[i] - math.exp(min(eps - float(t[i]), 0.0)) * s2[i]
        return math.exp(min(log_scale + math.log(val), 700.0)) if val > 0.0 else 0.0

    lo_eps = float(t[0]) if first > 0 else -math.inf
    return finite_part, t, lo_eps


def smallest_root(
    finite_part, p_inf: float, grid: np.ndarray, err, target: float, lo_eps: float
) -> float:
    """Smallest ``eps`` with ``p_inf + finite_part(eps) + err(eps) <= target`` (monotone)."""

    def f(eps: float) -> float:
        return p_inf + finite_part(eps) + err(eps) - target

    if f(float(grid[-1]) + 1e-9) > 0.0:
        return math.inf  # not reached inside the window: the caller re-tilts
    # bracket on the grid
    lo_i, hi_i = 0, grid.size - 1
    if f(float(grid[0])) <= 0.0:
        if lo_eps > -math.inf:
            return math.nan  # below the resolved range: the caller re-tilts
        lo, hi = float(grid[0]) - 1.0, float(grid[0])
        while f(lo) <= 0.0:
            lo, hi = lo - 2.0 * (hi - lo), lo
            if lo < -1e6:
                return lo
    else:
        while hi_i - lo_i > 1:
            mid = (lo_i + hi_i) // 2
            if f(float(grid[mid])) > 0.0:
                lo_i = mid
            else:
                hi_i = mid
        lo, hi = float(grid[lo_i]), float(grid[hi_i])
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if f(mid) > 0.0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, abs(hi)):
            break
    return hi
