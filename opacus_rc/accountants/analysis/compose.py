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

Where each part lives: the plan of levels and meshes and the level-by-level composition
(items 3 and 4) in :mod:`~opacus_rc.accountants.analysis.blocks`; the choice of the tilt and the
evaluation and inversion of ``delta(eps)`` (item 5) in
:mod:`~opacus_rc.accountants.analysis.tilting`; the discretisation (items 1 and 2) in
:mod:`~opacus_rc.accountants.analysis.discrete`. This module runs them: it checks the
arguments, retries with another tilt when the tail is not resolved, and turns the roots into
the bounds above (or a :class:`NumericalLimitError` with advice).

Pure numpy/scipy; no Opacus import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from opacus_rc.accountants.analysis import discrete
from opacus_rc.accountants.analysis.blocks import MAX_LEVELS, Plan, choose_plan, compose_levels
from opacus_rc.accountants.analysis.discrete import WINDOW_TAIL, discretise, lower_end, upper_end
from opacus_rc.accountants.analysis.errors import EpsilonOutOfRangeError, NumericalLimitError
from opacus_rc.accountants.analysis.prv import RandomizedClippingPRV
from opacus_rc.accountants.analysis.tilting import (
    TILTS,
    delta_solver,
    saddle_epsilon,
    smallest_root,
    tilt_for,
    tilt_reference,
)
from opacus_rc.validation import validate_delta

__all__ = [
    "MAX_LEVELS",
    "Composition",
    "compose_prvs",
    "compose_epsilon",
]

_U = np.finfo(np.float64).eps


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
    eps0 = saddle_epsilon(mgfs, counts, delta - beta - p_inf)
    plan, points = choose_plan(counts, spans, mgfs, eps_error, log_beta, 0.0)
    if points > discrete.MAX_FFT_POINTS:
        raise NumericalLimitError(
            f"composing {sum(counts)} steps at eps_error={eps_error:g} needs FFTs of about "
            f"{points:.3g} points (the limit is {discrete.MAX_FFT_POINTS}); "
            f"{advice(eps_error, points / discrete.MAX_FFT_POINTS)}",
            factor=points / discrete.MAX_FFT_POINTS,
        )
    plans = {0.0: plan}

    def plan_for(lam: float) -> Plan | None:
        """The plan at tilt ``lam``, or None if its FFTs do not fit (a heavy tail tilted)."""
        if lam not in plans:
            found, size = choose_plan(counts, spans, mgfs, eps_error, log_beta, lam)
            plans[lam] = found if size <= discrete.MAX_FFT_POINTS else None
        return plans[lam]

    def feasible_tilt(lam: float) -> float:
        """``lam``, or the largest smaller tilt on the grid whose plan fits (0 always does)."""
        if plan_for(lam) is not None:
            return lam
        lams = TILTS
        for cand in lams[(lams < lam) & (lams > 0.0)][::-1][::8]:
            if plan_for(float(cand)) is not None:
                return float(cand)
        return 0.0

    stages = 1 + plan.levels * plan.branching * len(prvs)
    moved_guess = _moved(stages, points, stages)
    lam = feasible_tilt(tilt_for(mgfs, counts, eps0, math.log(0.01 * beta / moved_guess)))
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
            final = compose_levels([s for s, _ in pieces], counts, plan, mgfs, log_tail)
        except NumericalLimitError as err:
            if err.factor is None:
                raise
            raise NumericalLimitError(
                f"composing {sum(counts)} steps at eps_error={eps_error:g}: {err}; "
                f"{advice(eps_error, err.factor)}",
                factor=err.factor,
            ) from err
        eta_eps = math.sqrt(final.nu2 * log_beta / 2.0)
        finite_part, grid, lo_eps = delta_solver(final, tilt_reference(mgfs, counts, lam))
        moved = 2.0 * final.misplaced + _moved(final.ops, final.v.size, 0)

        def err(eps: float, final=final, moved=moved) -> float:
            return math.exp(min(final.log_mgf - final.lam * eps, 700.0)) * moved

        up = smallest_root(finite_part, final.p_inf, grid, err, delta - beta, lo_eps)
        if math.isfinite(up) and err(up) <= 0.5 * (delta - beta - final.p_inf):
            est = smallest_root(finite_part, final.p_inf, grid, _constant(0.0), delta, lo_eps)
            est = up if not math.isfinite(est) else est
            # lower: delta_hat(eps) - err(eps) = delta + beta, err frozen at the first root
            low = smallest_root(
                finite_part, final.p_inf, grid, _constant(0.0), delta + beta, lo_eps
            )
            if math.isfinite(low) and err(low) < beta:
                slack = err(low)
                low = smallest_root(
                    finite_part, final.p_inf, grid, _constant(-slack), delta + beta, lo_eps
                )
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
        lam = feasible_tilt(tilt_for(mgfs, counts, where, math.log(0.01 * beta / moved)))
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
