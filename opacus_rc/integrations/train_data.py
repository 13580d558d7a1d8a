"""A DP trainer's training data: its records, its Poisson schedule and its loader.

* :func:`trainer_schedule`: the rate ``q`` the trainer's sampler draws at, the rate the
  accountant records and the steps of an epoch, by the engine's own rule
  (:func:`opacus_rc.engine.schedule.accounted_schedule`, for the loader the trainer hands to
  ``make_private``), so the trainer's sampler, its noise search and the engine cannot disagree;
* :func:`train_dataset_and_collator`: the dataset and collator with unused columns removed, as
  the Trainer does;
* :func:`unit_members`: the units of ``PrivacyArguments.privacy_unit`` and their rows;
* :func:`logical_batch_loader`: the loader of logical batches, with the Trainer's worker
  options;
* :func:`check_delta`: ``target_delta`` below ``1 / N``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, Dataset

from opacus_rc._compat.transformers import collator_with_removed_columns, remove_unused_columns
from opacus_rc.engine.schedule import accounted_schedule, public_sizes
from opacus_rc.integrations.logical_batches import IndexDataset, LogicalBatchLoader
from opacus_rc.unit_data_loader import select_unit_members

__all__ = [
    "TrainerSchedule",
    "check_delta",
    "logical_batch_loader",
    "train_dataset_and_collator",
    "trainer_schedule",
    "unit_members",
]


@dataclass(frozen=True)
class TrainerSchedule:
    """The Poisson schedule of a DP trainer over ``n`` records (examples, or units).

    Attributes:
        rate_loader: ``DataLoader(IndexDataset(n), batch_size=expected_batch_size)``, the loader
            the trainer passes to ``make_private`` (only its length and batch size matter).
        sample_rate: ``q``, the rate every record is sampled at (Opacus' ``1 / len(loader)``).
        accounted_rate: The rate the accountant records, ``1 / steps`` (at least ``q``).
        steps: Logical batches per epoch, ``int(1 / q)``.
    """

    rate_loader: DataLoader
    sample_rate: float
    accounted_rate: float
    steps: int


def trainer_schedule(n: int, *, expected_batch_size: int) -> TrainerSchedule:
    """The schedule the engine gives a loader of batch size ``expected_batch_size`` over ``n``.

    ``q = 1 / ceil(n / expected_batch_size)`` (:func:`~opacus_rc.engine.schedule.public_sizes`)
    and an epoch of ``int(1 / q)`` steps, each accounted at ``1 / int(1 / q)``
    (:func:`~opacus_rc.engine.schedule.accounted_schedule`): ``q = 1/93`` gives 92 steps at
    ``1/92``.

    Args:
        n: The number of records (>= 1).
        expected_batch_size: The expected logical batch size (>= 1).

    Returns:
        The schedule.
    """
    loader = DataLoader(IndexDataset(n), batch_size=expected_batch_size)
    sizes = public_sizes(loader, dataset_size=None)
    accounted_rate, steps = accounted_schedule(sizes, data_loader=loader, poisson_sampling=True)
    return TrainerSchedule(loader, sizes.sample_rate, accounted_rate, steps)


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
        ValueError: The column is missing, or a row does not name its unit.
    """
    ids = _unit_column(dataset, column)
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
