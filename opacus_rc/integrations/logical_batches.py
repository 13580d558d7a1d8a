"""Poisson logical batches for a DP trainer: the sampler, the batch and its collator.

Each optimizer step of a DP trainer is one *logical* batch, Poisson-sampled
(:class:`PoissonLogicalBatchSampler`, one global mask per step, split by shard under DDP) and
split into physical micro-batches of at most the Trainer's per-device batch size
(:class:`LogicalBatchCollator`, which returns a :class:`LogicalBatch`). With a privacy unit
(``PrivacyArguments.privacy_unit``) the units are sampled instead
(:class:`UnitLogicalBatchSampler`, each sampled unit on one rank under DDP) and micro-batches
hold whole units
(:class:`UnitLogicalBatchCollator`), each with its ``units`` tensor under :data:`UNITS_KEY`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch.utils.data import DataLoader, Dataset

from opacus_rc.units.data_loader import pack_whole_units
from opacus_rc.units.distributed import DistributedUnitPoissonSampler

#: The key of a micro-batch's ``(B,)`` units tensor (``0..U-1``) on the privacy-unit path.
UNITS_KEY = "dp_privacy_units"

__all__ = [
    "IndexDataset",
    "LogicalBatch",
    "LogicalBatchCollator",
    "LogicalBatchLoader",
    "PoissonLogicalBatchSampler",
    "UNITS_KEY",
    "UnitLogicalBatchCollator",
    "UnitLogicalBatchSampler",
    "UnitRows",
    "seeded_generator",
]


def seeded_generator(seed: int, *key: int, device: Any = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded from ``seed`` and ``key`` (independent
    streams per key, :class:`numpy.random.SeedSequence`)."""
    state = np.random.SeedSequence(seed, spawn_key=key).generate_state(1, np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(state))


