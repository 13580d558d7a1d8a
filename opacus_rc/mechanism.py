"""The mechanism of one run: every public quantity of a step, in one record.

A private run releases, at every step, ``sum_i c_i g_i + N(0, sigma^2 C^2 I)`` over a Poisson
sample of rate ``q``, divided by a public expected batch size
(docs/privacy/mechanism.md#mechanism-public). Everything the accountant, the noise and the
division need is fixed before the data are seen, and is the same on neighbouring datasets: it
is computed once per run, from public inputs only, into one frozen :class:`Mechanism`.

* :class:`PublicSizes`: the sampling schedule and the divisor, from the data loader and the
  public ``dataset_size`` (:func:`opacus_rc.engine.schedule.public_sizes`, the one function that
  computes them, for the engine and the DP trainers alike);
* :class:`Mechanism`: those sizes with ``C``, ``sigma``, the sketch and the threat model, built
  once by ``PrivacyEngine.make_private`` (``engine.mechanism``, ``optimizer.mechanism``); its
  :meth:`Mechanism.step_event` is the DP event of every step of the run.

This module imports no torch (only the event record of :mod:`opacus_rc.accountants.events`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opacus_rc.accountants.events import RandomizedClipDpEvent, accounted_threat_model, step_event

if TYPE_CHECKING:
    from opacus_rc.sketching import SketchSpec

__all__ = ["PRIVACY_UNITS", "Mechanism", "PublicSizes"]

#: What one sampled element is: a record (a row of the dataset), or a unit of several records
#: (a document or user of a :class:`~opacus_rc.units.UnitDataLoader`).
PRIVACY_UNITS = ("record", "unit")


@dataclass(frozen=True)
class PublicSizes:
    """The sampling schedule and divisor of a run, from public inputs only.

    Computed by :func:`opacus_rc.engine.schedule.public_sizes` (docs/privacy/mechanism.md,
    table "On every path"), never from ``len(dataset)`` unless the rate treats the number of
    records as public, and never the divisor from the number of records or units.

    Attributes:
        sample_rate: ``q``, the Poisson rate the loader samples at: ``1 / n`` with ``n`` the
            loader's batches (from its ``batch_size`` and ``dataset_size``, else
            ``len(dataset)``), or ``1 / int(1 / sample_rate)`` of a unit loader.
        expected_batch_size: The divisor of the noisy sum under ``loss_reduction="mean"``, the
            expected *global* batch: the loader's ``batch_size`` (times the world size for
            per-rank batches), a unit loader's ``expected_batch_size`` or
            ``int(dataset_size * q)``; None under ``loss_reduction="sum"`` where no public
            number was given (nothing is divided).
        accounted_rate: The rate the accountant records for each step: ``1 / steps_per_epoch``
            of a Poisson loader (Opacus' ``1 / len(loader)``, at least ``q``: ``q = 1/93``
            gives ``1/92``), ``sample_rate`` itself for a unit loader.
        steps_per_epoch: Steps of one epoch: ``int(1 / q)`` of a Poisson loader,
            ``len(data_loader)`` of a loader used as it is (a unit loader's ``steps``,
            ``poisson_sampling=False``).
        privacy_unit: ``"record"``, or ``"unit"`` for a unit loader (whose rate and steps
            follow the unit rule above).
        world_size: The number of data-parallel processes ``W`` (1: one process).
    """

    sample_rate: float
    expected_batch_size: int | None
    accounted_rate: float
    steps_per_epoch: int
    privacy_unit: str = "record"
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.privacy_unit not in PRIVACY_UNITS:
            raise ValueError(
                f"privacy_unit must be one of {PRIVACY_UNITS}, got {self.privacy_unit!r}"
            )

    @property
    def divisor(self) -> float | int | None:
        """The divisor of one process's noisy sum: :attr:`expected_batch_size` over
        :attr:`world_size` in a distributed run (each process divides its share, as Opacus),
        else :attr:`expected_batch_size` itself; None when nothing is divided."""
        size = self.expected_batch_size
        if size is None or self.world_size == 1:
            return size
        return size / self.world_size


@dataclass(frozen=True)
class Mechanism:
    """Every public quantity of a run's step: what the accountant accounts and the noise uses.

    Built once per ``make_private`` call (after the noise multiplier is given or searched) from
    the validated request; the engine exposes it as ``engine.mechanism`` and hands it to the
    optimizer (``optimizer.mechanism``), whose divisor, noise scale and DP event all read it.

    Example:
        >>> sizes = PublicSizes(sample_rate=0.25, expected_batch_size=4, accounted_rate=0.25,
        ...                     steps_per_epoch=4)
        >>> m = Mechanism(sizes=sizes, max_grad_norm=1.0, noise_multiplier=1.1, sketch_spec=None)
        >>> (m.sample_rate, m.divisor, m.threat_model, m.step_event().sample_rate)
        (0.25, 4, 'hidden', 0.25)

    Attributes:
        sizes: The sampling schedule and divisor (:class:`PublicSizes`, from the data loader's
            public sizes and ``make_private``'s ``dataset_size``).
        max_grad_norm: ``C``, ``make_private``'s ``max_grad_norm`` (a list for Opacus'
            per-layer clipping).
        noise_multiplier: ``sigma``: ``make_private``'s ``noise_multiplier``, or the one
            ``make_private_with_epsilon`` searched at :attr:`accounted_rate` and
            :attr:`steps_per_epoch`.
        sketch_spec: The sketch that produces the clip factors (``clipping="randomized"``: from
            ``sketch``, ``sketch_dim``, ``sketch_head_dim`` and whether ``sketch_generator``
            was passed), or None for exact clipping.
        threat_model: The strongest threat model the sketch supports (``"hidden"`` for
            per-sample, secret sketches and exact clipping, else ``"revealed"``;
            :func:`~opacus_rc.accountants.events.accounted_threat_model`), derived, not given.

    Raises:
        ValueError: If ``sizes`` is not a :class:`PublicSizes`.
    """

    sizes: PublicSizes
    max_grad_norm: Any
    noise_multiplier: float
    sketch_spec: SketchSpec | None
    threat_model: str = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.sizes, PublicSizes):
            raise ValueError(f"sizes must be PublicSizes, got {type(self.sizes).__name__}")
        object.__setattr__(self, "threat_model", accounted_threat_model(self.sketch_spec))

    @property
    def privacy_unit(self) -> str:
        """``"record"`` or ``"unit"`` (:attr:`PublicSizes.privacy_unit`)."""
        return self.sizes.privacy_unit

    @property
    def sample_rate(self) -> float:
        """``q``, the rate the loader samples at (:attr:`PublicSizes.sample_rate`)."""
        return self.sizes.sample_rate

    @property
    def accounted_rate(self) -> float:
        """The rate each step is accounted at (:attr:`PublicSizes.accounted_rate`)."""
        return self.sizes.accounted_rate

    @property
    def steps_per_epoch(self) -> int:
        """Steps of one epoch (:attr:`PublicSizes.steps_per_epoch`)."""
        return self.sizes.steps_per_epoch

    @property
    def expected_batch_size(self) -> int | None:
        """The global divisor (:attr:`PublicSizes.expected_batch_size`)."""
        return self.sizes.expected_batch_size

    @property
    def world_size(self) -> int:
        """The number of data-parallel processes (:attr:`PublicSizes.world_size`)."""
        return self.sizes.world_size

    @property
    def divisor(self) -> float | int | None:
        """One process's divisor (:attr:`PublicSizes.divisor`)."""
        return self.sizes.divisor

    def step_event(self, *, accumulated_iterations: int = 1) -> RandomizedClipDpEvent:
        """The DP event of one step of this run: the only source of a run's step event.

        Args:
            accumulated_iterations: Physical batches accumulated into the step (Opacus'
                ``accumulated_iterations``; the rate is :attr:`accounted_rate` times it, as
                Opacus' accountants compute it).

        Returns:
            ``RandomizedClipDpEvent(sigma, accounted_rate * accumulated_iterations, sketch,
            threat_model)``.

        Raises:
            ValueError: If the rate is not in ``(0, 1]`` or ``sigma`` is invalid (as the event).
        """
        return step_event(
            noise_multiplier=self.noise_multiplier,
            sample_rate=self.accounted_rate * accumulated_iterations,
            sketch_spec=self.sketch_spec,
            threat_model=self.threat_model,
        )
