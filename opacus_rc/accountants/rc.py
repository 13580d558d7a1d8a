"""``RCAccountant``: the Opacus accountant of DP-SGD with randomized clipping (mechanism ``"rc"``).

Each optimizer step reports ``(noise_multiplier, sample_rate, sketch spec)``; the accountant
composes the privacy loss random variables of THEORY.md section C for that exact sketch (both
adjacency directions, remove and add) with ``prv_accountant`` and reports the larger epsilon.
Steps without a sketch (plain Opacus optimizers, exact clipping) are accounted as exact
clipping, so ``opacus.PrivacyEngine(accountant="rc")`` works for unmodified Opacus scripts.

History format (plain data, so ``torch.load(weights_only=True)`` checkpoints work):

* ``(noise_multiplier, sample_rate, steps, spec)``, written by :meth:`RCAccountant.step`, with
  ``spec`` either ``None`` (exact clipping) or ``SketchSpec.to_dict()``;
* ``(noise_multiplier, sample_rate, steps)``, written by Opacus'
  ``opacus.accountants.utils.get_noise_multiplier``: accounted with the accountant's own sketch
  (its constructor's ``sketch_dim``; exact clipping if ``None``).

RDP and GDP are never used: the RDP of randomized clipping is infinite (THEORY.md B.6).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from opacus.accountants.accountant import IAccountant

from opacus_rc.accountants.analysis._checks import check_delta, check_q, check_sigma
from opacus_rc.accountants.analysis.compose import EpsilonReport, Segment, compute_epsilon
from opacus_rc.accountants.analysis.envelope import SensitivityEnvelope
from opacus_rc.accountants.analysis.errors import EpsilonOutOfRangeError
from opacus_rc.accountants.analysis.threat_models import THREAT_MODELS
from opacus_rc.sketching import SketchSpec

__all__ = ["RCAccountant", "get_noise_multiplier", "register"]

logger = logging.getLogger(__name__)

#: Largest noise multiplier :func:`get_noise_multiplier` tries before giving up.
MAX_SIGMA = 1e4
#: Smallest noise multiplier :func:`get_noise_multiplier` tries.
MIN_SIGMA = 1e-3


def _spec_dict(sketch_spec: SketchSpec | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Validated plain-dict form of a sketch spec (``None`` stays ``None``: exact clipping)."""
    if sketch_spec is None:
        return None
    if isinstance(sketch_spec, SketchSpec):
        return sketch_spec.to_dict()
    if isinstance(sketch_spec, Mapping):
        return SketchSpec.from_dict(dict(sketch_spec)).to_dict()
    raise TypeError(
        f"sketch_spec must be a SketchSpec, its to_dict() form or None, got "
        f"{type(sketch_spec).__name__}"
    )