class PoissonLogicalBatchSampler(UniformWithReplacementSampler):
    """Opacus' Poisson sampler whose masks in epoch ``e`` come from a generator seeded by
    ``(seed, e)``, optionally restricted to one rank's shard.

    Each of the ``steps`` batches of an epoch holds every index of ``range(num_samples)``
    independently with probability ``sample_rate`` (Opacus' ``UniformWithReplacementSampler``:
    ``torch.rand(num_samples) < sample_rate``); an empty batch is yielded as ``[]``. Seeding
    per epoch makes an epoch replayable: skipping its first ``j`` batches (what the Trainer does
    on an exact resume, ``PrivacyArguments.resume_exact``) reproduces the batches of the
    uninterrupted run (the default resume reseeds the sampler: fresh masks).
    :meth:`set_epoch` chooses the epoch (the Trainer calls it); each iteration otherwise moves
    to the next epoch. The epoch is taken when the first batch is drawn (an iterator never
    advanced takes none), so a ``DataLoader`` with workers, which makes an iterator it
    discards, draws the batches of one with no worker; the masks are drawn in the main process.

    With ``world_size > 1`` every rank draws the same global mask (same ``seed``) and keeps the
    sampled indices of its shard, ``i % world_size == rank`` (the shard of Opacus'
    distributed sampler without shuffling): the ranks' batches partition one Poisson batch
    of the whole dataset, the batch that one process with the same seed draws, so every
    example is still in a step independently with probability ``sample_rate``.

    Args:
        num_samples: ``N``, the whole dataset (not the shard).
        sample_rate: ``q`` in ``(0, 1]``.
        steps: Batches per epoch.
        seed: The seed (keep it secret: it determines every batch); the same on every rank.
        rank: This process' rank, in ``[0, world_size)``.
        world_size: Number of data-parallel processes.

    Raises:
        ValueError: If ``rank`` is not in ``[0, world_size)``.
    """

    def __init__(
        self,
        *,
        num_samples: int,
        sample_rate: float,
        steps: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__(num_samples=num_samples, sample_rate=sample_rate, steps=steps)
        if not 0 <= int(rank) < int(world_size):
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.seed = int(seed)
        self.epoch = 0
        self.rank = int(rank)
        self.world_size = int(world_size)

    def set_epoch(self, epoch: int) -> None:
        """Draw the next iteration's batches from epoch ``epoch``'s generator."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        # A generator function: the epoch is taken, and its generator seeded, when the first
        # batch is asked for, not when the iterator is made. A DataLoader with workers makes
        # two iterators of its batch sampler and uses the second: a seeding at iter() time
        # would skip an epoch and draw other batches than with no worker. The masks are drawn
        # here, in the main process, from a generator local to this iteration.
        generator = seeded_generator(self.seed, self.epoch)
        self.epoch += 1
        for _ in range(self.steps):
            # Opacus' UniformWithReplacementSampler, with this iteration's generator.
            mask = torch.rand(self.num_samples, generator=generator) < self.sample_rate
            batch = mask.nonzero(as_tuple=False).reshape(-1).tolist()
            if self.world_size > 1:
                batch = [i for i in batch if i % self.world_size == self.rank]
            yield batch


@dataclass
class LogicalBatch:
    """One Poisson batch, as physical micro-batches collated by the Trainer's collator.

    Attributes:
        micro_batches: The collated micro-batches, each of at most the physical batch size
            (empty for an empty Poisson batch).
        sizes: The number of examples in each micro-batch.
        micro_examples: The examples (uncollated) of each micro-batch, for the trainer's check
            of batch independence (:mod:`~opacus_rc.integrations.batch_check`), or None.
    """

    micro_batches: list[Any]
    sizes: list[int]
    micro_examples: list[list[Any]] | None = None

    @property
    def num_examples(self) -> int:
        """Examples in the logical batch."""
        return sum(self.sizes)

    def __contains__(self, key: object) -> bool:
        # The Trainer asks ``"labels" in batch`` to count tokens for its loss scaling, which the
        # private loss does not use.
        return False


class LogicalBatchCollator:
    """Collate function of a Poisson batch: split into micro-batches, collate each.

    The examples of a logical batch are split into ``ceil(L / max_physical_batch_size)``
    contiguous chunks of sizes differing by at most one (``numpy.array_split``, as Opacus'
    ``BatchMemoryManager``), and each chunk is collated by ``collate_fn``.

    Args:
        collate_fn: The Trainer's data collator (with unused columns removed).
        max_physical_batch_size: The largest micro-batch (``per_device_train_batch_size``).

    Raises:
        ValueError: At call time, if a collated micro-batch does not have one row per example
            (a collator that packs examples into one row, or drops some, would change the
            privacy unit or leave examples unaccounted).
    """

    def __init__(self, *, collate_fn: Any, max_physical_batch_size: int) -> None:
        self.collate_fn = collate_fn
        self.max_physical_batch_size = int(max_physical_batch_size)

    def chunks(self, examples: list[Any]) -> list[tuple[int, int]]:
        """``[(start, end), ...]``: the positions of each micro-batch (none for no example)."""
        if not examples:
            return []
        n_chunks = math.ceil(len(examples) / self.max_physical_batch_size)
        bounds = np.cumsum(
            [0] + [len(c) for c in np.array_split(np.arange(len(examples)), n_chunks)]
        )
        return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]

    def __call__(self, examples: list[Any]) -> LogicalBatch:
        return self.collate_chunks(examples, self.chunks(examples))

    def collate_chunks(self, examples: list[Any], bounds: list[tuple[int, int]]) -> LogicalBatch:
        """The :class:`LogicalBatch` of the micro-batches ``examples[lo:hi]`` of ``bounds``."""
        micro, sizes = [], []
        for lo, hi in bounds:
            chunk = examples[lo:hi]
            batch = self.collate_fn(chunk)
            rows = _rows(batch)
            if rows is not None and rows != len(chunk):
                raise ValueError(
                    f"the data collator returned a batch of {rows} rows for {len(chunk)} "
                    "examples; differentially private training needs one row per example (the "
                    "privacy unit). Padding-free and packing collators (which concatenate "
                    "examples into one row) and collators that drop examples are not supported: "
                    "use a padding collator"
                )
            micro.append(batch)
            sizes.append(len(chunk))
        return LogicalBatch(
            micro_batches=micro,
            sizes=sizes,
            micro_examples=[examples[lo:hi] for lo, hi in bounds],
        )


class UnitLogicalBatchCollator(LogicalBatchCollator):
    """:class:`LogicalBatchCollator` for the privacy-unit path: items are ``(example, unit)``
    (:class:`UnitRows`), a unit's items contiguous, and each micro-batch holds whole units,
    packed greedily in order (:func:`opacus_rc.units.pack_whole_units`; the trainer
    refuses, before training, a unit larger than ``max_physical_batch_size``). Each collated
    micro-batch gets its ``(B,)`` long tensor of units, numbered ``0..U-1`` in order of
    appearance, under :data:`UNITS_KEY` (what the criterion's ``units=`` takes); a collated
    micro-batch that already has that key is refused (``ValueError``), never overwritten.

    Args:
        collate_fn: The Trainer's data collator (with unused columns removed).
        max_physical_batch_size: The largest micro-batch (``per_device_train_batch_size``).
    """

    def chunks(self, examples: list[Any]) -> list[tuple[int, int]]:
        return pack_whole_units(
            [unit for _, unit in examples], max_batch_size=self.max_physical_batch_size
        )

    def __call__(self, examples: list[Any]) -> LogicalBatch:
        bounds = self.chunks(examples)
        batch = self.collate_chunks([example for example, _ in examples], bounds)
        for micro, (lo, hi) in zip(batch.micro_batches, bounds):
            if isinstance(micro, Mapping) and UNITS_KEY in micro:
                raise ValueError(
                    f"the collated micro-batch already has the key {UNITS_KEY!r}, which the "
                    "trainer writes on the privacy_unit path (each row's unit, 0..U-1): a "
                    f"dataset column or a collator output named {UNITS_KEY!r} would be "
                    "silently replaced. Rename it (or drop it before training)"
                )
            label: dict[int, int] = {}
            micro[UNITS_KEY] = torch.tensor(
                [label.setdefault(unit, len(label)) for _, unit in examples[lo:hi]],
                dtype=torch.long,
            )
        return batch


def _rows(batch: Any) -> int | None:
    """Leading dimension of the first tensor in a collated batch (None if there is none)."""
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, torch.Tensor):
        return values.shape[0]
    if isinstance(values, (Sequence, type({}.values()))):
        for v in values:
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                return v.shape[0]
    return None


class UnitLogicalBatchSampler(DistributedUnitPoissonSampler):
    """:class:`~opacus_rc.units.UnitPoissonSampler` (every unit in a batch
    independently with probability ``sample_rate``, all of its selected rows, unit after unit)
    whose masks in epoch ``e`` come from a generator seeded by ``(seed, e)``, as
    :class:`PoissonLogicalBatchSampler` (replayable epochs, for resuming).

    With ``world_size > 1`` (DDP) every rank draws the same global mask of all units (same
    ``seed``) and keeps the sampled units of its shard, ``u % world_size == rank``
    (:class:`~opacus_rc.units.DistributedUnitPoissonSampler`): each sampled unit is
    trained on exactly one rank, with all of its rows, and the ranks' batches partition the
    batch one process draws with that seed.

    Args:
        members: ``members[u]``: the dataset indices of unit ``u``'s selected rows (every unit
            of the dataset).
        sample_rate: ``q`` in ``(0, 1]``.
        steps: Batches per epoch.
        seed: The seed (keep it secret: it determines every batch).
        rank: This process' rank, in ``[0, world_size)``.
        world_size: Number of data-parallel processes.

    Raises:
        ValueError: As :class:`~opacus_rc.units.DistributedUnitPoissonSampler`.
    """

    def __init__(
        self,
        *,
        members: Sequence[Sequence[int]],
        sample_rate: float,
        steps: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__(
            members=members,
            sample_rate=sample_rate,
            steps=steps,
            num_replicas=world_size,
            rank=rank,
            generator=torch.Generator(),
        )
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw the next iteration's batches from epoch ``epoch``'s generator."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        # Seeded at the first batch, not at iter() (see PoissonLogicalBatchSampler.__iter__).
        self.generator = seeded_generator(self.seed, self.epoch)
        self.epoch += 1
        yield from super().__iter__()


class UnitRows(Dataset):
    """The training rows, each as ``(row, unit index)``, the unit column left out of the row.

    Args:
        dataset: The training dataset (map-style).
        unit_of: ``unit_of[i]``: the unit index of row ``i``.
        column: The unit column, dropped from mapping rows (it is no model input).
    """

    def __init__(self, dataset: Dataset, unit_of: Sequence[int], column: str) -> None:
        self.dataset = dataset
        self.unit_of = unit_of
        self.column = column

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[Any, int]:
        row = self.dataset[i]
        if isinstance(row, Mapping) and self.column in row:
            row = {k: v for k, v in row.items() if k != self.column}
        return row, self.unit_of[i]


class LogicalBatchLoader(DataLoader):
    """A ``DataLoader`` over Poisson logical batches with ``set_epoch`` (called by the Trainer)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class IndexDataset(Dataset):
    """``range(n)`` as a dataset (for Opacus' sample-rate rule; holds no data)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int]:
        return (i,)
