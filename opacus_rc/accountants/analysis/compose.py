"""Discretisation and composition of the per-step PRVs, with an explicit error bound.

:func:`compose_epsilon` bounds the epsilon of ``sum_j steps[j]`` independent steps whose privacy
loss random variables (PRVs) are ``prvs[j]`` (Gopi, Lee and Wutschitz 2021, arXiv:2106.02848,
whose ``prv_accountant`` this replaces for the composition; the PRVs are still
``prv_accountant`` PRVs). The guarantee, for delta in ``(0, 1)`` and the budgets ``eps_error``
(``eta_eps`` below) and ``delta_error`` (``beta``):

    upper >= epsilon(delta) of the composition of the (capped) PRVs.

How (docs/privacy/error_budget.md has the derivation):

1. **Pessimistic moves** (never lower a privacy loss): the mass of ``S > s_max`` and the loss
   above the cap are at ``+inf`` (``pm_inf``); a step's mass above an upper end ``b`` goes to
   ``+inf`` and below a lower end ``a`` (the support's end, or a quantile) is moved up to
   ``a``, each at most ``1e-4 delta_error / steps``.
2. **Fine discretisation** of each step on a grid of mesh ``h_0``, cell-centred with a shift that
   preserves the mean: the error ``Z_i = Y~_i - Y_i`` is mean zero and lies in an interval of
   width ``h_0``.
3. **Long horizons**: steps are composed in blocks; a block's distribution is re-discretised on a
   coarser mesh ``h_l`` by unbiased (randomised-rounding) interpolation to the two neighbouring
   points, whose error is mean zero *given the block* and lies in an interval of width ``h_l``;
   blocks of blocks likewise (``levels``). With ``n_l`` steps per level-``l`` unit, the meshes are
   ``h_l = h_0 sqrt(n_l)``, so that every level contributes equally to the error budget.
4. **The error composes in quadrature**: the rounding errors form a martingale difference
   sequence, and Azuma-Hoeffding gives ``P(sum errors <= -eta_eps) <= beta`` for
   ``eta_eps = sqrt(nu2 log(1 / beta) / 2)``, ``nu2`` the sum of the squared widths
   (``sum_i h_0^2 + sum over re-discretisations of h_l^2``). The meshes are chosen so that
   ``eta_eps = eps_error``. Hence ``delta_true(eps + eps_error) <= delta_disc(eps) + beta``.
5. **Compositions** are circular FFT convolutions on windows sized by Chernoff bounds (from
   bounds on the log-MGF of the discretised steps), evaluated on an **exponentially tilted**
   copy (``p_i e^{lambda t_i}``), so that the tail that decides ``delta`` is resolved to
   relative precision down to ``delta = 1e-15``. The tilted mass that a window cuts (its
   Chernoff bound) and an allowance for floating-point round-off enter ``delta`` as
   ``e^{K(lambda) - lambda eps}`` times that mass; ``lambda`` is the smallest tilt that keeps
   this term below ``delta_error / 100`` (0 at moderate deltas).

``upper`` is the smallest epsilon whose discrete ``delta`` plus that numerical term is at most
``delta - delta_error``, plus ``eps_error`` (and at least 0); ``estimate`` solves ``delta``
itself; ``lower`` solves ``delta + delta_error`` plus the numerical term, minus ``eps_error``
(a lower bound for the capped PRVs, not for the moves of item 1).

Pure numpy/scipy; no Opacus import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import signal

from opacus_rc.accountants.analysis import discrete
from opacus_rc.accountants.analysis.discrete import (
    WINDOW_TAIL,
    MgfBound,
    StepMgf,
    TiltedPmf,
    chernoff_window,
    coarsen,
    discretise,
    lower_end,
    product,
    upper_end,
)
from opacus_rc.accountants.analysis.errors import EpsilonOutOfRangeError, NumericalLimitError
from opacus_rc.accountants.analysis.prv import RandomizedClippingPRV
from opacus_rc.validation import validate_delta

__all__ = [
    "MAX_LEVELS",
    "Composition",
    "compose_prvs",
    "compose_epsilon",
]

#: Most levels of blocks (item 3 of the module docstring).
MAX_LEVELS = 3
_U = np.finfo(np.float64).eps
_EXP_MAX = 600.0  # largest exponent kept in the final sums (e^600 ~ 1e260)


# =====================================================================================
# Plan: levels and meshes
# =====================================================================================
@dataclass(frozen=True)
class _Plan:
    levels: int
    branching: int
    mesh0: float
    meshes: tuple[float, ...]  # h_0, ..., h_L
    nu2_over_h0: float


def _digits(n: int, branching: int, levels: int) -> list[int]:
    """``n = sum_l d_l branching^l`` with ``d_l < branching`` for ``l < levels``."""
    out = []
    for _ in range(levels):
        out.append(n % branching)
        n //= branching
    out.append(n)
    return out


def _nu2_ratio(counts: Sequence[int], branching: int, levels: int) -> float:
    """``nu2 / h_0^2`` of :func:`_compose_levels` with ``h_l^2 = branching^l h_0^2``."""
    if levels == 0:
        return float(sum(counts))
    unit = [1.0]  # nu2(unit_l) / h_0^2
    for lv in range(1, levels + 1):
        unit.append(branching * unit[-1] + branching**lv)
    total = 0.0
    for n in counts:
        d = _digits(int(n), branching, levels)
        partial = 0.0
        for lv in range(1, levels + 1):
            if d[lv - 1] or partial:
                partial = d[lv - 1] * unit[lv - 1] + partial + branching**lv
        total += d[levels] * unit[levels] + partial
    return total


def _width(mgfs: Sequence[StepMgf], counts: Sequence[float], lam: float) -> float:
    lo, hi = chernoff_window(MgfBound(tuple(counts)), mgfs, lam, -math.log(WINDOW_TAIL))
    return hi - lo


def _choose_plan(
    counts: Sequence[int],
    spans: Sequence[float],
    mgfs: Sequence[StepMgf],
    eps_error: float,
    log_beta: float,
    lam: float,
) -> tuple[_Plan, float]:
    """The fewest levels whose largest FFT fits, else the one with the smallest largest FFT.

    Returns the plan and its estimated largest FFT length.
    """
    n_max = max(counts)
    best = None
    for levels in range(MAX_LEVELS + 1):
        branching = max(2, int(math.ceil(n_max ** (1.0 / (levels + 1)) - 1e-9)))
        if levels and branching**levels > n_max:
            break
        ratio = _nu2_ratio(counts, branching, levels)
        h0 = eps_error / math.sqrt(ratio * log_beta / 2.0)
        meshes = tuple(h0 * math.sqrt(branching**lv) for lv in range(levels + 1))
        points = max(spans) / h0
        for lv in range(levels):  # the products that build the units of level lv + 1
            for j, n in enumerate(counts):
                vec = [0.0] * len(counts)
                vec[j] = float(min(branching ** (lv + 1), n))
                points = max(points, _width(mgfs, vec, lam) / meshes[lv])
        points = max(points, _width(mgfs, [float(n) for n in counts], lam) / meshes[-1])
        plan = _Plan(levels, branching, h0, meshes, ratio)
        if points <= discrete.MAX_FFT_POINTS / 2:
            return plan, points
        if best is None or points < best[1]:
            best = (plan, points)
    return best


# =====================================================================================
# delta(eps) of the result and the roots
# =====================================================================================
def _solver(pmf: TiltedPmf, reference: float):
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


def _root(finite_part, p_inf: float, grid: np.ndarray, err, target: float, lo_eps: float) -> float:
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


# =====================================================================================
# The composition
# =====================================================================================
@dataclass(frozen=True)
class Composition:
    """Epsilon bounds of a composition and how they were computed.

    Attributes:
        lower, estimate, upper: Epsilon bounds (``upper`` is the guarantee; all ``>= 0``).
        delta: The target delta.
        eps_error: ``eta_eps``, the bound on the discretisation error in epsilon.
        delta_error: ``beta``, the probability budget of that bound.
        p_inf: Mass at ``+inf`` of the composed loss (revealing tail and cap).
        levels: Levels of blocks (0: every step on one mesh).
        branching: Units per block.
        meshes: ``h_0, ..., h_L``.
        fft_points: Length of the final composition's vector.
        tilt: The exponential tilt ``lambda``.
        numerical_delta: The floating-point and window term added to delta at ``upper``.
    """

    lower: float
    estimate: float
    upper: float
    delta: float
    eps_error: float
    delta_error: float
    p_inf: float
    levels: int
    branching: int
    meshes: tuple[float, ...]
    fft_points: int
    tilt: float
    numerical_delta: float = field(default=0.0)

    def as_tuple(self) -> tuple[float, float, float]:
        return (self.lower, self.estimate, self.upper)


def _compose_levels(
    steps: Sequence[TiltedPmf],
    counts: Sequence[int],
    plan: _Plan,
    mgfs: Sequence[StepMgf],
    log_tail: float,
) -> TiltedPmf:
    """``sum_j counts[j]`` steps composed level by level (item 3 of the module docstring).

    Per segment, with ``n = sum_l d_l b^l``: ``unit_l = coarsen(unit_{l-1}^{*b}, h_l)`` and
    ``partial_l = coarsen(unit_{l-1}^{*d_{l-1}} * partial_{l-1}, h_l)``; the result is
    ``prod_j unit_L^{*d_L} * partial_L`` on the mesh ``h_L``.
    """
    tops: list[tuple[TiltedPmf, int]] = []
    for step, n in zip(steps, counts):
        if plan.levels == 0:
            tops.append((step, n))
            continue
        d = _digits(int(n), plan.branching, plan.levels)
        unit, partial = step, None
        for lv in range(1, plan.levels + 1):
            parts = [(unit, d[lv - 1])] if d[lv - 1] else []
            if partial is not None:
                parts.append((partial, 1))
            if parts:
                partial = coarsen(product(parts, mgfs, log_tail), plan.meshes[lv])
            if n >= plan.branching**lv:
                unit = coarsen(product([(unit, plan.branching)], mgfs, log_tail), plan.meshes[lv])
        if d[plan.levels]:
            tops.append((unit, d[plan.levels]))
        if partial is not None:
            tops.append((partial, 1))
    return product(tops, mgfs, log_tail)


_LAMS = np.concatenate([[0.0], np.geomspace(1e-5, 1e4, 181)])


def _cumulants(
    mgfs: Sequence[StepMgf], counts: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(K, K', K'')`` of the composition on the tilt grid ``_LAMS`` (approximate)."""
    k = np.zeros(_LAMS.size)
    k1 = np.zeros(_LAMS.size)
    k2 = np.zeros(_LAMS.size)
    for s, n in zip(mgfs, counts):
        a, b, c = s.moments(_LAMS)
        k, k1, k2 = k + n * a, k1 + n * b, k2 + n * c
    return k, k1, k2


