"""The accountant's ledger entries: one frozen event record per kind of DP-SGD-RC step.

An event holds the parameters that are necessary and sufficient to account for one step of
DP-SGD with (randomized) clipping, as the events of Google's ``dp_accounting``
(``dp_accounting.dp_event``) do for their mechanisms. :class:`RandomizedClipDpEvent` is:

    Poisson-sample each record with probability ``sample_rate``; for every sampled record
    ``i`` compute a clip factor ``c_i = min(1, C / sqrt(n_hat_i))`` from an estimate
    ``n_hat_i`` of its squared gradient norm (the exact norm if ``sketch_spec`` is ``None``;
    otherwise a Gaussian sketch described by ``sketch_spec``); release
    ``sum_i c_i g_i + N(0, (noise_multiplier * C)^2 I)``.

Adjacency is add/remove-one (both directions are accounted, docs/privacy/adjacency.md#adjacency).
The analysis (docs/privacy/prv.md#prv) depends on the sketch only through the number of Gaussian
columns that certify it (:attr:`~opacus_rc.sketching.SketchSpec.accounted_dim`) and on the threat
model: ``"hidden"`` (the sketch stays secret, drawn per sample) or ``"revealed"`` (valid for any
sketch sharing). Events are immutable and validated on construction; their meaning never changes
(new semantics get a new class).

The Opacus-compatible ``history`` of :class:`~opacus_rc.accountants.rc.RCAccountant` stores
plain tuples (safe for ``torch.load(weights_only=True)``); :func:`event_from_history_entry` is
the one place where such a tuple, including Opacus' own ``(noise_multiplier, sample_rate,
steps)``, becomes an event, and :func:`history_entry` the inverse.

:func:`accounted_threat_model` is the one place where the threat model of a step is chosen from
its sketch (the optimizer's :meth:`~opacus_rc.optimizers.RandomizedClipOptimizer.dp_event`, the
event's own check, the history adapter and
:meth:`~opacus_rc.accountants.rc.RCAccountant.threat_model_for` all call it), and
:func:`optimizer_step_event` the one place where the step of an optimizer becomes an event.
:func:`step_event` is the one constructor call of :class:`RandomizedClipDpEvent` in the package:
a run's step event is made from its mechanism (:meth:`opacus_rc.mechanism.Mechanism.step_event`),
the others (a history entry, ``RCAccountant.step``, the noise search, a plain Opacus optimizer)
from the values they are given.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opacus_rc.accountants.analysis.threat_models import THREAT_MODELS
from opacus_rc.sketch_spec import SketchSpec
from opacus_rc.validation import validate_choice, validate_noise_multiplier, validate_sample_rate

__all__ = [
    "RandomizedClipDpEvent",
    "accounted_threat_model",
    "event_from_history_entry",
    "history_entry",
    "optimizer_step_event",
    "sketch_spec_from",
    "step_event",
]


def accounted_threat_model(sketch_spec: SketchSpec | None, *, requested: str = "hidden") -> str:
    """The threat model a step with ``sketch_spec`` is accounted under when ``requested`` is asked.

    (docs/privacy/threat_models.md#threat-models):

    * exact clipping (``sketch_spec=None``): ``"hidden"``; ``S = 1`` and both models coincide;
    * a sketch that is shared across samples or not secret (``supports_hidden`` False):
      ``"revealed"``, the only model that holds for it;
    * otherwise ``requested``.

    Example:
        >>> from opacus_rc.sketching import SketchSpec
        >>> spec = SketchSpec("hutchinson", 32)
        >>> accounted_threat_model(spec), accounted_threat_model(spec, requested="revealed")
        ('hidden', 'revealed')
        >>> accounted_threat_model(None, requested="revealed")
        'hidden'

    Args:
        sketch_spec: The step's sketch, or ``None`` for exact clipping.
        requested: ``"hidden"`` (default, the strongest the sketch may support) or
            ``"revealed"``, e.g. the accountant's ``threat_model``.

    Returns:
        ``"hidden"`` or ``"revealed"``.

    Raises:
        ValueError: If ``requested`` is not a threat model (:data:`THREAT_MODELS`).
    """
    validate_choice("threat_model", requested, THREAT_MODELS)
    if sketch_spec is None:
        return "hidden"
    return requested if sketch_spec.supports_hidden else "revealed"


def sketch_spec_from(value: SketchSpec | Mapping[str, Any] | None) -> SketchSpec | None:
    """A :class:`~opacus_rc.sketching.SketchSpec` from itself, its ``to_dict()`` form or ``None``.

    Raises:
        TypeError: on anything else, or a mapping with unknown keys.
        ValueError: on a mapping with invalid values.
    """
    if value is None or isinstance(value, SketchSpec):
        return value
    if isinstance(value, Mapping):
        return SketchSpec.from_dict(dict(value))
    raise TypeError(
        f"sketch_spec must be a SketchSpec, its to_dict() form or None, got {type(value).__name__}"
    )


@dataclass(frozen=True)
class RandomizedClipDpEvent:
    """One step of DP-SGD with randomized (or exact) clipping, as the accountant composes it.

    Example:
        >>> from opacus_rc.sketching import SketchSpec
        >>> RandomizedClipDpEvent(noise_multiplier=1.0, sample_rate=0.01,
        ...                       sketch_spec=SketchSpec("hutchinson", 32)).sketch_dim
        32

    Attributes:
        noise_multiplier: ``sigma``, noise standard deviation in units of the clipping bound
            (finite, > 0; or 0 for a step without noise, whose epsilon is infinite).
        sample_rate: ``q``, Poisson sampling probability, in ``(0, 1]``.
        sketch_spec: The sketch that produced the clip factors (a
            :class:`~opacus_rc.sketching.SketchSpec`; its ``to_dict()`` form is converted), or
            ``None`` for exact clipping.
        threat_model: ``"hidden"`` (default) or ``"revealed"``
            (docs/privacy/threat_models.md#threat-models). Exact clipping has ``S = 1`` and both
            models coincide: it is stored as ``"hidden"``.

    Raises:
        TypeError: on a non-numeric sigma or sample rate, or a sketch spec of the wrong type.
        ValueError: on out-of-range values, an unknown threat model, or ``"hidden"`` for a
            sketch that is shared across samples or not secret (only ``"revealed"`` holds for
            it, docs/privacy/threat_models.md#threat-models).
    """

    noise_multiplier: float
    sample_rate: float
    sketch_spec: SketchSpec | None = None
    threat_model: str = "hidden"

    def __post_init__(self) -> None:
        sigma = validate_noise_multiplier(self.noise_multiplier)
        object.__setattr__(self, "noise_multiplier", sigma)
        object.__setattr__(self, "sample_rate", validate_sample_rate(self.sample_rate))
        spec = sketch_spec_from(self.sketch_spec)
        object.__setattr__(self, "sketch_spec", spec)
        mode = accounted_threat_model(spec, requested=self.threat_model)
        if spec is None:
            object.__setattr__(self, "threat_model", mode)
        elif mode != self.threat_model:  # "hidden" asked for a sketch that only has "revealed"
            raise ValueError(
                "the 'hidden' threat model needs per-sample, secret sketches "
                "(docs/privacy/threat_models.md#threat-models); "
                f"{spec} is shared or publicly seeded: use threat_model='revealed'"
            )

    @property
    def sketch_dim(self) -> int | None:
        """``k`` of the envelope that certifies the step (tail columns for Hutch++), or ``None``."""
        return None if self.sketch_spec is None else self.sketch_spec.accounted_dim


def history_entry(
    event: RandomizedClipDpEvent, count: int
) -> tuple[float, float, int, dict[str, Any] | None]:
    """The plain-data history tuple ``(noise_multiplier, sample_rate, steps, spec_dict)``."""
    spec = None if event.sketch_spec is None else event.sketch_spec.to_dict()
    return (event.noise_multiplier, event.sample_rate, int(count), spec)


def event_from_history_entry(
    entry: Sequence[Any],
    *,
    default_spec: SketchSpec | None,
    threat_model: str,
) -> tuple[RandomizedClipDpEvent, int]:
    """The one adapter from a history tuple to a typed ``(event, count)`` pair.

    Formats (a list is read as a tuple, as after a JSON round trip):

    * ``(noise_multiplier, sample_rate, steps)``: written by Opacus
      (``opacus.accountants.utils.get_noise_multiplier``, plain ``DPOptimizer`` histories);
      the sketch is ``default_spec`` (the accountant's own);
    * ``(noise_multiplier, sample_rate, steps, spec)``: written by
      :meth:`~opacus_rc.accountants.rc.RCAccountant.step`, ``spec`` a
      ``SketchSpec.to_dict()`` or ``None`` (exact clipping).

    The threat model is ``threat_model`` (the accountant's), except that a sketch which does
    not support the hidden model is accounted as ``"revealed"``
    (docs/privacy/threat_models.md#threat-models).

    Args:
        entry: The history tuple.
        default_spec: Sketch of 3-tuple entries (``None``: exact clipping).
        threat_model: ``"hidden"`` or ``"revealed"``.

    Returns:
        ``(event, steps)``.

    Raises:
        ValueError: on a malformed entry (wrong length, ``steps`` not an integer >= 0, bad
            sigma, sample rate or spec).
    """
    if not isinstance(entry, (tuple, list)) or len(entry) not in (3, 4):
        raise ValueError(
            f"history entries must be (noise_multiplier, sample_rate, steps[, spec]), got {entry!r}"
        )
    sigma, q, steps = entry[:3]
    spec = default_spec if len(entry) == 3 else sketch_spec_from(entry[3])
    if (
        isinstance(steps, bool)
        or not isinstance(steps, numbers.Real)
        or not 0 <= steps < math.inf
        or int(steps) != steps
    ):
        raise ValueError(f"steps must be an integer >= 0, got {steps!r} in {entry!r}")
    mode = accounted_threat_model(spec, requested=threat_model)
    event = step_event(noise_multiplier=sigma, sample_rate=q, sketch_spec=spec, threat_model=mode)
    return event, int(steps)


def optimizer_step_event(optimizer: Any, *, sample_rate: float) -> RandomizedClipDpEvent:
    """The event of the step an Opacus ``DPOptimizer`` just took (what its accountant composes).

    An optimizer that emits its step's event (``optimizer.dp_event(sample_rate=...)``, as
    :class:`~opacus_rc.optimizers.RandomizedClipOptimizer` does) is asked for it. Any other (a
    plain Opacus ``DPOptimizer``) is read through Opacus' public optimizer interface, as Opacus'
    own accountant hook reads it: ``sigma = optimizer.noise_multiplier``,
    ``q = sample_rate * optimizer.accumulated_iterations``, the sketch its ``sketch_spec``
    attribute (``None``, exact clipping, if it has none), the threat model
    :func:`accounted_threat_model` of that sketch.

    Args:
        optimizer: The optimizer (``DPOptimizer`` or anything with ``dp_event``).
        sample_rate: The Poisson sampling rate of one physical batch, in ``(0, 1]``.

    Returns:
        The step's event.

    Raises:
        ValueError: On an invalid noise multiplier or sample rate (as the event).
    """
    emit = getattr(optimizer, "dp_event", None)
    if emit is not None:
        return emit(sample_rate=sample_rate)
    spec = sketch_spec_from(getattr(optimizer, "sketch_spec", None))
    return step_event(
        noise_multiplier=optimizer.noise_multiplier,
        sample_rate=sample_rate * optimizer.accumulated_iterations,
        sketch_spec=spec,
    )


def step_event(
    *,
    noise_multiplier: float,
    sample_rate: float,
    sketch_spec: SketchSpec | None,
    threat_model: str | None = None,
) -> RandomizedClipDpEvent:
    """The event of one step: the one place a :class:`RandomizedClipDpEvent` is constructed.

    A run's steps get theirs from the run's mechanism
    (:meth:`opacus_rc.mechanism.Mechanism.step_event`); a history entry, ``RCAccountant.step``,
    the noise search and a plain Opacus optimizer from the values they hold.

    Args:
        noise_multiplier: ``sigma``.
        sample_rate: The step's accounted rate, in ``(0, 1]``.
        sketch_spec: The sketch that produced the clip factors, or ``None`` (exact clipping).
        threat_model: The threat model; ``None``: the strongest the sketch supports
            (:func:`accounted_threat_model`).

    Returns:
        The event.

    Raises:
        TypeError, ValueError: As :class:`RandomizedClipDpEvent`.
    """
    if threat_model is None:
        threat_model = accounted_threat_model(sketch_spec)
    return RandomizedClipDpEvent(
        noise_multiplier=noise_multiplier,
        sample_rate=sample_rate,
        sketch_spec=sketch_spec,
        threat_model=threat_model,
    )
