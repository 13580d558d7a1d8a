"""Unit-level DP under data parallelism (DDP, Opacus' DPDDP, FSDP2): every sampled unit on
exactly one rank.

:class:`DistributedUnitPoissonSampler` draws, at every step, the inclusion mask of all units
(as the single-process :class:`~opacus_rc.units.UnitPoissonSampler`) and keeps the
sampled units of its rank's shard, ``u % num_replicas == rank``;
:class:`DistributedUnitDataLoader` is the per-rank loader built on it, and
:func:`check_unit_loader_world` refuses a loader that does not match the model
(docs/privacy/units.md#units-distributed). :func:`prepare_unit_data_loader`, what
``make_private`` does with a unit loader, lives here because it runs that check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from opacus_rc.units.data_loader import UnitDataLoader, UnitPoissonSampler

__all__ = [
    "DistributedUnitDataLoader",
    "DistributedUnitPoissonSampler",
    "check_unit_loader_world",
    "prepare_unit_data_loader",
]


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``(num_replicas, rank)``: the given ones, else the default process group's."""
    if num_replicas is None or rank is None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ValueError(
                "DistributedUnitDataLoader needs num_replicas and rank, or an initialised "
                "torch.distributed process group to read them from"
            )
        num_replicas = torch.distributed.get_world_size() if num_replicas is None else num_replicas
        rank = torch.distributed.get_rank() if rank is None else rank
    num_replicas, rank = int(num_replicas), int(rank)
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(
            f"need num_replicas >= 1 and 0 <= rank < num_replicas, got {num_replicas}, {rank}"
        )
    return num_replicas, rank


