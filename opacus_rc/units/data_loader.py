"""Poisson sampling of privacy units (documents, users) for unit-level DP-SGD
(docs/privacy/units.md).

:class:`UnitDataLoader` wraps a dataset of sequences (e.g. the context-sized windows of long
documents) and the unit of each sequence. At every step it includes each *unit*
independently with probability ``q`` (Poisson subsampling of units) and yields all of the
sampled units' sequences (at most ``max_sequences_per_unit`` of each), together with the
``(B,)`` tensor ``units`` that numbers the batch's units ``0..U-1``, which is what the
criterion's ``units=`` takes (:mod:`opacus_rc.units.layout`).

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
needed, and each batch carries a :class:`~opacus_rc.units.UnitSplit` (whether its
first unit continues one from the previous batch and whether its last one continues into the
next) to pass to the criterion as ``unit_split=``. The module then keeps the open unit's
unclipped summed gradient until its last sequence is in, and clips it once
(docs/privacy/units.md#units-split): a unit of 32 windows trains in micro-batches of 4 with the
same update and the same guarantee as in one batch.

**Modules.** The virtual-step manager lives in :mod:`opacus_rc.units.batches` and the loader of
one rank of a data-parallel run (:class:`~opacus_rc.units.distributed.DistributedUnitDataLoader`,
each sampled unit on one rank) in :mod:`opacus_rc.units.distributed`; both import this module,
which imports neither.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Sequence
from numbers import Integral
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.dataloader import default_collate

from opacus_rc.units.record import CollatedUnits, UnitBatchRecord
from opacus_rc.validation import validate_sample_rate

__all__ = [
    "RecordingUnitLoader",
    "UnitDataLoader",
    "UnitPoissonSampler",
    "pack_whole_units",
    "select_unit_members",
    "split_at_size",
]

_SELECTIONS = ("first", "random")


class UnitPoissonSampler(Sampler[list[int]]):
    """Batches of sequence indices: every unit included independently with probability ``q``.

    Args:
        members: ``members[u]``: the dataset indices of unit ``u``'s (selected) sequences.
        sample_rate: ``q`` in ``(0, 1]``.
        steps: Batches per epoch (default ``int(1 / q)``); the engine accounts each step at
            the rate the units are drawn at, ``1 / int(1 / q) >= q``, whatever ``steps`` is.
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
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, Integral)):
            raise TypeError(f"steps must be an integer >= 1 or None, got {steps!r}")
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

    def __call__(self, items: list[tuple[Any, int, int]]) -> CollatedUnits:
        """The batch, and the loader's unit index of each item (for :class:`UnitBatchRecord`)."""
        if not items:
            batch = _empty_like(self.collate_fn([self.template]))
            empty = torch.zeros(0, dtype=torch.long)
            return CollatedUnits(self._attach(batch, empty), empty, None)
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
        own = torch.tensor([unit for _, unit, _ in items], dtype=torch.long)
        return CollatedUnits(self._attach(batch, torch.tensor(units, dtype=torch.long)), own, None)

    def _attach(self, batch: Any, units: torch.Tensor) -> Any:
        if isinstance(batch, dict):
            return {**batch, self.units_key: units}
        if isinstance(batch, (tuple, list)):
            return (*batch, units)
        return batch, units