def _saddle_epsilon(mgfs: Sequence[StepMgf], counts: Sequence[int], target: float) -> float:
    """A first guess of the epsilon at which the finite part of delta equals ``target``.

    ``log delta(eps) ~ K(l) - l K'(l) - log(l (1 + l) sqrt(2 pi K''(l)))`` at ``K'(l) = eps``
    (a saddle-point approximation of the hockey-stick divergence), solved for ``l > 0``.
    """
    k, k1, k2 = _cumulants(mgfs, counts)
    goal = math.log(max(target, 1e-300))
    lams = _LAMS[1:]
    approx = k[1:] - lams * k1[1:] - np.log(lams * (1.0 + lams) * np.sqrt(2.0 * math.pi * k2[1:]))
    below = np.nonzero(approx <= goal)[0]
    i = int(below[0]) if below.size else lams.size - 1
    return float(k1[1:][i])


def _tilt_for(mgfs: Sequence[StepMgf], counts: Sequence[int], eps: float, log_goal: float) -> float:
    """The smallest tilt whose Chernoff factor ``e^{K(l) - l eps}`` is at most ``e^log_goal``.

    Round-off and cut window tails of the tilted computation enter delta multiplied by this
    factor (module docstring, item 5). The smallest sufficient tilt (0 for moderate deltas)
    distorts the law least, which keeps heavy-tailed steps on small windows; if none
    suffices, the saddle point ``K'(l) = eps`` minimises the factor.
    """
    k, k1, _ = _cumulants(mgfs, counts)
    saddle = int(min(np.searchsorted(k1, eps), _LAMS.size - 1))
    factor = k[: saddle + 1] - _LAMS[: saddle + 1] * eps
    ok = np.nonzero(factor <= log_goal)[0]
    return float(_LAMS[int(ok[0]) if ok.size else saddle])


