"""A DP trainer's training data: its records, its Poisson schedule and its loader.

* :func:`trainer_schedule`: the rate ``q`` the trainer's sampler draws at, the rate the
  accountant records and the steps of an epoch: the engine's own
  :func:`opacus_rc.engine.schedule.public_sizes` of the loader the trainer hands to
  ``make_private`` (the sizes the engine's :class:`~opacus_rc.mechanism.Mechanism` holds), so
  the trainer's sampler, its noise search and the engine cannot disagree;
* :func:`train_dataset_and_collator`: the dataset and collator with unused columns removed, as
  the Trainer does;
* :func:`unit_members`: the units of ``PrivacyArguments.privacy_unit`` and their rows;
* :func:`example_train_loader` and :func:`unit_train_loader`: the trainer's loader of Poisson
  logical batches of examples, or of units (``PrivacyArguments.privacy_unit``), through
  :func:`logical_batch_loader` (the Trainer's worker options);
* :func:`check_delta`: ``target_delta`` below ``1 / N``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from opacus_rc._compat.transformers import (
    collator_with_removed_columns,
    remove_unused_columns,
    train_batch_size,
)
from opacus_rc.engine.schedule import public_sizes
from opacus_rc.integrations.logical_batches import (
    IndexDataset,
    LogicalBatchCollator,
    LogicalBatchLoader,
    PoissonLogicalBatchSampler,
    UnitLogicalBatchCollator,
    UnitLogicalBatchSampler,
    UnitRows,
)
from opacus_rc.integrations.packed_batches import PackedLogicalBatchCollator
from opacus_rc.mechanism import PublicSizes
from opacus_rc.units.data_loader import select_unit_members

__all__ = [
    "TrainerSchedule",
    "check_delta",
    "example_train_loader",
    "logical_batch_loader",
    "train_dataset_and_collator",
    "trainer_schedule",
    "unit_members",
    "unit_train_loader",
]


@dataclass(frozen=True)
class TrainerSchedule:
    """The Poisson schedule of a DP trainer over ``n`` records (examples, or units).

    Attributes:
        rate_loader: ``DataLoader(IndexDataset(n), batch_size=expected_batch_size)``, the loader
            the trainer passes to ``make_private`` (only its length and batch size matter).
        sizes: The engine's :func:`~opacus_rc.engine.schedule.public_sizes` of that loader: the
            :class:`~opacus_rc.mechanism.PublicSizes` that ``make_private`` puts in the run's
            mechanism (``engine.mechanism.sizes``).
    """

    rate_loader: DataLoader
    sizes: PublicSizes


def trainer_schedule(
    n: int, *, expected_batch_size: int, dataset_size: int | None = None, world_size: int = 1
) -> TrainerSchedule:
    """The schedule the engine gives a loader of batch size ``expected_batch_size`` over ``n``.

    The engine's own function, :func:`~opacus_rc.engine.schedule.public_sizes`, on the loader
    the trainer hands to ``make_private``: ``q = 1 / ceil(n / expected_batch_size)`` and an
    epoch of ``int(1 / q)`` steps, each accounted at ``1 / int(1 / q)`` (``q = 1/93`` gives 92
    steps at ``1/92``).

    Args:
        n: The number of records (>= 1).
        expected_batch_size: The expected logical batch size (>= 1).
        dataset_size: The public number of records ``N'`` (``PrivacyArguments.dataset_size``):
            given, ``q = 1 / ceil(N' / expected_batch_size)`` whatever ``n``.
        world_size: The number of data-parallel processes of the run (as the engine counts
            them for the DP model it is given).

    Returns:
        The schedule.
    """
    loader = DataLoader(IndexDataset(n), batch_size=expected_batch_size)
    return TrainerSchedule(
        loader, public_sizes(loader, dataset_size=dataset_size, world_size=world_size)
    )


def check_delta(target_delta: float, n: int, what: str) -> None:
    """Refuse a ``target_delta`` that is not below ``1 / n``.

    Raises:
        ValueError: If ``target_delta >= 1 / n``.
    """
    if target_delta >= 1 / n:
        raise ValueError(
            f"target_delta={target_delta} is not below 1 / N = {1 / n:.3g} "
            f"(N = {n} {what}): such a delta allows releasing a record; choose "
            "target_delta well below 1 / N"
        )


def train_dataset_and_collator(trainer: Any) -> tuple[Dataset, Any]:
    """The training dataset and collator, with unused columns removed as the Trainer does."""
    dataset, collator = trainer.train_dataset, trainer.data_collator
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a transformers dependency
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        dataset = remove_unused_columns(trainer, dataset, description="Training")
    else:
        collator = collator_with_removed_columns(trainer, collator, description="Training")
    return dataset, collator


def _unit_column(dataset: Any, column: str) -> list[Any]:
    """The values of the unit column of the (unfiltered) training dataset."""
    names = getattr(dataset, "column_names", None)
    if names is not None:
        if column not in names:
            raise ValueError(
                f"PrivacyArguments.privacy_unit={column!r} is not a column of the training "
                f"dataset (columns: {names})"
            )
        return list(dataset[column])
    values = []
    for i in range(len(dataset)):
        row = dataset[i]
        if not isinstance(row, Mapping) or column not in row:
            raise ValueError(
                f"PrivacyArguments.privacy_unit={column!r}: row {i} of the training dataset "
                "has no such key; every row must name its unit"
            )
        values.append(row[column])
    return values


_UNIT_ID = (
    "a unit id must be one hashable scalar per row (an int or a str, e.g. a document or user id)"
)


def _unit_ids(values: list[Any], column: str) -> list[Any]:
    """The unit ids of the rows, checked: 0-d tensors and NumPy scalars become Python scalars
    (a tensor hashes by identity, which would make every row its own unit).

    Raises:
        ValueError: A value is missing (None or NaN: a missing unit id is not a unit), or is
            not a hashable scalar.
    """
    ids, missing = [], []
    for i, v in enumerate(values):
        if isinstance(v, (torch.Tensor, np.ndarray, np.generic)):
            if v.ndim != 0:
                raise ValueError(
                    f"PrivacyArguments.privacy_unit={column!r}: row {i} has a "
                    f"{type(v).__name__} of shape {tuple(v.shape)} as its unit id; {_UNIT_ID}. "
                    "Is the column a model input (input_ids, labels) rather than the column "
                    "naming each row's document or user?"
                )
            v = v.item()
        if v is None or (isinstance(v, float) and math.isnan(v)):
            missing.append(i)
            ids.append(v)
            continue
        try:
            hash(v)
        except TypeError:
            raise ValueError(
                f"PrivacyArguments.privacy_unit={column!r}: row {i} has a "
                f"{type(v).__name__} as its unit id ({_short(v)}); {_UNIT_ID}. Is the column "
                "a model input (input_ids, labels) rather than the column naming each row's "
                "document or user?"
            ) from None
        ids.append(v)
    if missing:
        raise ValueError(
            f"PrivacyArguments.privacy_unit={column!r}: {len(missing)} of the {len(values)} "
            f"rows have no unit id (None or NaN; the first is row {missing[0]}). A missing "
            "unit id is not a unit: give every row its unit, or drop those rows"
        )
    return ids


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def unit_members(
    dataset: Any, column: str, *, max_sequences_per_unit: int | None
) -> tuple[list[int], list[list[int]]]:
    """Each row's unit and each unit's selected rows.

    Args:
        dataset: The (unfiltered) training dataset.
        column: The column (or row key) naming each row's unit.
        max_sequences_per_unit: At most this many rows of a unit are used (its first), or all.

    Returns:
        ``(unit_of, members)``: ``unit_of[i]`` in ``0..U-1`` (in order of first appearance)
        and ``members[u]``, the selected rows of unit ``u``.

    Raises:
        ValueError: The column is missing, a row does not name its unit, a unit id is missing
            (None or NaN), or a unit id is not a hashable scalar (a list, a dict, a tensor of
            several values: e.g. ``privacy_unit="input_ids"``).
    """
    ids = _unit_ids(_unit_column(dataset, column), column)
    # Hashable values to 0..U-1 in order of first appearance (the "first" selection below
    # depends only on each unit's own rows, in dataset order).
    index_of: dict[Any, int] = {}
    unit_of = [index_of.setdefault(v, len(index_of)) for v in ids]
    _, members = select_unit_members(unit_of, max_sequences_per_unit=max_sequences_per_unit)
    return unit_of, members


def logical_batch_loader(
    trainer: Any, dataset: Dataset, *, batch_sampler: Any, collate_fn: Any
) -> LogicalBatchLoader:
    """The loader of logical batches, with the Trainer's ``dataloader_*`` worker options."""
    return LogicalBatchLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        num_workers=trainer.args.dataloader_num_workers,
        pin_memory=trainer.args.dataloader_pin_memory,
        persistent_workers=trainer.args.dataloader_persistent_workers,
        prefetch_factor=trainer.args.dataloader_prefetch_factor,
    )


