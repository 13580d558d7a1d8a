"""Poisson sampling of privacy units (documents, users) for unit-level DP-SGD
(docs/privacy/units.md).

:class:`UnitDataLoader` wraps a dataset of sequences (e.g. the context-sized windows of long
documents) and the unit of each sequence. At every step it includes each *unit*
independently with probability ``q`` (Poisson subsampling of units) and yields all of the
sampled units' sequences (at most ``max_sequences_per_unit`` of each), together with the
``(B,)`` tensor ``units`` that numbers the batch's units ``0..U-1``, which is what the
criterion's ``units=`` takes (:mod:`opacus_rc.grad_sample.units`).

**Which sequences of a unit.** With ``max_sequences_per_unit = m``, the ``m`` sequences of a
longer unit are fixed once, at construction, without looking at their content: the first
``m`` in dataset order (``selection="first"``) or ``m`` drawn uniformly without replacement
from a seeded generator (``selection="random"``). This is a preprocessing applied to each unit
on its own, independent of the data and of every other unit: the record of unit ``u`` *is*
its selected sequences, and adding or removing a unit adds or removes exactly those (the
analysis in docs/privacy/units.md is over these records). The selection is reported as
:attr:`UnitDataLoader.selected`.

**Physical batches.** A unit's sequences are yielded contiguously. Its clip factor needs the
norm of the sum over all of its sequences (clipping the parts separately would give the unit a
sensitivity of ``C`` per part), so a physical batch that holds only some of a unit's sequences
without saying so (Opacus' ``BatchMemoryManager`` splits a logical batch at arbitrary
positions) is refused when it is collated (a ``ValueError``). :class:`UnitBatchMemoryManager`
runs a logical batch as virtual steps, in one of two ways: with ``split_units=False`` (the
default) its physical batches hold whole units (a unit larger than ``max_physical_batch_size``
gets a physical batch of its own); with ``split_units=True`` they hold exactly
``max_physical_batch_size`` consecutive sequences (the last one fewer), cutting units where
needed, and each batch carries a :class:`~opacus_rc.grad_sample.units.UnitSplit` (whether its
first unit continues one from the previous batch and whether its last one continues into the
next) to pass to the criterion as ``unit_split=``. The module then keeps the open unit's
unclipped summed gradient until its last sequence is in, and clips it once
(docs/privacy/units.md#units-split): a unit of 32 windows trains in micro-batches of 4 with the
same update and the same guarantee as in one batch.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from opacus.utils.batch_memory_manager import BatchMemoryManager, BatchSplittingSampler
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.dataloader import default_collate

from opacus_rc.data_loader import worker_options
from opacus_rc.grad_sample.units import UnitSplit
from opacus_rc.validation import validate_sample_rate

__all__ = [
    "DistributedUnitDataLoader",
    "DistributedUnitPoissonSampler",
    "UnitBatchMemoryManager",
    "UnitBatchSplittingSampler",
    "UnitDataLoader",
    "UnitPoissonSampler",
    "check_unit_loader_world",
    "pack_whole_units",
    "prepare_unit_data_loader",
    "split_at_size",
    "select_unit_members",
]

_SELECTIONS = ("first", "random")


class UnitPoissonSampler(Sampler[list[int]]):
    """Batches of sequence indices: every unit included independently with probability ``q``.

    Args:
        members: ``members[u]``: the dataset indices of unit ``u``'s (selected) sequences.
        sample_rate: ``q`` in ``(0, 1]``.
        steps: Batches per epoch (default ``int(1 / q)``; the engine accounts each step at rate
            ``1 / steps >= q``, which is conservative).
        generator: Source of the inclusion masks; None seeds one from the operating system.

    Raises:
        ValueError: If ``q`` is not in ``(0, 1]``, ``steps < 1`` or no unit has a sequence.
    """

    def __init__(
        self,
        *,
        members: Sequence[Sequence[int]],
        sample_rate: float,
        steps: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        validate_sample_rate(sample_rate)
        if not members:
            raise ValueError("no unit to sample: the dataset is empty")
        self.members = [list(m) for m in members]
        self.sample_rate = float(sample_rate)
        self.num_units = len(self.members)
        self.steps = int(1 / self.sample_rate) if steps is None else int(steps)
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(secrets.randbits(63))
        self.generator = generator

    def __len__(self) -> int:
        return self.steps

    def sample_units(self) -> torch.Tensor:
        """One step's sampled unit indices, increasing (each with probability ``q``)."""
        mask = torch.rand(self.num_units, generator=self.generator) < self.sample_rate
        return torch.nonzero(mask).flatten()

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            yield [i for u in self.sample_units().tolist() for i in self.members[u]]