def compose_prvs(
    prvs: Sequence[RandomizedClippingPRV],
    steps: Sequence[int],
    *,
    delta: float,
    eps_error: float = 0.01,
    delta_error: float | None = None,
) -> Composition:
    """Epsilon bounds of the composition of ``prvs[j]`` ``steps[j]`` times (module docstring).

    Args:
        prvs: Capped PRVs, one per distinct step configuration.
        steps: Number of steps of each, >= 1.
        delta: Target delta in ``(0, 1)``.
        eps_error: ``eta_eps > 0``: the discretisation error allowed in epsilon.
        delta_error: ``beta`` in ``(0, delta)``: its probability budget; default ``delta / 1000``.

    Returns:
        A :class:`Composition`.

    Raises:
        ValueError: on invalid arguments.
        EpsilonOutOfRangeError: if the mass at infinity reaches ``delta - delta_error``: epsilon
            exceeds every value this analysis certifies (a privacy answer: increase the noise,
            the sketch dimension or delta).
        NumericalLimitError: if the composition does not fit the numerical limits at this
            ``eps_error`` (not a statement about epsilon: increase ``eps_error``).
    """
    delta = validate_delta(delta)
    if not (isinstance(eps_error, (int, float)) and 0.0 < eps_error < math.inf):
        raise ValueError(f"eps_error must be a finite number > 0, got {eps_error!r}")
    beta = delta / 1000.0 if delta_error is None else float(delta_error)
    if not 0.0 < beta < delta:
        raise ValueError(f"delta_error must be in (0, delta), got {delta_error}")
    counts = [int(n) for n in steps]
    if len(counts) != len(prvs) or not prvs or min(counts) < 1:
        raise ValueError("compose needs one positive step count per PRV")
    p_inf = _mass_at_infinity([p.pm_inf for p in prvs], counts)
    if p_inf >= delta - beta:
        caps = sorted({p.t_cap for p in prvs if p.t_cap is not None})
        cap = f" (per step at most {caps[-1]:g} nats)" if caps else ""
        raise EpsilonOutOfRangeError(
            f"epsilon at delta={delta:g} is not finite for this analysis: the mass at infinity "
            f"of the composed privacy loss ({p_inf:.3g}: the revealing tail of the envelope "
            f"and the loss above the cap{cap}) is not below delta - delta_error "
            f"({delta - beta:.3g}), so no finite epsilon is certified at this delta. Increase "
            "noise_multiplier, sketch_dim or delta."
        )
    log_beta = math.log(1.0 / beta)
    log_tail = -math.log(WINDOW_TAIL)
    # plan from the log-MGFs of a coarse discretisation of every step
    # each tail moved (item 1) spends at most 1e-4 delta_error over all steps
    lower_tail = min(discrete.STEP_TAIL, 1e-4 * beta / sum(counts))
    spans = [upper_end(p, lower_tail)[0] - lower_end(p, lower_tail) for p in prvs]
    plan_mesh = max(spans) / 2**15
    mgfs = [discretise(p, plan_mesh, 0.0, j, len(prvs), lower_tail)[1] for j, p in enumerate(prvs)]
    eps0 = _saddle_epsilon(mgfs, counts, delta - beta - p_inf)
    plan, points = _choose_plan(counts, spans, mgfs, eps_error, log_beta, 0.0)
    if points > discrete.MAX_FFT_POINTS:
        raise NumericalLimitError(
            f"composing {sum(counts)} steps at eps_error={eps_error:g} needs FFTs of about "
            f"{points:.3g} points (the limit is {discrete.MAX_FFT_POINTS}); "
            f"{advice(eps_error, points / discrete.MAX_FFT_POINTS)}",
            factor=points / discrete.MAX_FFT_POINTS,
        )
    plans = {0.0: plan}

    def plan_for(lam: float) -> _Plan | None:
        """The plan at tilt ``lam``, or None if its FFTs do not fit (a heavy tail tilted)."""
        if lam not in plans:
            found, size = _choose_plan(counts, spans, mgfs, eps_error, log_beta, lam)
            plans[lam] = found if size <= discrete.MAX_FFT_POINTS else None
        return plans[lam]

    def feasible_tilt(lam: float) -> float:
        """``lam``, or the largest smaller tilt on the grid whose plan fits (0 always does)."""
        if plan_for(lam) is not None:
            return lam
        lams = _LAMS
        for cand in lams[(lams < lam) & (lams > 0.0)][::-1][::8]:
            if plan_for(float(cand)) is not None:
                return float(cand)
        return 0.0

    stages = 1 + plan.levels * plan.branching * len(prvs)
    moved_guess = _moved(stages, points, stages)
    lam = feasible_tilt(_tilt_for(mgfs, counts, eps0, math.log(0.01 * beta / moved_guess)))
    tried: list[float] = []
    best: Composition | None = None
    for _ in range(4):
        tried.append(lam)
        plan = plan_for(lam)
        try:
            pieces = [
                discretise(p, plan.mesh0, lam, j, len(prvs), lower_tail) for j, p in enumerate(prvs)
            ]
            mgfs = [m for _, m in pieces]
            final = _compose_levels([s for s, _ in pieces], counts, plan, mgfs, log_tail)
        except NumericalLimitError as err:
            if err.factor is None:
                raise
            raise NumericalLimitError(
                f"composing {sum(counts)} steps at eps_error={eps_error:g}: {err}; "
                f"{advice(eps_error, err.factor)}",
                factor=err.factor,
            ) from err
        eta_eps = math.sqrt(final.nu2 * log_beta / 2.0)
        finite_part, grid, lo_eps = _solver(final, _tilt_reference(mgfs, counts, lam))
        moved = 2.0 * final.misplaced + _moved(final.ops, final.v.size, 0)

        def err(eps: float, final=final, moved=moved) -> float:
            return math.exp(min(final.log_mgf - final.lam * eps, 700.0)) * moved

        up = _root(finite_part, final.p_inf, grid, err, delta - beta, lo_eps)
        if math.isfinite(up) and err(up) <= 0.5 * (delta - beta - final.p_inf):
            est = _root(finite_part, final.p_inf, grid, _constant(0.0), delta, lo_eps)
            est = up if not math.isfinite(est) else est
            # lower: delta_hat(eps) - err(eps) = delta + beta, err frozen at the first root
            low = _root(finite_part, final.p_inf, grid, _constant(0.0), delta + beta, lo_eps)
            if math.isfinite(low) and err(low) < beta:
                slack = err(low)
                low = _root(finite_part, final.p_inf, grid, _constant(-slack), delta + beta, lo_eps)
            else:
                low = -math.inf  # not resolved: 0 is a valid lower bound
            result = Composition(
                lower=max(low - eta_eps, 0.0),
                estimate=max(est, 0.0),
                upper=max(up + eta_eps, 0.0),
                delta=delta,
                eps_error=eta_eps,
                delta_error=beta,
                p_inf=final.p_inf,
                levels=plan.levels,
                branching=plan.branching,
                meshes=plan.meshes,
                fft_points=int(final.v.size),
                tilt=lam,
                numerical_delta=err(up),
            )
            if best is None or result.upper < best.upper:
                best = result
            if result.numerical_delta <= 0.1 * beta:
                return result
        # the tilt does not resolve the tail at the root: tilt at the root and redo
        if math.isnan(up):
            where = float(grid[0])
        elif math.isinf(up):
            where = float(grid[-1])
        else:
            where = up
        lam = feasible_tilt(_tilt_for(mgfs, counts, where, math.log(0.01 * beta / moved)))
        if any(abs(lam - old) <= 1e-9 * max(1.0, old) for old in tried):
            break
    if best is not None:
        return best
    raise NumericalLimitError(
        "the tail of the composed privacy loss could not be resolved to the precision this "
        f"delta needs (delta={delta:g}); increase delta or eps_error"
    )


