"""The noise multiplier for a target epsilon, with :class:`~opacus_rc.accountants.rc.RCAccountant`.

The search only ever reads privacy answers as privacy answers. At each trial sigma the
accountant returns bounds ``lower <= epsilon <= upper`` (the discretisation error ``eps_error``
either side), or :class:`~opacus_rc.accountants.analysis.errors.EpsilonOutOfRangeError` (epsilon
exceeds every value the analysis certifies: sigma is too small), or
:class:`~opacus_rc.accountants.analysis.errors.NumericalLimitError` (no answer at this
``eps_error``). Bracketing runs at a coarse ``eps_error`` (cheap, and within the numerical
limits where the fine one is not): a sigma with ``lower > target`` is too small, one with
``upper <= target`` large enough. A numerical limit there is retried at a coarser ``eps_error``
(up to a quarter of the target) and never counted as "too small". The answer is then found at
the template accountant's ``eps_error`` by ``scipy.optimize.brentq`` (Brent's method, as
dp_accounting's noise search uses) on ``log epsilon`` versus ``log sigma``; the returned sigma
is one whose epsilon, computed exactly as the template accountant computes it, is at most the
target and within ``epsilon_tolerance`` of it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from scipy import optimize

from opacus_rc.accountants.analysis.epsilon import MIN_NOISE_MULTIPLIER
from opacus_rc.accountants.analysis.errors import EpsilonOutOfRangeError, NumericalLimitError
from opacus_rc.accountants.events import sketch_spec_from, step_event
from opacus_rc.accountants.rc import RCAccountant
from opacus_rc.sketch_spec import SketchSpec
from opacus_rc.validation import validate_delta, validate_sample_rate

__all__ = ["MAX_SIGMA", "MIN_SIGMA", "get_noise_multiplier"]

#: Largest noise multiplier :func:`get_noise_multiplier` tries before giving up.
MAX_SIGMA = 1e4
#: Smallest noise multiplier :func:`get_noise_multiplier` tries (the smallest positive one the
#: accountant computes epsilon for).
MIN_SIGMA = MIN_NOISE_MULTIPLIER


def _is_number(value: Any) -> bool:
    """A real number that is not a ``bool``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class _Bounds:
    """Epsilon bounds of one trial sigma at one ``eps_error`` (``inf`` if out of range)."""

    def __init__(self, lower: float, upper: float) -> None:
        self.lower, self.upper = lower, upper