class DistributedUnitPoissonSampler(UnitPoissonSampler):
    """:class:`UnitPoissonSampler` under data parallelism: one rank's share of each Poisson
    sample of units.

    Unit ``u`` belongs to rank ``u % num_replicas`` (its *shard*; a unit is never split between
    ranks, so its clip factor is computed from all of its sequences in one backward pass). At
    every step the sampler draws the inclusion mask of **all** ``num_units`` units,
    ``rand(num_units) < q`` (exactly as :class:`UnitPoissonSampler`), and yields the sequences
    of the sampled units of its own shard. Unit ``u``'s inclusion is therefore read from one
    draw of one rank only, and over the ranks every unit is included independently with
    probability ``q`` at every step, each sampled unit on exactly one rank: the ranks'
    batches partition one Poisson sample of units of the whole dataset. This holds both when
    the ranks' generators are equal (the same seed on every rank: the ranks' batches then
    partition the very batch that a single-process :class:`UnitPoissonSampler` with that seed
    draws, which makes a run reproducible and comparable with one process) and when they are
    independent (the default, each rank seeded from its operating system, and the engine's
    secure mode, each rank with its own CSPRNG); any other relation between the generators is
    not covered. Every step yields a batch, empty when no unit of the shard is sampled: the
    ranks take the same number of steps, and an empty rank joins the all-reduce with a zero
    sum.

    Args:
        members: ``members[u]``: the dataset indices of unit ``u``'s (selected) sequences, for
            **every** unit of the dataset (not only this rank's).
        sample_rate: ``q`` in ``(0, 1]``.
        num_replicas: The number of data-parallel ranks.
        rank: This rank, in ``[0, num_replicas)``.
        steps: Batches per epoch (default ``int(1 / q)``), the same on every rank.
        generator: Source of the masks (see above); None seeds one from the operating system.

    Attributes:
        num_units: The number of units of the whole dataset (the records of the accountant).
        shard: The units of this rank, ``[rank, rank + num_replicas, ...]``.

    Raises:
        ValueError: As :class:`UnitPoissonSampler`, or an invalid ``num_replicas``/``rank``.
    """

    def __init__(
        self,
        *,
        members: Sequence[Sequence[int]],
        sample_rate: float,
        num_replicas: int,
        rank: int,
        steps: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(members=members, sample_rate=sample_rate, steps=steps, generator=generator)
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.shard = list(range(self.rank, self.num_units, self.num_replicas))

    def sample_units(self) -> torch.Tensor:
        """One step's sampled units of this rank's shard, increasing (global unit indices)."""
        sampled = super().sample_units()  # the mask of all units, as in one process
        return sampled[sampled % self.num_replicas == self.rank]


class DistributedUnitDataLoader(UnitDataLoader):
    """:class:`UnitDataLoader` for one rank of a data-parallel run (DDP, Opacus' DPDDP).

    Samples units with :class:`DistributedUnitPoissonSampler`: unit ``u`` is trained on rank
    ``u % num_replicas`` only, each unit is included independently with probability
    ``sample_rate`` at every step, and the ranks' batches partition one Poisson sample of the
    dataset's units. Build it on every rank with the same arguments (the same ``dataset``,
    ``unit_of``, ``sample_rate``, ``max_sequences_per_unit``, selection and ``steps``), and
    either the same seeded ``generator`` on every rank or none (independent OS seeds); see
    :class:`DistributedUnitPoissonSampler`.

    Given to ``PrivacyEngine.make_private`` with a DDP/DPDDP model, the accountant takes
    ``1 / int(1 / sample_rate)`` as in one process, and the divisor of each rank's noisy sum
    under ``loss_reduction="mean"`` is ``E / world_size`` (Opacus' rule: the all-reduced mean
    of the ranks' sums divided by it is the single-process mean over ``E``), with ``E`` the
    public expected number of units per step of the whole run: the loader's
    ``expected_batch_size``, or ``int(U * q)`` for ``make_private``'s ``dataset_size=U``
    (the public number of units); never the private ``num_units`` (``make_private`` refuses
    a loader with neither, as :class:`UnitDataLoader`). Noise is added once, on rank 0, by
    the distributed optimizer.

    Args:
        dataset: The sequences (map-style), the whole dataset on every rank.
        num_replicas: The number of ranks (None: the process group's world size).
        rank: This rank (None: the process group's rank).
        **kwargs: The arguments of :class:`UnitDataLoader` (``unit_of``, ``sample_rate``,
            ``expected_batch_size``: of all ranks together ...).

    Attributes:
        num_replicas: The number of ranks.
        rank: This rank.
        num_units: The units of the whole dataset.

    Raises:
        ValueError: As :class:`UnitDataLoader`; ``num_replicas``/``rank`` invalid, or not given
            without an initialised process group.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        **kwargs: Any,
    ) -> None:
        self._world = _world(num_replicas, rank)
        super().__init__(dataset, **kwargs)
        self.num_replicas, self.rank = self._world

    def _unit_sampler(
        self,
        *,
        members: list[list[int]],
        sample_rate: float,
        steps: int | None,
        generator: torch.Generator | None,
    ) -> UnitPoissonSampler:
        num_replicas, rank = self._world
        return DistributedUnitPoissonSampler(
            members=members,
            sample_rate=sample_rate,
            num_replicas=num_replicas,
            rank=rank,
            steps=steps,
            generator=generator,
        )


def check_unit_loader_world(loader: UnitDataLoader, *, distributed: bool) -> None:
    """Refuse a unit loader that does not match the model's data parallelism.

    Args:
        loader: The :class:`UnitDataLoader` given to ``make_private``.
        distributed: Whether the model is data-parallel (DDP, DPDDP, FSDP2).

    Raises:
        ValueError: A plain :class:`UnitDataLoader` with a distributed model (every rank would
            draw and train on its own copy of every sampled unit); a
            :class:`DistributedUnitDataLoader` whose ``num_replicas`` is not the process
            group's world size, or is more than 1 for a model that is not distributed.
    """
    if isinstance(loader, DistributedUnitDataLoader):
        if distributed:
            world = torch.distributed.get_world_size()
            if loader.num_replicas != world:
                raise ValueError(
                    f"DistributedUnitDataLoader(num_replicas={loader.num_replicas}) in a process "
                    f"group of {world} ranks: build it with num_replicas={world} (or None)"
                )
        elif loader.num_replicas > 1:
            raise ValueError(
                f"DistributedUnitDataLoader(num_replicas={loader.num_replicas}) with a model that "
                "is not distributed: wrap the model in DistributedDataParallel (or Opacus' "
                "DPDDP), or use UnitDataLoader in one process"
            )
    elif distributed:
        raise ValueError(
            "a UnitDataLoader with a distributed model: every rank would sample and train on "
            "every sampled unit. Use opacus_rc.units.DistributedUnitDataLoader "
            "(each sampled unit on exactly one rank; docs/privacy/units.md)"
        )


def prepare_unit_data_loader(
    loader: UnitDataLoader, *, engine: Any, distributed: bool, randomized: bool
) -> UnitDataLoader:
    """The engine's data-loader step for a :class:`UnitDataLoader`: used as it is.

    The engine's dataset is recorded (as Opacus does for any loader) and, in secure mode, the
    unit masks are drawn from the engine's secure generator.

    Args:
        loader: The unit loader passed to ``make_private``.
        engine: The :class:`~opacus_rc.PrivacyEngine`.
        distributed: Whether the model is distributed.
        randomized: Whether ``clipping="randomized"``.

    Returns:
        ``loader``.

    Raises:
        ValueError: Without ``clipping="randomized"`` (Opacus' clipping is per sequence, and it
            would re-sample the sequences); a plain :class:`UnitDataLoader` with a distributed
            model (every rank would train on every sampled unit); a
            :class:`DistributedUnitDataLoader` whose ``num_replicas`` is not the world size of a
            distributed model (or is more than 1 without one).
    """
    if not randomized:
        raise ValueError(
            "UnitDataLoader (unit-level DP) needs clipping='randomized': the other clipping "
            "modes clip each sequence, not each unit"
        )
    check_unit_loader_world(loader, distributed=distributed)
    if engine.dataset is None:
        engine.dataset = loader.dataset
    if engine.secure_mode:
        loader.batch_sampler.generator = engine.secure_rng
    return loader