def example_train_loader(trainer: Any, dataset: Dataset, collator: Any) -> LogicalBatchLoader:
    """The loader of Poisson logical batches of examples (``DPTrainerMixin.get_train_dataloader``).

    Every example is in a logical batch independently with probability ``q`` of
    :func:`trainer_schedule`; under DDP each rank gets its shard of the same mask. Sets
    ``trainer._num_records`` (the ``N`` examples) and, the first time,
    ``trainer._poisson_sampler`` (from ``trainer._sampler_seed``; later calls reuse it).

    Args:
        trainer: The DP trainer.
        dataset: The training dataset, unused columns removed.
        collator: The data collator (of one micro-batch).

    Returns:
        The loader.

    Raises:
        ValueError: ``target_delta`` not below ``1 / N``.
    """
    n = len(dataset)
    trainer._num_records = n
    pa = trainer.privacy_args
    check_delta(pa.target_delta, pa.dataset_size or n, "training examples")
    schedule = trainer_schedule(
        n, expected_batch_size=pa.expected_batch_size, dataset_size=pa.dataset_size
    )
    if trainer._poisson_sampler is None:
        trainer._poisson_sampler = PoissonLogicalBatchSampler(
            num_samples=n,
            sample_rate=schedule.sizes.sample_rate,
            steps=schedule.sizes.steps_per_epoch,
            seed=trainer._sampler_seed,
            rank=trainer._rank,
            world_size=trainer._world_size,
        )
    packing = getattr(trainer, "_dp_packing", None)
    if packing is not None:  # each logical batch's sampled records packed into rows
        collate: LogicalBatchCollator = PackedLogicalBatchCollator(
            packing=packing, max_physical_batch_size=train_batch_size(trainer)
        )
    else:
        collate = LogicalBatchCollator(
            collate_fn=collator, max_physical_batch_size=train_batch_size(trainer)
        )
    return logical_batch_loader(
        trainer, dataset, batch_sampler=trainer._poisson_sampler, collate_fn=collate
    )