def get_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    epochs: float | None = None,
    steps: int | None = None,
    sketch_spec: SketchSpec | Mapping[str, Any] | None = None,
    accountant: RCAccountant | None = None,
    epsilon_tolerance: float = 0.01,
) -> float:
    """Smallest noise multiplier whose epsilon (upper bound, both directions) is at most the target.

    The returned ``sigma`` satisfies ``target - epsilon_tolerance <= epsilon(sigma) <= target``,
    ``epsilon`` computed as the template accountant computes it (unless the bracket closes to
    a relative width of ``1e-6`` first). See the module docstring for the search.

    One exception, on the safe side: for very large targets (hundreds of nats) epsilon can jump
    from a finite value to out of range as ``sigma`` decreases (a step's privacy loss passes the
    accountant's cap, ``EpsilonOutOfRangeError``), and then the answer is the smallest
    ``sigma`` with a finite epsilon, which may lie well below the target (``k = 32``,
    ``q = 0.1``, 10 steps, target 1000: ``sigma = 0.0971`` at epsilon 666). It is never above.

    Args:
        target_epsilon: Target epsilon (finite, > 0).
        target_delta: Target delta in ``(0, 1)``.
        sample_rate: Poisson sampling probability ``q`` in ``(0, 1]``.
        epochs: Number of epochs (finite, > 0); ``steps = int(epochs / sample_rate)`` as in
            Opacus, at least 1. Give exactly one of ``epochs`` and ``steps``.
        steps: Number of optimizer steps (a finite integer >= 1).
        sketch_spec: The sketch of every step; ``None`` uses the accountant's own
            ``sketch_dim`` (exact clipping if that is ``None`` too).
        accountant: An :class:`~opacus_rc.accountants.rc.RCAccountant` used as a template
            (envelope, threat model, ``eps_error``, ``sketch_dim``); it is not modified.
            Default ``RCAccountant()``.
        epsilon_tolerance: Accepted shortfall of epsilon below the target (finite, > 0).

    Returns:
        The noise multiplier (noise std / clipping bound); :data:`MIN_SIGMA` (0.01, the
        smallest positive noise multiplier the accountant computes epsilon for) if even that
        meets the target.

    Raises:
        ValueError: on invalid arguments, or if even ``sigma = 1e4`` does not reach the target.
        NumericalLimitError: if the accountant cannot certify epsilon at the answer with the
            template's ``eps_error`` (or cannot bound it at all during the bracketing); the
            message names a larger ``eps_error`` to use.
    """
    if not (_is_number(target_epsilon) and 0.0 < target_epsilon < math.inf):
        hint = (
            " (an infinite budget needs no noise: pass noise_multiplier=0 for a debugging run)"
            if _is_number(target_epsilon) and target_epsilon == math.inf
            else ""
        )
        raise ValueError(
            f"target_epsilon must be a finite number > 0, got {target_epsilon!r}{hint}"
        )
    target_delta = validate_delta(target_delta)
    q = validate_sample_rate(sample_rate)
    if not (_is_number(epsilon_tolerance) and 0.0 < epsilon_tolerance < math.inf):
        raise ValueError(
            f"epsilon_tolerance must be a finite number > 0, got {epsilon_tolerance!r}"
        )
    if (steps is None) == (epochs is None):
        raise ValueError("get_noise_multiplier takes exactly one of steps and epochs")
    if steps is None:
        if not (_is_number(epochs) and 0.0 < epochs < math.inf):
            raise ValueError(f"epochs must be a finite number > 0, got {epochs!r}")
        steps = int(epochs / q)
        if steps < 1:
            raise ValueError(
                f"epochs={epochs!r} at sample_rate={q:g} gives int(epochs / sample_rate) = "
                f"{steps} steps; epochs must be >= sample_rate (at least one step)"
            )
    if not (_is_number(steps) and math.isfinite(steps) and int(steps) == steps and steps >= 1):
        raise ValueError(f"steps must be a finite integer >= 1, got {steps!r}")
    steps = int(steps)
    template = RCAccountant() if accountant is None else accountant
    if not isinstance(template, RCAccountant):
        raise TypeError(
            f"accountant must be an RCAccountant (or None), got {type(template).__name__}"
        )
    work = template.empty_copy()
    spec = sketch_spec_from(sketch_spec)
    spec = work.sketch_spec if spec is None else spec
    mode = work.threat_model_for(spec)
    target = float(target_epsilon)
    fine = work.eps_error
    coarse_start = min(max(fine, 0.02 * target), 0.5)
    coarse_max = max(coarse_start, 0.25 * target)

    def bounds(sigma: float, eps_error: float) -> _Bounds:
        work.clear()
        work.compose(
            step_event(noise_multiplier=sigma, sample_rate=q, sketch_spec=spec, threat_model=mode),
            steps,
        )
        try:
            rep = work.get_epsilon_report(target_delta, eps_error=eps_error)
        except EpsilonOutOfRangeError:
            return _Bounds(math.inf, math.inf)  # a privacy answer: epsilon is too large
        return _Bounds(max(rep.remove[0], rep.add[0]), rep.upper)

    def coarse(sigma: float) -> _Bounds:
        """Bounds at the coarsest ``eps_error`` needed; never reads a limit as an answer."""
        err = coarse_start
        while True:
            try:
                return bounds(sigma, err)
            except NumericalLimitError as exc:
                if err >= coarse_max:
                    raise NumericalLimitError(
                        f"cannot bound epsilon at noise_multiplier={sigma:.6g} even with "
                        f"eps_error={err:g}: {exc}"
                    ) from exc
                err = min(4.0 * err, coarse_max)

    # ---- bracket: lo is certainly too small (lower > target), hi large enough at coarse error
    def too_low(sigma: float) -> ValueError:
        return ValueError(
            f"the privacy budget epsilon={target} at delta={target_delta} is too low: not "
            f"reached with noise_multiplier <= {MAX_SIGMA:g}"
        )

    def up_until_enough(sigma: float) -> float:
        while coarse(sigma).upper > target:
            sigma *= 1.25
            if sigma > MAX_SIGMA:
                raise too_low(sigma)
        return sigma

    def down_until_too_small(sigma: float) -> float | None:
        while coarse(sigma).lower <= target:
            if sigma <= MIN_SIGMA:
                return None
            sigma = max(sigma / 1.25, MIN_SIGMA)
        return sigma

    sigma = 1.0
    b = coarse(sigma)
    if b.lower > target:  # too small: double until large enough
        lo = sigma
        while True:
            sigma *= 2.0
            if sigma > MAX_SIGMA:
                raise too_low(sigma)
            b = coarse(sigma)
            if b.lower > target:
                lo = sigma
                continue
            hi = sigma if b.upper <= target else up_until_enough(sigma)
            break
    elif b.upper <= target:  # large enough: halve until too small
        hi = sigma
        while True:
            if sigma <= MIN_SIGMA:
                return _certify(bounds, hi, fine, target)[0]
            sigma = max(sigma / 2.0, MIN_SIGMA)
            b = coarse(sigma)
            if b.upper <= target:
                hi = sigma
                continue
            lo = sigma if b.lower > target else down_until_too_small(sigma)
            break
    else:  # undecided at the coarse error: step out both ways
        lo = down_until_too_small(sigma / 1.25)
        hi = up_until_enough(sigma * 1.25)
    if lo is None:
        return _certify(bounds, hi, fine, target)[0]
    # ---- refine at the template's eps_error: scipy's Brent root finder (as dp_accounting's
    # noise search) on f(x) = log eps(e^x) - log(aim), x = log sigma, aim the middle of the
    # accepted band; it stops at the first sigma whose epsilon is in the band
    hi, e_hi = _certify(bounds, hi, fine, target)
    if target - e_hi <= epsilon_tolerance:
        return hi
    aim = target - 0.5 * epsilon_tolerance

    def log_ratio(e: float) -> float:
        """``log(e / aim)``, finite for ``e`` in ``[0, inf]`` (Brent needs finite values)."""
        return math.log(min(max(e, 1e-300), 1e300) / aim)

    x_lo, x_hi = math.log(lo), math.log(hi)
    # lo's coarse lower bound under-states its epsilon: a safe end value that costs no fine run
    ends = {x_lo: log_ratio(coarse(lo).lower), x_hi: log_ratio(e_hi)}
    feasible = [hi]  # sigmas whose epsilon at the template's eps_error is at most the target

    def f(x: float) -> float:
        if x in ends:
            return ends[x]
        sigma = math.exp(x)
        try:
            e = bounds(sigma, fine).upper
        except NumericalLimitError:
            # no fine answer here: decide with the coarse bounds, never by assumption
            if coarse(sigma).lower > target:
                return log_ratio(math.inf)
            raise
        if e <= target:
            feasible.append(sigma)
            if target - e <= epsilon_tolerance:
                raise _FoundError(sigma)
        return log_ratio(e)

    try:
        optimize.brentq(f, x_lo, x_hi, xtol=1e-6, maxiter=100, disp=False)
    except _FoundError as found:
        return found.args[0]
    return min(feasible)  # the bracket closed (relative width 1e-6) before the band was hit


class _FoundError(Exception):
    """Raised inside the root finder at the first sigma whose epsilon is in the accepted band."""


def _certify(bounds, sigma: float, fine: float, target: float) -> tuple[float, float]:
    """``(sigma', epsilon)``: ``sigma`` raised by 5 % steps until its epsilon at the template's
    ``eps_error`` is at most the target (one step at most, in practice).

    Raises:
        NumericalLimitError: if that epsilon cannot be computed at ``eps_error=fine``.
    """
    while True:
        try:
            e = bounds(sigma, fine).upper
        except NumericalLimitError as exc:
            raise NumericalLimitError(
                f"noise_multiplier={sigma:.6g} meets the target at a coarse eps_error, but "
                f"its epsilon cannot be certified at the accountant's eps_error={fine:g}: "
                f"{exc}"
            ) from exc
        if e <= target:
            return sigma, e
        sigma *= 1.05
