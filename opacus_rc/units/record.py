"""What the loader yielded, checked against the criterion's ``units=`` and ``unit_split=``
(docs/privacy/units.md#units-limits).

Per-unit clipping bounds a unit's contribution by ``C`` only when the criterion's ``units=``
groups the batch's sequences as the loader sampled them, and a cut unit is clipped once only
when every physical batch passes the :class:`~opacus_rc.units.UnitSplit` the
manager cut it with. Neither is visible in the criterion call, so the engine gives the module a
:class:`UnitBatchRecord` at ``make_private``: the
:class:`~opacus_rc.units.UnitDataLoader` (and the loader of
:class:`~opacus_rc.units.UnitBatchMemoryManager`) writes into it, in the process that
iterates, the unit of each sequence of the batch it yields and the batch's ``UnitSplit``; the
criterion call compares what it was given with it (:meth:`UnitBatchRecord.check`), before any
backward, noise or accounting. A model made private with a per-sequence loader gets a record
that refuses ``units=``: per-unit clipping under per-sequence sampling does not bound a
sequence's contribution by ``C`` (removing one sequence changes its unit's clipped sum by up to
``2 C``). A module without a record (built directly, not by the engine) is not checked.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from opacus_rc.units.layout import UnitSplit

__all__ = ["CollatedUnits", "UnitBatchRecord", "same_partition"]


class CollatedUnits(NamedTuple):
    """A unit loader's collate output, before the loader yields ``batch`` (what the user sees).

    A named tuple, so that ``pin_memory`` and worker processes carry it as they carry a batch.
    """

    #: The collated batch with ``units`` (and ``unit_split``) attached, as yielded.
    batch: Any
    #: ``(B,)`` long tensor: the loader's unit index of each sequence of the batch.
    units: torch.Tensor
    #: The batch's :class:`~opacus_rc.units.UnitSplit` when the manager cuts units
    #: (``split_units=True``), else None.
    split: Any


def same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``(B,)`` labels ``a`` and ``b`` group the ``B`` positions alike (up to
    relabelling): ``a[i] == a[j]`` exactly when ``b[i] == b[j]``."""
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    a = a.detach().to("cpu", torch.long).flatten()
    b = b.detach().to("cpu", torch.long).flatten()
    pairs = torch.unique(torch.stack([a, b]), dim=1).shape[1]
    return pairs == torch.unique(a).numel() == torch.unique(b).numel()


class UnitBatchRecord:
    """The batch a unit loader last yielded, for the module to check the criterion's call.

    Args:
        per_unit: Whether the model was made private with unit-level sampling (a
            :class:`~opacus_rc.units.UnitDataLoader`, or the Trainer's
            ``privacy_unit``); False: per-sequence sampling, where ``units=`` is refused.
        where: How the user passes the units, for the messages (e.g. ``"units=batch['units']"``).
    """

    def __init__(self, *, per_unit: bool, where: str = "units=") -> None:
        self.per_unit = bool(per_unit)
        self.where = where
        #: ``(B,)`` unit of each sequence of the batch last yielded, or None (none yet).
        self.units: torch.Tensor | None = None
        #: That batch's UnitSplit (``split_units=True``), else None.
        self.split: Any = None
        #: Whether that batch came from ``UnitBatchMemoryManager(split_units=True)``.
        self.split_units = False

    def record(self, units: torch.Tensor, *, split: Any = None, split_units: bool = False) -> None:
        """Record the batch being yielded: ``units`` ``(B,)`` and its split (or None)."""
        self.units = units.detach().to("cpu", torch.long)
        self.split = split
        self.split_units = bool(split_units)

    def check(self, units: torch.Tensor | None, split: Any) -> None:
        """Refuse a criterion call whose ``units=``/``unit_split=`` is not the batch's.

        Args:
            units: The criterion's ``units=`` (``(B,)``) or None.
            split: The criterion's ``unit_split=`` or None.

        Raises:
            ValueError: ``units=`` under per-sequence sampling; no ``units=`` under unit
                sampling; ``units=`` that groups the sequences otherwise than the loader's
                batch; a ``unit_split=`` that is not the one the manager yielded with the batch.
        """
        if not self.per_unit:
            if units is not None:
                raise ValueError(
                    "units= was passed, but the model was made private with a per-sequence "
                    "data loader: the accountant counts each sequence as a record at the "
                    "sequence rate, and per-unit clipping under per-sequence sampling does not "
                    "bound a sequence's contribution by max_grad_norm (removing one sequence "
                    "changes its unit's clipped sum by up to 2 C). Make the model private with "
                    "a UnitDataLoader (unit-level DP), or drop units="
                )
            return
        if units is None:
            raise ValueError(
                "the model was made private with unit-level sampling, but the criterion was "
                f"called without units=: each sequence would be clipped alone, so a unit of k "
                f"sequences would contribute up to k C while accounted as one unit. Pass the "
                f"batch's units to the criterion ({self.where})"
            )
        if self.units is None:
            raise ValueError(
                "units= was passed, but the unit loader the model was made private with has "
                "yielded no batch: iterate that loader (or its UnitBatchMemoryManager) and pass "
                f"each batch's own units ({self.where})"
            )
        got = units if isinstance(units, torch.Tensor) else torch.as_tensor(units)
        if not same_partition(got, self.units):
            raise ValueError(
                f"units= (shape {tuple(got.shape)}) does not group the batch's sequences as "
                f"the unit loader sampled them ({self.units.numel()} sequences of "
                f"{torch.unique(self.units).numel()} units): each sampled unit must be one unit "
                "of units= (any labels), or its clip bound and the accountant's per-unit rate "
                f"would not match. Pass the batch's own units ({self.where})"
            )
        if self.split_units:
            if not isinstance(split, UnitSplit) or split != self.split:
                raise ValueError(
                    f"unit_split={split!r}, but UnitBatchMemoryManager(split_units=True) "
                    f"yielded this batch with {self.split!r}: a unit cut across physical "
                    "batches is clipped once only if every physical batch passes its own "
                    "UnitSplit (criterion(..., units=units, unit_split=split), split as yielded)"
                )
        elif isinstance(split, tuple) and len(split) == 2 and (split[0] or split[1]):
            raise ValueError(
                f"unit_split={split!r} says a unit is cut, but the loader yielded this batch "
                "with whole units (cut units come from UnitBatchMemoryManager(split_units=True))"
            )