def unit_train_loader(trainer: Any, dataset: Dataset, collator: Any) -> LogicalBatchLoader:
    """The Poisson loader of *units* (``PrivacyArguments.privacy_unit``).

    Every unit is in a logical batch independently with probability
    ``q = 1 / ceil(U / expected_batch_size)`` (the per-example rule with the ``U`` units as the
    records), with all of its selected rows, in micro-batches of whole units. Sets
    ``trainer._num_records`` (``U``) and, the first time, ``trainer._poisson_sampler``.

    Args:
        trainer: The DP trainer.
        dataset: The training dataset, unused columns removed (the unit column is read from
            ``trainer.train_dataset``, before the removal).
        collator: The data collator (of one micro-batch).

    Returns:
        The loader.

    Raises:
        ValueError: The unit column is missing or has a missing (None, NaN) or unhashable
            unit id (:func:`unit_members`), a unit has more selected rows than
            ``per_device_train_batch_size`` (it could not be clipped in one micro-batch), or
            ``target_delta`` is not below ``1 / U``.
    """
    pa = trainer.privacy_args
    column = pa.privacy_unit
    unit_of, members = unit_members(
        trainer.train_dataset, column, max_sequences_per_unit=pa.max_sequences_per_unit
    )
    num_units = len(members)
    trainer._num_records = num_units
    check_delta(pa.target_delta, pa.dataset_size or num_units, f"units of {column!r}")
    physical = train_batch_size(trainer)
    packing = getattr(trainer, "_dp_packing", None)
    # Packed: a unit's records share rows; a unit needing more rows is refused when sampled.
    too_big = [] if packing is not None else [len(m) for m in members if len(m) > physical]
    if too_big:
        raise ValueError(
            f"{len(too_big)} of the {num_units} units of {column!r} have more rows than "
            f"per_device_train_batch_size={physical} (the largest has {max(too_big)}): a "
            "unit's rows are clipped together, in one micro-batch. Raise "
            f"per_device_train_batch_size to at least {max(too_big)}, or set "
            f"PrivacyArguments.max_sequences_per_unit <= {physical}"
        )
    schedule = trainer_schedule(
        num_units, expected_batch_size=pa.expected_batch_size, dataset_size=pa.dataset_size
    )
    if trainer._poisson_sampler is None:
        trainer._poisson_sampler = UnitLogicalBatchSampler(
            members=members,
            sample_rate=schedule.sizes.sample_rate,
            steps=schedule.sizes.steps_per_epoch,
            seed=trainer._sampler_seed,
            rank=trainer._rank,  # DDP: each sampled unit on rank u % world_size
            world_size=trainer._world_size,
        )
    return logical_batch_loader(
        trainer,
        UnitRows(dataset, unit_of, column),
        batch_sampler=trainer._poisson_sampler,
        collate_fn=(
            UnitLogicalBatchCollator(collate_fn=collator, max_physical_batch_size=physical)
            if packing is None
            else PackedLogicalBatchCollator(
                packing=packing, max_physical_batch_size=physical, units=True
            )
        ),
    )