def _unit_generator(seed: int, unit_id: int) -> torch.Generator:
    """A generator that depends on ``(seed, unit_id)`` only: the random selection of one unit's
    sequences is the same whichever other units the dataset holds (add/remove adjacency)."""
    words = [abs(int(seed)), abs(int(unit_id)), int(unit_id) < 0]
    state = np.random.SeedSequence(words).generate_state(2, dtype=np.uint32)
    gen = torch.Generator()
    gen.manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)
    return gen


def select_unit_members(
    unit_of: Sequence[int],
    *,
    max_sequences_per_unit: int | None = None,
    selection: str = "first",
    selection_seed: int | None = None,
) -> tuple[list[int], list[list[int]]]:
    """The units of a dataset and the sequences of each that are used (module docstring).

    Args:
        unit_of: ``(N,)`` integer unit id of each sequence (the units are the distinct values).
        max_sequences_per_unit: At most this many sequences of a unit (None: all).
        selection: ``"first"`` (in dataset order) or ``"random"`` (uniformly without
            replacement, from ``(selection_seed, unit id)`` only), for a longer unit.
        selection_seed: Seed of the ``"random"`` selection (None: one from the OS).

    Returns:
        ``(unit_ids, members)``: ``unit_ids[u]`` the id of unit ``u`` (increasing) and
        ``members[u]`` the dataset indices of its selected sequences, increasing.

    Raises:
        ValueError: An invalid ``max_sequences_per_unit`` or ``selection``.
    """
    m = max_sequences_per_unit
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise ValueError(f"max_sequences_per_unit must be a positive int or None, got {m!r}")
    if selection not in _SELECTIONS:
        raise ValueError(f"selection must be one of {_SELECTIONS}, got {selection!r}")
    unit_ids = sorted(set(unit_of))
    index_of = {uid: u for u, uid in enumerate(unit_ids)}
    members: list[list[int]] = [[] for _ in unit_ids]
    for i, uid in enumerate(unit_of):
        members[index_of[uid]].append(i)
    seed = secrets.randbits(63) if selection_seed is None else int(selection_seed)
    for u, seqs in enumerate(members):
        if m is not None and len(seqs) > m:
            if selection == "first":
                members[u] = seqs[:m]
            else:
                pick = torch.randperm(len(seqs), generator=_unit_generator(seed, unit_ids[u]))
                members[u] = [seqs[j] for j in pick[:m].sort().values.tolist()]
    return unit_ids, members


def pack_whole_units(units: Sequence[int], *, max_batch_size: int) -> list[tuple[int, int]]:
    """Physical batches of consecutive whole units, packed greedily in order.

    Args:
        units: The unit of each item of a logical batch, a unit's items contiguous.
        max_batch_size: The largest physical batch (items), unless one unit is larger: such a
            unit forms a batch of its own (a unit is never split).

    Returns:
        ``[(start, end), ...]``: the item positions of each physical batch (none for no item).
    """
    chunks: list[tuple[int, int]] = []
    lo = start = 0
    while start < len(units):
        end = start
        while end < len(units) and units[end] == units[start]:
            end += 1
        if start > lo and end - lo > max_batch_size:
            chunks.append((lo, start))
            lo = start
        start = end
    if units:
        chunks.append((lo, len(units)))
    return chunks


def split_at_size(units: Sequence[int], *, max_batch_size: int) -> list[tuple[int, int]]:
    """Physical batches of ``max_batch_size`` consecutive items (the last one fewer), cutting
    units where needed (``UnitBatchMemoryManager(split_units=True)``).

    Args:
        units: The unit of each item of a logical batch (only its length is used).
        max_batch_size: The size of every physical batch but the last.

    Returns:
        ``[(start, end), ...]`` (none for no item).

    Raises:
        ValueError: If ``max_batch_size < 1``.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    n = len(units)
    return [(lo, min(lo + max_batch_size, n)) for lo in range(0, n, max_batch_size)]


class _Tagged(Dataset):
    """The sequence dataset, each item tagged with its unit and its unit's selected count."""

    def __init__(self, dataset: Dataset, unit_of: list[int], counts: list[int]) -> None:
        self.dataset = dataset
        self.unit_of = unit_of
        self.counts = counts

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[Any, int, int]:
        unit = self.unit_of[index]
        return self.dataset[index], unit, self.counts[unit]