class RCAccountant(IAccountant):
    """Privacy accountant for DP-SGD with randomized clipping (and exact clipping).

    PRV accounting (Gopi et al. 2021) of the envelope mechanism of THEORY.md B-C, in both
    adjacency directions; :meth:`get_epsilon` returns the guaranteed upper bound, the maximum
    over directions. Heterogeneous histories (changing noise, sample rate or sketch) compose.

    Example:
        >>> acc = RCAccountant(sketch_dim=32)
        >>> acc.history = [(1.0, 0.01, 1000)]   # as Opacus' get_noise_multiplier writes it
        >>> round(acc.get_epsilon(delta=1e-5), 2)
        2.15

    Args:
        sketch_dim: ``k`` used for 3-tuple history entries (those written by Opacus'
            ``get_noise_multiplier``); ``None`` (default) means exact clipping. Steps reported
            by an optimizer carry their own sketch spec.
        envelope: ``"chi2"`` (default, THEORY.md B.3 item 4) or ``"chernoff"`` (item 5, fully
            proved, more conservative).
        threat_model: ``"hidden"`` (default; valid for per-sample, secret sketches) or
            ``"revealed"`` (the paper's; valid for any sketch sharing). Steps whose sketch is
            shared or seeded publicly are accounted as ``"revealed"`` regardless.
        eps_error: Epsilon error of the PRV discretisation (default 0.01, as Opacus).

    Raises:
        ValueError: on an invalid ``sketch_dim``, ``envelope``, ``threat_model`` or ``eps_error``.
    """

    #: Tells ``opacus_rc.PrivacyEngine`` that this accountant understands sketch specs.
    supports_randomized_clipping = True

    def __init__(
        self,
        *,
        sketch_dim: int | None = None,
        envelope: str = "chi2",
        threat_model: str = "hidden",
        eps_error: float = 0.01,
    ) -> None:
        SensitivityEnvelope(sketch_dim=sketch_dim, envelope=envelope)  # validates both
        if threat_model not in THREAT_MODELS:
            raise ValueError(f"threat_model must be one of {THREAT_MODELS}, got {threat_model!r}")
        if not (isinstance(eps_error, (int, float)) and 0.0 < eps_error < 1.0):
            raise ValueError(f"eps_error must be a number in (0, 1), got {eps_error!r}")
        super().__init__()
        self.sketch_dim = None if sketch_dim is None else int(sketch_dim)
        self.envelope = envelope
        self.threat_model = threat_model
        self.eps_error = float(eps_error)
        self._warned_revealed = False

    def __repr__(self) -> str:
        return (
            f"RCAccountant(sketch_dim={self.sketch_dim}, envelope={self.envelope!r}, "
            f"threat_model={self.threat_model!r}, eps_error={self.eps_error}, "
            f"steps={len(self)})"
        )

    @classmethod
    def mechanism(cls) -> str:
        return "rc"

    @property
    def sketch_spec(self) -> SketchSpec | None:
        """The accountant's own sketch (used for 3-tuple history entries)."""
        if self.sketch_dim is None:
            return None
        return SketchSpec(estimator="hutchinson", sketch_dim=self.sketch_dim)

    # ------------------------------------------------------------------ recording steps
    def step(
        self,
        *,
        noise_multiplier: float,
        sample_rate: float,
        sketch_spec: SketchSpec | Mapping[str, Any] | None = None,
    ) -> None:
        """Record one optimizer step.

        Args:
            noise_multiplier: Noise std in units of the clipping bound (> 0).
            sample_rate: Poisson sampling probability of the step, in ``(0, 1]``.
            sketch_spec: The sketch that produced the step's clip factors; ``None`` for exact
                clipping (e.g. a plain Opacus optimizer).

        Raises:
            ValueError: on ``noise_multiplier <= 0`` or ``sample_rate`` outside ``(0, 1]``.
        """
        sigma = check_sigma(noise_multiplier)
        q = check_q(sample_rate)
        spec = _spec_dict(sketch_spec)
        self._mode_for(spec)  # warns once if the step forces the revealed threat model
        if self.history:
            last = self.history[-1]
            if len(last) == 4 and last[0] == sigma and last[1] == q and last[3] == spec:
                self.history[-1] = (sigma, q, last[2] + 1, spec)
                return
        self.history.append((sigma, q, 1, spec))

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        """Step hook for an Opacus ``DPOptimizer``: reports sigma, ``q`` and the sketch spec.

        ``q = sample_rate * optim.accumulated_iterations`` as in Opacus; the sketch spec is the
        optimizer's ``sketch_spec`` attribute (``None``, exact clipping, if it has none).
        """

        def hook_fn(optim: Any) -> None:
            self.step(
                noise_multiplier=optim.noise_multiplier,
                sample_rate=sample_rate * optim.accumulated_iterations,
                sketch_spec=getattr(optim, "sketch_spec", None),
            )

        return hook_fn

    def __len__(self) -> int:
        """Number of optimization steps recorded (not history segments)."""
        return sum(int(entry[2]) for entry in self.history)

    # ------------------------------------------------------------------ accounting
    def _mode_for(self, spec: Mapping[str, Any] | None) -> str:
        if spec is None or self.threat_model == "revealed":
            return self.threat_model
        if SketchSpec.from_dict(dict(spec)).supports_hidden:
            return "hidden"
        if not self._warned_revealed:
            logger.warning(
                "a step used a sketch that is shared across samples or not secret (%s); its "
                "privacy is accounted with the 'revealed' threat model (THEORY.md B.2)",
                dict(spec),
            )
            self._warned_revealed = True
        return "revealed"

    def segments(self) -> list[Segment]:
        """The history as :class:`~opacus_rc.accountants.analysis.compose.Segment` runs.

        Raises:
            ValueError: on a malformed history entry (wrong length, ``steps < 0``, bad sigma
                or sample rate).
        """
        out = []
        own = _spec_dict(self.sketch_spec)
        for entry in self.history:
            if len(entry) == 3:
                sigma, q, steps = entry
                spec = own
            elif len(entry) == 4:
                sigma, q, steps, spec = entry
                spec = _spec_dict(spec)
            else:
                raise ValueError(
                    f"history entries must be (noise_multiplier, sample_rate, steps[, spec]), "
                    f"got {entry!r}"
                )
            if isinstance(steps, bool) or not isinstance(steps, (int, float)) or steps < 0:
                raise ValueError(f"steps must be an integer >= 0, got {steps!r} in {entry!r}")
            k = None if spec is None else SketchSpec.from_dict(dict(spec)).accounted_dim
            out.append(
                Segment(
                    noise_multiplier=sigma,
                    sample_rate=q,
                    steps=steps,
                    sketch_dim=k,
                    threat_model=self._mode_for(spec),
                )
            )
        return out

    def get_epsilon_report(
        self,
        delta: float,
        *,
        eps_error: float | None = None,
        delta_error: float | None = None,
    ) -> EpsilonReport:
        """Epsilon bounds ``(lower, estimate, upper)`` in both directions.

        Args:
            delta: Target delta in ``(0, 1)``.
            eps_error: Discretisation error in epsilon; default the constructor's.
            delta_error: Error in delta; default ``delta / 1000``.

        Raises:
            ValueError: on ``delta`` outside ``(0, 1)`` or a malformed history.
            EpsilonOutOfRangeError: if epsilon exceeds what the PRV accountant supports.
        """
        delta = check_delta(delta)
        return compute_epsilon(
            self.segments(),
            delta=delta,
            envelope=self.envelope,
            eps_error=self.eps_error if eps_error is None else eps_error,
            delta_error=delta_error,
        )

    def get_epsilon(
        self,
        delta: float,
        *,
        eps_error: float | None = None,
        delta_error: float | None = None,
        **kwargs: Any,
    ) -> float:
        """Privacy budget spent so far: the upper bound on epsilon, max over both directions.

        Args:
            delta: Target delta in ``(0, 1)``.
            eps_error: Discretisation error in epsilon; default the constructor's.
            delta_error: Error in delta; default ``delta / 1000``.
            **kwargs: Ignored (Opacus forwards arbitrary keyword arguments here).

        Raises:
            ValueError: on ``delta`` outside ``(0, 1)`` or a malformed history.
            EpsilonOutOfRangeError: if epsilon exceeds what the PRV accountant supports
                (never a too-small number).
        """
        return self.get_epsilon_report(delta, eps_error=eps_error, delta_error=delta_error).upper

    # ------------------------------------------------------------------ checkpoints
    def _config(self) -> dict[str, Any]:
        return {
            "sketch_dim": self.sketch_dim,
            "envelope": self.envelope,
            "threat_model": self.threat_model,
            "eps_error": self.eps_error,
        }

    def state_dict(self, destination: Any = None) -> Any:
        """Opacus' state dict (``history``, ``mechanism``) plus ``rc_config``, all plain data."""
        destination = super().state_dict(destination if destination is not None else OrderedDict())
        destination["rc_config"] = self._config()
        return destination

    def load_state_dict(self, state_dict: Any) -> None:
        """Load a state dict; restores ``rc_config`` (which decides how 3-tuples are accounted).

        Raises:
            ValueError: if the state dict is empty, lacks ``history``/``mechanism``, is of
                another mechanism, or has an invalid ``rc_config``.
        """
        super().load_state_dict(state_dict)
        self.history = [tuple(entry) for entry in self.history]
        config = state_dict.get("rc_config")
        if config is not None:
            restored = RCAccountant(**config)
            self.sketch_dim = restored.sketch_dim
            self.envelope = restored.envelope
            self.threat_model = restored.threat_model
            self.eps_error = restored.eps_error


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

    The returned ``sigma`` satisfies ``target - epsilon_tolerance <= epsilon(sigma) <= target``
    (unless the bracket closes first). Search: geometric bracketing, then safeguarded secant
    steps on ``log epsilon`` versus ``log sigma``; configurations out of the PRV range count as
    ``epsilon = inf``.

    Args:
        target_epsilon: Target epsilon (> 0).
        target_delta: Target delta in ``(0, 1)``.
        sample_rate: Poisson sampling probability ``q`` in ``(0, 1]``.
        epochs: Number of epochs; ``steps = int(epochs / sample_rate)`` as in Opacus. Give
            exactly one of ``epochs`` and ``steps``.
        steps: Number of optimizer steps.
        sketch_spec: The sketch of every step; ``None`` uses the accountant's own
            ``sketch_dim`` (exact clipping if that is ``None`` too).
        accountant: An :class:`RCAccountant` used as a template (envelope, threat model,
            ``eps_error``, ``sketch_dim``); it is not modified. Default ``RCAccountant()``.
        epsilon_tolerance: Accepted shortfall of epsilon below the target (> 0).

    Returns:
        The noise multiplier (noise std / clipping bound).

    Raises:
        ValueError: on invalid arguments, or if even ``sigma = 1e4`` does not reach the target.
    """
    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0.0):
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon!r}")
    target_delta = check_delta(target_delta)
    q = check_q(sample_rate)
    if not epsilon_tolerance > 0.0:
        raise ValueError(f"epsilon_tolerance must be > 0, got {epsilon_tolerance!r}")
    if (steps is None) == (epochs is None):
        raise ValueError("get_noise_multiplier takes exactly one of steps and epochs")
    if steps is None:
        if not epochs > 0:
            raise ValueError(f"epochs must be > 0, got {epochs!r}")
        steps = int(epochs / q)
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    steps = int(steps)
    template = RCAccountant() if accountant is None else accountant
    if not isinstance(template, RCAccountant):
        raise TypeError(
            f"accountant must be an RCAccountant (or None), got {type(template).__name__}"
        )
    work = RCAccountant(**template._config())
    spec = _spec_dict(sketch_spec)

    def eps(sigma: float) -> float:
        work.history = [(sigma, q, steps)] if spec is None else [(sigma, q, steps, spec)]
        try:
            return work.get_epsilon(target_delta)
        except EpsilonOutOfRangeError:
            return math.inf

    target = float(target_epsilon)
    aim = target - 0.5 * epsilon_tolerance
    sigma = 1.0
    e = eps(sigma)
    if e > target:
        lo, e_lo = sigma, e
        hi, e_hi = None, None
        while hi is None:
            sigma *= 2.0
            if sigma > MAX_SIGMA:
                raise ValueError(
                    f"the privacy budget epsilon={target} at delta={target_delta} is too low: not "
                    f"reached with noise_multiplier <= {MAX_SIGMA:g}"
                )
            e = eps(sigma)
            if e <= target:
                hi, e_hi = sigma, e
            else:
                lo, e_lo = sigma, e
    else:
        hi, e_hi = sigma, e
        lo, e_lo = None, None
        while lo is None:
            sigma /= 2.0
            if sigma < MIN_SIGMA:
                return hi
            e = eps(sigma)
            if e > target:
                lo, e_lo = sigma, e
            else:
                hi, e_hi = sigma, e
    # Regula falsi with the Illinois modification on f(x) = log eps(e^x) - log(aim), x = log sigma:
    # hi points have eps <= target, lo points eps > target (f > 0); a hi point with f > 0 is
    # within the tolerance and ends the search.
    x_lo, x_hi = math.log(lo), math.log(hi)
    f_lo = math.log(e_lo) - math.log(aim) if math.isfinite(e_lo) else math.inf
    f_hi = math.log(e_hi) - math.log(aim) if e_hi > 0.0 else -math.inf
    kept = None
    for _ in range(100):
        if target - e_hi <= epsilon_tolerance or x_hi - x_lo <= 1e-7:
            return math.exp(x_hi)
        width = x_hi - x_lo
        if math.isfinite(f_lo) and math.isfinite(f_hi):
            x = x_hi - f_hi * (x_hi - x_lo) / (f_hi - f_lo)
            x = min(max(x, x_lo + 1e-3 * width), x_hi - 1e-3 * width)
        else:
            x = 0.5 * (x_lo + x_hi)
        e = eps(math.exp(x))
        f = math.log(e) - math.log(aim) if 0.0 < e < math.inf else (math.inf if e > 0 else -1e300)
        if e > target:
            x_lo, e_lo, f_lo = x, e, f
            if kept == "lo":
                f_hi *= 0.5  # Illinois: the hi end was kept twice
            kept = "lo"
        else:
            x_hi, e_hi, f_hi = x, e, f
            if kept == "hi":
                f_lo *= 0.5
            kept = "hi"
    return math.exp(x_hi)


def register(*, force: bool = False) -> None:
    """Register :class:`RCAccountant` as mechanism ``"rc"`` in Opacus' accountant registry.

    Idempotent: registering again is a no-op. ``opacus_rc`` calls this on import.

    Args:
        force: Replace another class already registered as ``"rc"``.

    Raises:
        ValueError: if another class is registered as ``"rc"`` and ``force`` is False.
    """
    from opacus.accountants import registry

    existing = getattr(registry, "_ACCOUNTANTS", {}).get("rc")
    if existing is RCAccountant:
        return
    if existing is not None and not force:
        raise ValueError(
            f"Opacus already has {existing.__module__}.{existing.__qualname__} registered as "
            "accountant 'rc'; pass force=True to replace it with opacus_rc's RCAccountant"
        )
    registry.register_accountant("rc", RCAccountant, force=True)