class RecordingUnitLoader(DataLoader):
    """A data loader whose collate function returns :class:`CollatedUnits`: it yields the
    batch and, in the iterating process, records the units of each batch it yields in
    ``unit_record`` (set by ``make_private``; None: nothing recorded).

    Args:
        *args: ``torch.utils.data.DataLoader``'s arguments.
        split_units: Whether the batches cut units (``UnitBatchMemoryManager(split_units=True)``).
        unit_record: Where to record each yielded batch's units, or None.
        **kwargs: ``torch.utils.data.DataLoader``'s arguments.
    """

    def __init__(
        self,
        *args: Any,
        split_units: bool = False,
        unit_record: UnitBatchRecord | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.split_units = split_units
        self.unit_record = unit_record

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        for out in super().__iter__():
            if not isinstance(out, CollatedUnits):  # a user's own collate function
                yield out
                continue
            if self.unit_record is not None:
                self.unit_record.record(out.units, split=out.split, split_units=self.split_units)
            yield out.batch


def _integer_unit_ids(unit_of: Sequence[int] | torch.Tensor) -> list[int]:
    """``unit_of`` as a list of Python ints; anything but integers is refused.

    A float id would be truncated by ``int`` (``1.5`` and ``1.0`` one unit: two units merged,
    whose joint clipped sum is not bounded by ``C`` per original unit) and a string has no
    order to number the units by, so neither is converted.

    Raises:
        TypeError: A non-integer tensor dtype (floating, complex or bool) or a non-integer
            entry (a float, a str, a bool).
    """
    if isinstance(unit_of, torch.Tensor):
        if (
            unit_of.dtype.is_floating_point
            or unit_of.dtype.is_complex
            or unit_of.dtype == torch.bool
        ):
            raise TypeError(
                f"unit_of must hold integer unit ids, got a tensor of dtype {unit_of.dtype}: "
                "map each sequence's document or user to an integer first"
            )
        return [int(u) for u in unit_of.reshape(-1).tolist()]
    ids = []
    for i, u in enumerate(unit_of):
        if isinstance(u, bool) or not isinstance(u, Integral):
            raise TypeError(
                f"unit_of must hold integer unit ids, got {u!r} ({type(u).__name__}) at "
                f"position {i}: map each sequence's document or user to an integer first"
            )
        ids.append(int(u))
    return ids


class UnitDataLoader(RecordingUnitLoader):
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
    (not re-sampled), the accountant takes the rate the units are drawn at, as for Opacus'
    ``DPDataLoader``: ``1 / int(1 / sample_rate)`` (``= sample_rate`` when ``1 / sample_rate``
    is an integer, else slightly larger: conservative), whatever ``steps`` is. The divisor of
    the noisy sum under ``loss_reduction="mean"`` (the expected batch size) must be public,
    the same on neighbouring datasets (docs/privacy/mechanism.md#mechanism-public): it is
    ``expected_batch_size`` if given, else ``int(U * q)`` with ``U`` the public number of
    units passed as ``make_private``'s ``dataset_size``; never the loader's own number of
    units, which is private (12 units against 11 at ``q = 0.25`` would divide by 3 against
    2, Opacus #819). With neither, ``make_private`` raises ``ValueError`` under
    ``loss_reduction="mean"``.

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
        steps: Steps per epoch (default ``int(1 / sample_rate)``); the number of steps only,
            not the accounted rate.
        expected_batch_size: The public expected number of units per step (an integer >= 1,
            e.g. ``sample_rate`` times the announced number of units; for a
            :class:`DistributedUnitDataLoader`, of all ranks together), the divisor of the
            noisy sum under ``loss_reduction="mean"``; None: ``make_private``'s
            ``dataset_size`` gives it. Any public value keeps the guarantee (dividing by a
            constant is post-processing); one far from the real number only rescales the
            step, like a learning rate.
        collate_fn: Collates a list of dataset items (default ``default_collate``).
        units_key: The key of ``units`` in a dict batch.
        **kwargs: Other ``torch.utils.data.DataLoader`` arguments (``num_workers``,
            ``pin_memory``...); not ``batch_size``, ``shuffle``, ``sampler``,
            ``batch_sampler`` or ``drop_last``.

    Attributes:
        sample_rate: ``q``.
        expected_batch_size: The public expected number of units per step, or None.
        num_units: The number of units (private: never used for the mechanism).
        selected: ``selected[u]``: the dataset indices of unit ``u``'s sequences in use.
        unit_ids: ``unit_ids[u]``: the id (from ``unit_of``) of unit ``u``.

    Raises:
        ValueError: A ``unit_of`` of the wrong length, an empty dataset, invalid ``sample_rate``,
            ``max_sequences_per_unit``, ``selection`` or ``expected_batch_size`` (not an
            integer >= 1).
        TypeError: A batching argument in ``kwargs``, a non-integer unit id in ``unit_of`` (a
            float, str or bool: never truncated, which could merge two units), or a
            non-integer ``steps``.
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
        expected_batch_size: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        units_key: str = "units",
        **kwargs: Any,
    ) -> None:
        e = expected_batch_size
        if e is not None and (isinstance(e, bool) or not isinstance(e, Integral) or e < 1):
            raise ValueError(
                f"expected_batch_size (the public expected number of units per step) must be "
                f"an integer >= 1 or None, got {e!r}"
            )
        taken = sorted(
            {"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(kwargs)
        )
        if taken:
            raise TypeError(f"UnitDataLoader samples the batches itself; do not pass {taken}")
        ids = _integer_unit_ids(unit_of)
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
        self.expected_batch_size = None if e is None else int(e)
        self.num_units = sampler.num_units
        self.selected = members
        self.unit_ids = unit_ids
        self.max_sequences_per_unit = m

    @property
    def expected_batch_units(self) -> float:
        """``q * num_units``, the expected number of units per step.

        Computed from the private number of units: informative only, never the divisor
        (pass a public ``expected_batch_size`` for that).
        """
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