def _mass_at_infinity(masses: Sequence[float], counts: Sequence[int]) -> float:
    """``1 - prod_j (1 - masses[j])^counts[j]``: the composition's mass at ``+inf`` (1 if any
    step puts all its mass there)."""
    if any(m >= 1.0 for m in masses):
        return 1.0
    return -math.expm1(sum(n * math.log1p(-m) for m, n in zip(masses, counts)))


#: Margin of :func:`advice` over the factor by which the vector that hit the limit is too long
#: (the windows of the products are only estimated by the plan).
ADVICE_MARGIN = 1.15


def advice(eps_error: float, factor: float) -> str:
    """The advice of a :class:`NumericalLimitError`: an ``eps_error`` at which the vector that
    hit the limit fits, ``eps_error * factor * ADVICE_MARGIN`` rounded *up* to two significant
    digits (every mesh is proportional to ``eps_error``, so every vector shrinks by the
    factor); or, if that is not below 1 (the largest ``eps_error`` the accountant accepts),
    that no budget fits."""
    need = eps_error * max(factor, 1.0) * ADVICE_MARGIN
    unit = 10.0 ** (math.floor(math.log10(need)) - 1)
    value = math.ceil(need / unit - 1e-9) * unit
    if value >= 1.0:
        return (
            f"no eps_error below 1 fits (it would need about {need:.3g}): reduce the number "
            "of steps"
        )
    return (
        f"increase eps_error: use eps_error={value:.2g} (or larger), or reduce the number of steps"
    )


