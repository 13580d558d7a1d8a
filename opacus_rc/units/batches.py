"""Virtual steps of units: a logical batch of units run as several physical batches.

:class:`UnitBatchMemoryManager` (Opacus' ``BatchMemoryManager`` for a
:class:`~opacus_rc.units.UnitDataLoader`) splits each logical batch with
:class:`UnitBatchSplittingSampler`: into physical batches of whole units, or
(``split_units=True``) of exactly ``max_physical_batch_size`` consecutive sequences, cutting
units, each batch then carrying its :class:`~opacus_rc.units.UnitSplit`
(docs/privacy/units.md#units-split). One noised, accounted step per logical batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from opacus.utils.batch_memory_manager import BatchMemoryManager, BatchSplittingSampler
from torch.utils.data import DataLoader, Dataset

from opacus_rc.data_loader import worker_options
from opacus_rc.units.data_loader import (
    RecordingUnitLoader,
    UnitDataLoader,
    UnitPoissonSampler,
    _Tagged,
    _UnitCollate,
    pack_whole_units,
    split_at_size,
)
from opacus_rc.units.distributed import DistributedUnitDataLoader
from opacus_rc.units.layout import UnitSplit
from opacus_rc.units.record import CollatedUnits

__all__ = ["UnitBatchMemoryManager", "UnitBatchSplittingSampler"]


class UnitBatchSplittingSampler(BatchSplittingSampler):
    """Opacus' ``BatchSplittingSampler``, splitting a logical batch at unit boundaries only.

    Whole units are packed greedily, in order, into physical batches of at most
    ``max_batch_size`` sequences; a unit with more sequences than that forms a physical batch
    of its own (a unit is never split: its clip factor needs all of its sequences in one
    backward pass). The optimizer is told, as by Opacus, which physical batches end a logical
    one (``signal_skip_step``), so each logical batch is one noised, accounted step.

    With ``split_units=True`` the physical batches instead hold ``max_batch_size``
    consecutive sequences each (:func:`split_at_size`), cutting units; the collate function of
    :class:`UnitBatchMemoryManager` then tells the criterion where (``unit_split=``).

    Args:
        sampler: The :class:`UnitPoissonSampler` (a ``UnitDataLoader``'s ``batch_sampler``).
        unit_of: ``unit_of[i]``: the unit index of dataset sequence ``i``.
        max_batch_size: The largest physical batch (sequences), unless one unit is larger
            (and ``split_units`` is False).
        optimizer: The DP optimizer.
        split_units: Cut units at ``max_batch_size`` (virtual steps within a unit).
    """

    def __init__(
        self,
        *,
        sampler: UnitPoissonSampler,
        unit_of: Sequence[int],
        max_batch_size: int,
        optimizer: Any,
        split_units: bool = False,
    ) -> None:
        super().__init__(sampler=sampler, max_batch_size=max_batch_size, optimizer=optimizer)
        self.unit_of = unit_of
        self.split_units = bool(split_units)

    def split(self, indices: list[int]) -> list[list[int]]:
        """The physical batches of one logical batch (consecutive whole units, or consecutive
        sequences with ``split_units``)."""
        pack = split_at_size if self.split_units else pack_whole_units
        bounds = pack([self.unit_of[i] for i in indices], max_batch_size=self.max_batch_size)
        return [indices[lo:hi] for lo, hi in bounds]

    def __iter__(self) -> Iterator[list[int]]:
        for indices in self.sampler:
            chunks = self.split(list(indices)) or [[]]
            for chunk in chunks[:-1]:
                self.optimizer.signal_skip_step(do_skip=True)
                yield chunk
            self.optimizer.signal_skip_step(do_skip=False)
            yield chunks[-1]

    def __len__(self) -> int:
        return len(self.sampler)  # logical batches; the physical count is random


class _Ranked(Dataset):
    """The tagged dataset, each item also tagged with its rank among its unit's selected
    sequences (where a physical batch cuts a unit; ``split_units=True``)."""

    def __init__(self, tagged: _Tagged, rank: list[int]) -> None:
        self.tagged = tagged
        self.rank = rank

    def __len__(self) -> int:
        return len(self.tagged)

    def __getitem__(self, index: int) -> tuple[Any, int, int, int]:
        return (*self.tagged[index], self.rank[index])


class _SplitUnitCollate:
    """Collate ranked items into ``(batch, units, unit_split)``: the batch may cut its first
    and its last unit (consecutive sequences of one logical batch), and says so."""

    def __init__(self, inner: _UnitCollate, split_key: str) -> None:
        self.inner = inner
        self.split_key = split_key

    def __call__(self, items: list[tuple[Any, int, int, int]]) -> CollatedUnits:
        """The batch with its split attached, its items' units and the split."""
        split = self.unit_split(items)
        # The inner collate checks that every unit is whole: present it the pieces as units.
        pieces = Counter(unit for _, unit, _, _ in items)
        whole = [(item, unit, pieces[unit]) for item, unit, _, _ in items]
        out = self.inner(whole)
        return CollatedUnits(self._attach(out.batch, split), out.units, split)

    @staticmethod
    def unit_split(items: list[tuple[Any, int, int, int]]) -> UnitSplit:
        """Where ``items`` (unit after unit, each unit's sequences in rank order) cut units.

        Raises:
            ValueError: A unit that is cut but neither first nor last, or out of rank order.
        """
        if not items:
            return UnitSplit(False, False)
        runs: list[list[tuple[int, int, int]]] = []  # (unit, count, rank) per unit, in order
        for _, unit, count, rank in items:
            if not runs or runs[-1][0][0] != unit:
                runs.append([])
            runs[-1].append((unit, count, rank))
        for i, run in enumerate(runs):
            unit, count, first = run[0]
            ranks = [r for _, _, r in run]
            starts = first == 0 or i == 0
            ends = ranks[-1] == count - 1 or i == len(runs) - 1
            if ranks != list(range(first, first + len(run))) or not (starts and ends):
                raise ValueError(
                    f"a physical batch holds sequences {ranks} of the {count} of unit {unit}: "
                    "only the first and the last unit of a physical batch may be cut, each as "
                    "consecutive sequences (UnitBatchMemoryManager(split_units=True) cuts so)"
                )
        return UnitSplit(runs[0][0][2] > 0, runs[-1][-1][2] < runs[-1][-1][1] - 1)

    def _attach(self, batch: Any, split: UnitSplit) -> Any:
        if isinstance(batch, dict):
            return {**batch, self.split_key: split}
        return (*batch, split)


class UnitBatchMemoryManager(BatchMemoryManager):
    """Opacus' ``BatchMemoryManager`` for a :class:`UnitDataLoader`: each logical batch of
    units runs as virtual steps (:class:`UnitBatchSplittingSampler`), one noised, accounted
    step per logical batch.

    With ``split_units=False`` the physical batches hold whole units. With
    ``split_units=True`` they hold ``max_physical_batch_size`` consecutive sequences each (the
    last fewer), cutting units where needed, and every batch carries its
    :class:`~opacus_rc.units.UnitSplit` after ``units`` (the last element of a
    tuple batch; the key ``split_key`` of a dict batch), to pass to the criterion::

        with UnitBatchMemoryManager(data_loader=dl, max_physical_batch_size=4,
                                    optimizer=opt, split_units=True) as mem:
            for x, y, units, split in mem:
                loss = criterion(model(x), y, units=units, unit_split=split)
                loss.backward(); opt.step(); opt.zero_grad()

    The update, the norms of the units and the accounting are those of the logical batch at
    once (docs/privacy/units.md#units-split); a cut unit needs book-keeping.

    Args:
        data_loader: The :class:`UnitDataLoader` returned by ``make_private``.
        max_physical_batch_size: The largest physical batch, in sequences (without
            ``split_units``, a unit with more sequences forms a physical batch of its own).
        optimizer: The DP optimizer.
        split_units: Cut units at ``max_physical_batch_size``.
        split_key: The key of the :class:`~opacus_rc.units.UnitSplit` in a dict
            batch.

    Raises:
        TypeError: If ``data_loader`` is not a :class:`UnitDataLoader`.
        NotImplementedError: If it is a :class:`DistributedUnitDataLoader` (virtual steps under
            data parallelism: each rank would split its own units into its own number of
            physical batches, so DDP's and FSDP2's per-backward collectives would not line up,
            and a cut unit's buffer is not sharded).
    """

    def __init__(
        self,
        *,
        data_loader: UnitDataLoader,
        max_physical_batch_size: int,
        optimizer: Any,
        split_units: bool = False,
        split_key: str = "unit_split",
    ) -> None:
        if not isinstance(data_loader, UnitDataLoader):
            raise TypeError(
                f"UnitBatchMemoryManager needs a UnitDataLoader, got {type(data_loader).__name__}"
            )
        if isinstance(data_loader, DistributedUnitDataLoader):
            raise NotImplementedError(
                "UnitBatchMemoryManager is not supported with a DistributedUnitDataLoader: each "
                "rank would split its own units into its own number of physical batches, so "
                "DDP's and FSDP2's collectives of each backward would not line up (and a cut "
                "unit's buffer is not sharded). Each rank's logical batch is already 1/world of "
                "the expected units: add ranks or lower the sample rate to fit memory, or run "
                "virtual steps in one process (docs/privacy/units.md#units-distributed)"
            )
        super().__init__(
            data_loader=data_loader,
            max_physical_batch_size=max_physical_batch_size,
            optimizer=optimizer,
        )
        self.split_units = bool(split_units)
        self.split_key = split_key

    def __enter__(self) -> DataLoader:
        loader = self.data_loader
        options = worker_options(loader)
        dataset = loader.dataset
        if self.split_units:
            rank = [0] * len(dataset)
            for seqs in loader.selected:
                for r, i in enumerate(seqs):
                    rank[i] = r
            dataset = _Ranked(dataset, rank)
            options["collate_fn"] = _SplitUnitCollate(options["collate_fn"], self.split_key)
        return RecordingUnitLoader(
            split_units=self.split_units,
            unit_record=loader.unit_record,
            dataset=dataset,
            batch_sampler=UnitBatchSplittingSampler(
                sampler=loader.batch_sampler,
                unit_of=loader.dataset.unit_of,
                max_batch_size=self.max_physical_batch_size,
                optimizer=self.optimizer,
                split_units=self.split_units,
            ),
            **options,
        )
