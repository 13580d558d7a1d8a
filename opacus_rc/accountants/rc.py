"""``RCAccountant``: the Opacus accountant of DP-SGD with randomized clipping (mechanism ``"rc"``).

Each optimizer step reports ``(noise_multiplier, sample_rate, sketch spec)``; the accountant
composes the privacy loss random variables of docs/privacy/prv.md#prv for that exact sketch (both
adjacency directions, remove and add) and reports the larger epsilon: the PRVs are
``prv_accountant`` PRVs, composed by ``prv_accountant``'s method (discretise, FFT) re-implemented
with an explicit error bound in :mod:`opacus_rc.accountants.analysis.compose`.
Steps without a sketch (plain Opacus optimizers, exact clipping) are accounted as exact
clipping, so ``opacus.PrivacyEngine(accountant="rc")`` works for unmodified Opacus scripts.

The ledger: every step is a frozen :class:`~opacus_rc.accountants.events.RandomizedClipDpEvent`
(noise multiplier, sample rate, sketch spec or ``None``, threat model), composed by
:meth:`RCAccountant.compose` (:meth:`RCAccountant.step` builds the event). Opacus reads and
writes ``history`` directly, so the ledger is stored there as plain data (``torch.load(
weights_only=True)`` checkpoints work) and read back as typed events by
:attr:`RCAccountant.ledger`, through the one adapter
:func:`~opacus_rc.accountants.events.event_from_history_entry`:

* ``(noise_multiplier, sample_rate, steps, spec)``, written by :meth:`RCAccountant.compose`,
  with ``spec`` either ``None`` (exact clipping) or ``SketchSpec.to_dict()``;
* ``(noise_multiplier, sample_rate, steps)``, written by Opacus'
  ``opacus.accountants.utils.get_noise_multiplier``: accounted with the accountant's own sketch
  (its constructor's ``sketch_dim``; exact clipping if ``None``).

RDP and GDP are never used: the RDP of randomized clipping is infinite
(docs/privacy/heavy_tails.md#heavy-tails-rdp).

Why one module: it holds one concept, the accountant of mechanism ``"rc"``, whose methods
Opacus' ``IAccountant`` interface fixes (``step``, ``get_epsilon``, ``get_optimizer_hook_fn``,
``state_dict`` / ``load_state_dict``, ``mechanism``, ``len``) and which all read or write the
one ledger, ``history``. Each method is a thin layer over the module that owns its concept:
the events and the threat-model choice are :mod:`~opacus_rc.accountants.events`, the epsilon
(both directions, and the replace-one conversion) is
:mod:`~opacus_rc.accountants.analysis.epsilon`, the composition is
:mod:`~opacus_rc.accountants.analysis.compose`; what stays here is the ledger's bookkeeping
(recording, merging, reading back, checkpointing) and the one-time warnings.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from opacus_rc.accountants.analysis.envelope import SensitivityEnvelope
from opacus_rc.accountants.analysis.epsilon import (
    EpsilonReport,
    Segment,
    compute_epsilon,
    compute_epsilon_replace_one,
)
from opacus_rc.accountants.analysis.threat_models import THREAT_MODELS
from opacus_rc.accountants.events import (
    RandomizedClipDpEvent,
    accounted_threat_model,
    event_from_history_entry,
    history_entry,
    optimizer_step_event,
    sketch_spec_from,
    step_event,
)
from opacus_rc.sketch_spec import SketchSpec
from opacus_rc.validation import validate_delta

__all__ = ["RCAccountant", "register"]

logger = logging.getLogger(__name__)


class RCAccountant:
    """Privacy accountant for DP-SGD with randomized clipping (and exact clipping).

    PRV accounting (Gopi et al. 2021) of the envelope mechanism (docs/privacy/prv.md#prv), in both
    adjacency directions; :meth:`get_epsilon` returns the guaranteed upper bound, the maximum
    over directions (0 where it would be negative).

    **Adjacency**: the epsilon of :meth:`get_epsilon` holds for *add/remove* adjacency only
    (neighbouring datasets differ by the presence of one record), as in Opacus. Under
    *replace-one* adjacency (one record's value changed) it does not hold: use
    :meth:`get_epsilon_replace_one` (docs/privacy/adjacency.md). Heterogeneous histories
    (changing noise,
    sample rate or sketch) compose; long horizons are composed in blocks
    (:mod:`~opacus_rc.accountants.analysis.compose`).

    Example:
        >>> acc = RCAccountant(sketch_dim=32)
        >>> acc.history = [(1.0, 0.01, 1000)]   # as Opacus' get_noise_multiplier writes it
        >>> round(acc.get_epsilon(delta=1e-5), 2)
        2.15

    Args:
        sketch_dim: ``k`` used for 3-tuple history entries (those written by Opacus'
            ``get_noise_multiplier``); ``None`` (default) means exact clipping. Steps reported
            by an optimizer carry their own sketch spec.
        envelope: ``"chi2"`` (default, docs/privacy/envelope.md#envelope-law) or ``"chernoff"``
            (fully proved, more conservative; docs/privacy/envelope.md#envelope-chernoff).
        threat_model: ``"hidden"`` (default; valid for per-sample, secret sketches) or
            ``"revealed"`` (the paper's; valid for any sketch sharing). Steps whose sketch is
            shared or seeded publicly are accounted as ``"revealed"`` regardless.
        eps_error: Bound on the discretisation error in epsilon (default 0.01, as Opacus);
            it holds with probability budget ``delta_error`` (default ``delta / 1000``), and
            ``get_epsilon`` adds both (docs/privacy/error_budget.md). At this budget and
            ``delta = 1e-5`` the composition fits the numerical limits (FFTs of at most
            ``2^24`` points) for 10^6 steps for noise_multiplier >= 0.8 and
            ``1e-3 <= sample_rate <= 0.1``, and for 10^7 steps for noise_multiplier >= 1 and
            ``1e-3 <= sample_rate <= 0.01`` (exact clipping and ``k = 32``; smaller ``k``
            has a heavier tail and needs more). Elsewhere, e.g. 10^7 steps at
            ``sample_rate = 0.05``, ``noise_multiplier = 0.8``, :class:`NumericalLimitError`
            names an ``eps_error`` that fits. 10^7 steps take about 75 s on one core
            (``sample_rate = 0.01``, ``noise_multiplier = 0.8``, measured on a shared 2-core
            machine at load average 3).

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
        #: The ledger, in Opacus' ``IAccountant`` format (Opacus reads and writes it).
        self.history: list[tuple[Any, ...]] = []
        self.sketch_dim = None if sketch_dim is None else int(sketch_dim)
        self.envelope = envelope
        self.threat_model = threat_model
        self.eps_error = float(eps_error)
        self._warned_revealed = False
        self._warned_noiseless = False
        self._warned_exact_step = False
        #: ``(event, threat_model, history entry)`` of the last :meth:`record`: the same
        #: (frozen) event recorded again, with the history untouched since, is one more step
        #: of that entry (what the slow path would merge it into), without re-deriving it.
        self._last_record: tuple[Any, str, tuple[Any, ...]] | None = None

    def mark_revealed_warning_given(self) -> None:
        """Skip the one-time log warning of :meth:`step` for a sketch that is not secret.

        For a caller that has already told the user, e.g. ``opacus_rc.PrivacyEngine``, which
        warns once at ``make_private`` when a ``sketch_generator`` is passed. The steps are
        still accounted with the ``"revealed"`` threat model.
        """
        self._warned_revealed = True

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
        """Record one optimizer step (the Opacus ``IAccountant`` interface).

        Builds the step's :class:`~opacus_rc.accountants.events.RandomizedClipDpEvent` with
        the threat model this accountant uses for ``sketch_spec`` (``"revealed"`` for a sketch
        shared across samples or not secret, with a warning the first time) and composes it.

        A step without noise (``noise_multiplier = 0``, a debugging run that separates the
        clipping's effect from the noise's) is recorded, with a ``UserWarning`` the first time:
        from then on :meth:`get_epsilon` is ``inf``, as Opacus' accountants report it.

        Args:
            noise_multiplier: Noise std in units of the clipping bound (> 0, or 0 for a step
                without noise).
            sample_rate: Poisson sampling probability of the step, in ``(0, 1]``.
            sketch_spec: The sketch that produced the step's clip factors; ``None`` for exact
                clipping (e.g. a plain Opacus optimizer). On an accountant built with a
                ``sketch_dim``, ``None`` still means exact clipping (``sketch_dim`` applies to
                3-tuple history entries only), and the first such call warns: a sketched step
                must pass its spec (e.g. ``sketch_spec=accountant.sketch_spec``), or its epsilon
                would be under-reported.

        Raises:
            ValueError: on ``noise_multiplier < 0`` (or not finite) or ``sample_rate``
                outside ``(0, 1]``.
        """
        warned = getattr(self, "_warned_exact_step", False)
        if sketch_spec is None and self.sketch_dim is not None and not warned:
            self._warned_exact_step = True
            warnings.warn(
                f"RCAccountant(sketch_dim={self.sketch_dim}).step() without a sketch_spec "
                "records the step as exact clipping (sketch_dim applies to 3-tuple history "
                "entries only); if the step's clip factors came from a sketch, pass its spec "
                "(sketch_spec=accountant.sketch_spec for Hutchinson with this sketch_dim), "
                "or the epsilon is under-reported",
                UserWarning,
                stacklevel=2,
            )
        spec = sketch_spec_from(sketch_spec)
        event = step_event(
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            sketch_spec=spec,
            threat_model=self.threat_model_for(spec, warn=True),
        )
        self.record(event)

    def record(self, event: RandomizedClipDpEvent) -> None:
        """Record one optimizer step given as its complete event (what an optimizer emits).

        The event is composed as given, except that an accountant built for ``"revealed"``
        (or a sketch that supports only ``"revealed"``) accounts a ``"hidden"`` event under
        ``"revealed"``, the weaker assumption (logged once). A step without noise is recorded
        with a ``UserWarning`` the first time, as in :meth:`step`.

        Args:
            event: The step's event
                (:meth:`~opacus_rc.optimizers.RandomizedClipOptimizer.dp_event`).

        Raises:
            TypeError: If ``event`` is not a ``RandomizedClipDpEvent``.
            ValueError: As :meth:`compose` (e.g. a ``"revealed"`` event for an accountant
                that accounts its sketch under ``"hidden"``).
        """
        last = self._last_record
        if (
            last is not None
            and last[0] is event
            and last[1] == self.threat_model
            and self.history
            and self.history[-1] is last[2]
        ):
            entry = last[2]
            self.history[-1] = (*entry[:2], int(entry[2]) + 1, *entry[3:])
            self._last_record = (event, self.threat_model, self.history[-1])
            return
        if not isinstance(event, RandomizedClipDpEvent):
            raise TypeError(f"RCAccountant records RandomizedClipDpEvent, got {event!r}")
        original = event
        accounted = self.threat_model_for(event.sketch_spec, warn=True)
        if accounted == "revealed" and event.threat_model == "hidden":
            event = dataclasses.replace(event, threat_model="revealed")
        if event.noise_multiplier == 0.0 and not getattr(self, "_warned_noiseless", False):
            warnings.warn(
                "RCAccountant recorded a step without noise (noise_multiplier=0): the run is "
                "not differentially private, and get_epsilon() is inf from now on",
                UserWarning,
                stacklevel=2,
            )
            self._warned_noiseless = True
        self.compose(event)
        self._last_record = (original, self.threat_model, self.history[-1])

    def supports(self, event: Any) -> bool:
        """Whether :meth:`compose` accepts ``event``.

        True for a :class:`~opacus_rc.accountants.events.RandomizedClipDpEvent` whose threat
        model is the one this accountant uses for its sketch (the constructor's
        ``threat_model``, or ``"revealed"`` for a sketch that does not support ``"hidden"``):
        the history stores the sketch, and the threat model is read back from it.
        """
        return isinstance(
            event, RandomizedClipDpEvent
        ) and event.threat_model == self.threat_model_for(event.sketch_spec)

    def compose(self, event: RandomizedClipDpEvent, count: int = 1) -> RCAccountant:
        """Add ``count`` steps of ``event`` to the ledger (merged with the last entry if equal).

        Args:
            event: The step.
            count: Number of identical steps, an integer >= 1.

        Returns:
            ``self``, as ``dp_accounting``'s accountants.

        Raises:
            TypeError: if ``event`` is not a ``RandomizedClipDpEvent``.
            ValueError: if the accountant does not support it (:meth:`supports`) or on a bad
                ``count``.
        """
        if not isinstance(event, RandomizedClipDpEvent):
            raise TypeError(f"RCAccountant composes RandomizedClipDpEvent, got {event!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an integer >= 1, got {count!r}")
        if not self.supports(event):
            raise ValueError(
                f"this accountant (threat_model={self.threat_model!r}) accounts the sketch of "
                f"{event} under the {self.threat_model_for(event.sketch_spec)!r} threat model; to "
                f"compose {event.threat_model!r} events use "
                f"RCAccountant(threat_model={event.threat_model!r})"
            )
        entry = history_entry(event, count)
        if self.history:
            last = self.history[-1]
            if len(last) == 4 and tuple(last[:2]) == entry[:2] and last[3] == entry[3]:
                self.history[-1] = (*entry[:2], int(last[2]) + count, entry[3])
                return self
        self.history.append(entry)
        return self

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        """Step hook for an Opacus ``DPOptimizer``: composes the event of the step it took.

        The event is the optimizer's own
        (:func:`~opacus_rc.accountants.events.optimizer_step_event`:
        ``optim.dp_event(sample_rate=...)``, as
        :class:`~opacus_rc.optimizers.RandomizedClipOptimizer` emits it; for a plain Opacus
        optimizer, the event of its ``noise_multiplier``, ``sample_rate *
        accumulated_iterations`` and exact clipping, as Opacus' hook reads them), and is
        composed by :meth:`record`; the accountant reads nothing else of the optimizer.
        """

        def hook_fn(optim: Any) -> None:
            emit = getattr(optim, "dp_event", None)  # an optimizer that emits is asked directly
            if emit is not None:
                self.record(emit(sample_rate=sample_rate))
            else:
                self.record(optimizer_step_event(optim, sample_rate=sample_rate))

        return hook_fn

    def __len__(self) -> int:
        """Number of optimization steps recorded (not history segments)."""
        return sum(int(entry[2]) for entry in self.history)

    # ------------------------------------------------------------------ accounting
    def threat_model_for(self, sketch_spec: SketchSpec | None, *, warn: bool = False) -> str:
        """The threat model this accountant accounts a step with sketch ``sketch_spec`` under.

        :func:`~opacus_rc.accountants.events.accounted_threat_model` with the constructor's
        ``threat_model`` requested: that model for a sketch that supports it, ``"revealed"`` for
        a sketch that is shared across samples or not secret (``supports_hidden`` is False), and
        ``"hidden"`` for exact clipping (``sketch_spec=None``, where both models coincide).

        Args:
            sketch_spec: The step's sketch, or ``None`` for exact clipping.
            warn: Log a one-time warning when the answer is ``"revealed"`` although the
                accountant was built with ``"hidden"`` (what :meth:`step` does).

        Returns:
            ``"hidden"`` or ``"revealed"``: the ``threat_model`` of the
            :class:`~opacus_rc.accountants.events.RandomizedClipDpEvent` :meth:`compose`
            accepts for this sketch.
        """
        mode = accounted_threat_model(sketch_spec, requested=self.threat_model)
        downgraded = sketch_spec is not None and mode != self.threat_model
        if downgraded and warn and not self._warned_revealed:
            logger.warning(
                "a step used a sketch that is shared across samples or not secret (%s); its "
                "privacy is accounted with the 'revealed' threat model "
                "(docs/privacy/threat_models.md#threat-models)",
                sketch_spec.to_dict(),
            )
            self._warned_revealed = True
        return mode

    def clear(self) -> None:
        """Empty the ledger (``history``); the configuration is kept."""
        self.history = []

    def empty_copy(self) -> RCAccountant:
        """A new accountant with this one's configuration (:meth:`config`) and an empty ledger.

        Used by :func:`~opacus_rc.accountants.noise_search.get_noise_multiplier` to evaluate
        candidate noise multipliers without touching the caller's accountant.
        """
        return RCAccountant(**self.config())

    @property
    def ledger(self) -> list[tuple[RandomizedClipDpEvent, int]]:
        """The history as typed ``(event, steps)`` pairs, in order.

        Raises:
            ValueError: on a malformed history entry (wrong length, ``steps < 0``, bad sigma,
                sample rate or spec).
        """
        return [
            event_from_history_entry(
                entry, default_spec=self.sketch_spec, threat_model=self.threat_model
            )
            for entry in self.history
        ]

    def segments(self) -> list[Segment]:
        """The ledger as :class:`~opacus_rc.accountants.analysis.epsilon.Segment` runs.

        Raises:
            ValueError: on a malformed history entry (wrong length, ``steps < 0``, bad sigma
                or sample rate).
        """
        return [
            Segment(
                noise_multiplier=event.noise_multiplier,
                sample_rate=event.sample_rate,
                steps=steps,
                sketch_dim=event.sketch_dim,
                threat_model=event.threat_model,
            )
            for event, steps in self.ledger
        ]

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
            EpsilonOutOfRangeError: if epsilon exceeds every value the analysis certifies at
                this delta (a privacy answer: more noise, a larger sketch or delta helps).
            NumericalLimitError: if the composition exceeds the numerical limits at this
                ``eps_error`` (not a statement about epsilon: a larger ``eps_error`` helps).
        """
        delta = validate_delta(delta)
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
            EpsilonOutOfRangeError: if epsilon exceeds every value the analysis certifies
                (never a too-small number).
            NumericalLimitError: if it cannot be computed at this ``eps_error`` (a numerical
                limit, not a privacy answer).
        """
        return self.get_epsilon_report(delta, eps_error=eps_error, delta_error=delta_error).upper

    def get_epsilon_replace_one(
        self,
        delta: float,
        *,
        eps_error: float | None = None,
        delta_error: float | None = None,
    ) -> float:
        """An upper bound on epsilon under *replace-one* adjacency (one record's value changed).

        The conversion from the add/remove accounting of
        :func:`~opacus_rc.accountants.analysis.epsilon.compute_epsilon_replace_one` (remove
        ``x``, then add ``x'``: ``eps_R + eps_A``; docs/privacy/adjacency.md#adjacency-replace-one).
        Valid but not tight: at ``q = 0.01``, ``sigma = 1``, 1000 steps, ``delta = 1e-5``
        (exact clipping) it is 3.55, against the exact 2.84 (and 1.84 under add/remove).

        Args:
            delta: Target delta in ``(0, 1)``.
            eps_error: Discretisation error in epsilon; default the constructor's.
            delta_error: Error in delta of each of the two computations; default
                ``delta / 1000`` of each one's delta.

        Raises:
            Those of :meth:`get_epsilon_report`.
        """
        return compute_epsilon_replace_one(
            self.segments(),
            delta=delta,
            envelope=self.envelope,
            eps_error=self.eps_error if eps_error is None else eps_error,
            delta_error=delta_error,
        )

    # ------------------------------------------------------------------ checkpoints
    def config(self) -> dict[str, Any]:
        """The constructor's keyword arguments that rebuild this accountant (no ledger): plain
        data, stored in :meth:`state_dict` as ``rc_config``."""
        return {
            "sketch_dim": self.sketch_dim,
            "envelope": self.envelope,
            "threat_model": self.threat_model,
            "eps_error": self.eps_error,
        }

    def state_dict(self, destination: Any = None) -> Any:
        """Opacus' state dict (``history``, ``mechanism``) plus ``rc_config``, all plain data."""
        destination = destination if destination is not None else OrderedDict()
        destination["history"] = copy.deepcopy(self.history)
        destination["mechanism"] = self.mechanism()
        destination["rc_config"] = self.config()
        return destination

    def load_state_dict(self, state_dict: Any) -> None:
        """Load a state dict; restores ``rc_config`` (which decides how 3-tuples are accounted).

        Every history entry is read through the ledger adapter, so a malformed checkpoint fails
        here rather than at the next :meth:`get_epsilon`. Checkpoints of every history format
        (Opacus' 3-tuples, this accountant's 4-tuples, lists after a JSON round trip) load.

        Raises:
            ValueError: if the state dict is empty, lacks ``history``/``mechanism``, is of
                another mechanism, has an invalid ``rc_config`` or a malformed history entry.
        """
        config = state_dict.get("rc_config") if state_dict else None
        restored = RCAccountant(**config) if config is not None else self
        # The checks and messages of Opacus' ``IAccountant.load_state_dict``.
        if not state_dict:
            raise ValueError(
                "state dict is either None or empty and hence cannot be loaded into Privacy "
                "Accountant."
            )
        for key in ("history", "mechanism"):
            if key not in state_dict:
                raise ValueError(
                    f"state_dict does not have the key `{key}`. Cannot be loaded into Privacy "
                    "Accountant."
                )
        if state_dict["mechanism"] != self.mechanism():
            raise ValueError(
                f"state_dict of {state_dict['mechanism']} cannot be loaded into Privacy "
                f"Accountant with mechanism {self.mechanism()}"
            )
        self.history = [tuple(entry) for entry in state_dict["history"]]
        self.sketch_dim = restored.sketch_dim
        self.envelope = restored.envelope
        self.threat_model = restored.threat_model
        self.eps_error = restored.eps_error
        _ = self.ledger  # reads (validates) every entry


def register(*, force: bool = False) -> None:
    """Register :class:`RCAccountant` as mechanism ``"rc"`` in Opacus' accountant registry.

    Imports Opacus (and so PyTorch); the accountant itself needs neither, so it is a plain class
    with the methods of Opacus' ``IAccountant``, registered here as a virtual subclass of it
    (``isinstance(RCAccountant(), IAccountant)`` holds from then on). Idempotent: registering
    again is a no-op. ``import opacus_rc`` calls it when PyTorch or Opacus is already imported,
    and otherwise the first use of an Opacus-facing name of ``opacus_rc`` does
    (``opacus_rc.PrivacyEngine`` also calls it itself); a script that imports ``opacus_rc``
    before ``torch`` and ``opacus`` and uses only ``opacus.PrivacyEngine(accountant="rc")``
    calls it.

    Args:
        force: Replace another class already registered as ``"rc"``.

    Raises:
        ValueError: if another class is registered as ``"rc"`` and ``force`` is False.
    """
    from opacus.accountants import IAccountant, registry

    from opacus_rc._compat.opacus import registered_accountant

    existing = registered_accountant("rc")
    if existing is RCAccountant and issubclass(RCAccountant, IAccountant):
        return
    if existing is not None and not force:
        raise ValueError(
            f"Opacus already has {existing.__module__}.{existing.__qualname__} registered as "
            "accountant 'rc'; pass force=True to replace it with opacus_rc's RCAccountant"
        )
    IAccountant.register(RCAccountant)  # a virtual subclass: no-op if already registered
    registry.register_accountant("rc", RCAccountant, force=True)