def _empty_like(batch: Any) -> Any:
    """``batch`` (a collated batch of one) with every tensor cut to length 0."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return {k: _empty_like(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_empty_like(v) for v in batch)
    return batch


class _UnitCollate:
    """Collate tagged items into ``(batch, units)`` (see :class:`UnitDataLoader`)."""

    def __init__(
        self, collate_fn: Callable[[list[Any]], Any], template: Any, units_key: str
    ) -> None:
        self.collate_fn = collate_fn
        self.template = template
        self.units_key = units_key

    def __call__(self, items: list[tuple[Any, int, int]]) -> Any:
        if not items:
            batch = _empty_like(self.collate_fn([self.template]))
            return self._attach(batch, torch.zeros(0, dtype=torch.long))
        label: dict[int, int] = {}
        seen: dict[int, int] = {}
        units = []
        for _, unit, _count in items:
            units.append(label.setdefault(unit, len(label)))
            seen[unit] = seen.get(unit, 0) + 1
        split = [u for _, u, c in items if seen[u] != c]
        if split:
            raise ValueError(
                f"a physical batch holds {seen[split[0]]} of the "
                f"{next(c for _, u, c in items if u == split[0])} sequences of unit "
                f"{split[0]}: a unit's sequences were split across physical batches without "
                "saying where (e.g. by Opacus' BatchMemoryManager), and its clip factor needs "
                "the norm of the sum over all of its sequences. Use "
                "UnitBatchMemoryManager (split_units=True cuts units and tells the criterion "
                "where, unit_split=), a physical batch that holds the whole logical batch, or "
                "a smaller max_sequences_per_unit"
            )
        batch = self.collate_fn([item for item, _, _ in items])
        return self._attach(batch, torch.tensor(units, dtype=torch.long))

    def _attach(self, batch: Any, units: torch.Tensor) -> Any:
        if isinstance(batch, dict):
            return {**batch, self.units_key: units}
        if isinstance(batch, (tuple, list)):
            return (*batch, units)
        return batch, units


class UnitDataLoader(DataLoader):
    """A data loader that Poisson-samples privacy units and yields their sequences.

    Each step includes every unit independently with probability ``sample_rate`` and yields
    the sampled units' selected sequences, unit after unit. The batch is the collated
    sequences with the units attached: a ``dict`` batch gets the key ``units_key``; a tuple or
    list batch gets ``units`` appended as its last element; any other batch becomes
    ``(batch, units)``. ``units`` is a ``(B,)`` long tensor numbering the batch's units
    ``0..U-1`` in order of appearance, to pass to the criterion
    (``criterion(logits, labels, shape=..., units=batch["units"])``). An empty step (no unit
    sampled) yields a batch of ``B = 0`` sequences shaped like the dataset's first one.

    Given to ``PrivacyEngine.make_private(..., clipping="randomized")`` it is used as it is
    (not re-sampled), the accountant takes ``q = 1 / len(loader)`` (``= sample_rate`` when
    ``1 / sample_rate`` is an integer, else slightly larger: conservative) and the expected
    batch size (the divisor of the noisy sum under ``loss_reduction="mean"``) is the expected
    number of units at that rate, ``int(N_units / len(loader))`` (``N_units`` replaced by
    ``make_private``'s ``dataset_size`` if given: the public number of units).

    Args:
        dataset: The sequences (map-style).
        unit_of: ``(N,)`` integer unit id of each sequence of ``dataset`` (any integers; the
            units are the distinct values).
        sample_rate: ``q``, the inclusion probability of each unit per step.
        max_sequences_per_unit: At most this many sequences of a unit are used (None: all).
        selection: ``"first"`` (the first ones in dataset order) or ``"random"`` (uniformly
            without replacement, drawn once from ``selection_seed``), when a unit has more than
            ``max_sequences_per_unit``.
        selection_seed: Seed of the ``"random"`` selection (None: one from the OS). Unit
            ``u``'s choice depends on ``(selection_seed, its id)`` only, never on the other
            units or on any content.
        generator: Source of the per-step inclusion masks (None: seeded from the OS).
        steps: Steps per epoch (default ``int(1 / sample_rate)``).
        collate_fn: Collates a list of dataset items (default ``default_collate``).
        units_key: The key of ``units`` in a dict batch.
        **kwargs: Other ``torch.utils.data.DataLoader`` arguments (``num_workers``,
            ``pin_memory``...); not ``batch_size``, ``shuffle``, ``sampler``,
            ``batch_sampler`` or ``drop_last``.

    Attributes:
        sample_rate: ``q``.
        num_units: The number of units.
        selected: ``selected[u]``: the dataset indices of unit ``u``'s sequences in use.
        unit_ids: ``unit_ids[u]``: the id (from ``unit_of``) of unit ``u``.

    Raises:
        ValueError: A ``unit_of`` of the wrong length, an empty dataset, invalid ``sample_rate``,
            ``max_sequences_per_unit`` or ``selection``.
        TypeError: A batching argument in ``kwargs``.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        unit_of: Sequence[int] | torch.Tensor,
        sample_rate: float,
        max_sequences_per_unit: int | None = None,
        selection: str = "first",
        selection_seed: int | None = None,
        generator: torch.Generator | None = None,
        steps: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        units_key: str = "units",
        **kwargs: Any,
    ) -> None:
        taken = sorted(
            {"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(kwargs)
        )
        if taken:
            raise TypeError(f"UnitDataLoader samples the batches itself; do not pass {taken}")
        ids = unit_of.tolist() if isinstance(unit_of, torch.Tensor) else [int(u) for u in unit_of]
        n = len(dataset)  # type: ignore[arg-type]
        if len(ids) != n:
            raise ValueError(f"unit_of has {len(ids)} entries for a dataset of {n} sequences")
        m = max_sequences_per_unit
        unit_ids, members = select_unit_members(
            ids, max_sequences_per_unit=m, selection=selection, selection_seed=selection_seed
        )
        unit_of_index = [-1] * n
        for u, seqs in enumerate(members):
            for i in seqs:
                unit_of_index[i] = u
        sampler = self._unit_sampler(
            members=members, sample_rate=sample_rate, steps=steps, generator=generator
        )
        inner = default_collate if collate_fn is None else collate_fn
        super().__init__(
            _Tagged(dataset, unit_of_index, [len(s) for s in members]),
            batch_sampler=sampler,
            collate_fn=_UnitCollate(inner, dataset[members[0][0]], units_key),
            **kwargs,
        )
        self.sample_rate = sampler.sample_rate
        self.num_units = sampler.num_units
        self.selected = members
        self.unit_ids = unit_ids
        self.max_sequences_per_unit = m

    @property
    def expected_batch_units(self) -> float:
        """``q * num_units``, the expected number of units per step."""
        return self.sample_rate * self.num_units

    def _unit_sampler(
        self,
        *,
        members: list[list[int]],
        sample_rate: float,
        steps: int | None,
        generator: torch.Generator | None,
    ) -> UnitPoissonSampler:
        """The batch sampler (:class:`DistributedUnitDataLoader` gives each rank its shard)."""
        return UnitPoissonSampler(
            members=members, sample_rate=sample_rate, steps=steps, generator=generator
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

    def __call__(self, items: list[tuple[Any, int, int, int]]) -> Any:
        split = self.unit_split(items)
        # The inner collate checks that every unit is whole: present it the pieces as units.
        pieces = Counter(unit for _, unit, _, _ in items)
        whole = [(item, unit, pieces[unit]) for item, unit, _, _ in items]
        return self._attach(self.inner(whole), split)

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
    :class:`~opacus_rc.grad_sample.units.UnitSplit` after ``units`` (the last element of a
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
        split_key: The key of the :class:`~opacus_rc.grad_sample.units.UnitSplit` in a dict
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
        return DataLoader(
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


# ----------------------------------------------------------------------------------------------
# Data parallelism (DDP, DPDDP): every sampled unit on exactly one rank
# ----------------------------------------------------------------------------------------------


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
    ``q = 1 / len(loader)`` as in one process, and the divisor of each rank's noisy sum under
    ``loss_reduction="mean"`` is ``int(num_units / len(loader)) / world_size`` (Opacus' rule:
    the all-reduced mean of the ranks' sums divided by it is the single-process mean over the
    expected number of units, ``num_units`` being the units of the whole dataset). Noise is added
    once, on rank 0, by the distributed optimizer.

    Args:
        dataset: The sequences (map-style), the whole dataset on every rank.
        num_replicas: The number of ranks (None: the process group's world size).
        rank: This rank (None: the process group's rank).
        **kwargs: The arguments of :class:`UnitDataLoader` (``unit_of``, ``sample_rate`` ...).

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
            "every sampled unit. Use opacus_rc.unit_data_loader.DistributedUnitDataLoader "
            "(each sampled unit on exactly one rank; docs/privacy/units.md)"
        )