def _constant(value: float):
    return lambda eps: value


def _moved(stages: float, points: float, cuts: float) -> float:
    """Tilted mass a computation may misplace: round-off ``64 u sqrt(points)`` per FFT stage
    (a heuristic allowance, about 40 times the measured error) plus ``cuts`` window tails."""
    return 64.0 * _U * math.sqrt(max(points, 1.0)) * max(stages, 1.0) + 2.0 * cuts * WINDOW_TAIL


def _tilt_reference(mgfs: Sequence[StepMgf], counts: Sequence[int], lam: float) -> float:
    """``K'(lambda)``: the mean of the tilted composition (where the tilted vector peaks)."""
    total = 0.0
    for s, n in zip(mgfs, counts):
        total += n * float(s.moments(np.array([lam]))[1][0])
    return total


def compose_epsilon(
    prvs: Sequence[RandomizedClippingPRV],
    steps: Sequence[int],
    *,
    delta: float,
    eps_error: float = 0.01,
    delta_error: float | None = None,
) -> tuple[float, float, float]:
    """``(lower, estimate, upper)`` epsilon of the composition (see :func:`compose_prvs`).

    Raises:
        EpsilonOutOfRangeError: if epsilon exceeds every value this analysis certifies.
        NumericalLimitError: if the composition exceeds the numerical limits at ``eps_error``.
    """
    return compose_prvs(
        prvs, steps, delta=delta, eps_error=eps_error, delta_error=delta_error
    ).as_tuple()
