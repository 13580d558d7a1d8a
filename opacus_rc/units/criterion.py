"""The criterion's ``units=`` and ``unit_split=``: checked and recorded for the step.

:func:`unit_layout_for_loss` is what :class:`~opacus_rc.optimizers.DPLossRandomizedClipping`
calls with the per-sequence losses: it checks ``units=`` and ``unit_split=`` against the batch
the loader yielded (:class:`~opacus_rc.units.record.UnitBatchRecord`), builds the batch's
:class:`~opacus_rc.units.layout.UnitLayout`, checks a cut against the open unit
(:mod:`opacus_rc.units.split`) and records the layout in the module's step
(``module.private_step``), so that the backward hooks pack per unit (docs/privacy/units.md).
"""

from __future__ import annotations

from typing import Any

import torch
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from opacus_rc._compat.opacus import wrapped_module
from opacus_rc.units.layout import UnitLayout, UnitSplit, check_unit_routes
from opacus_rc.units.split import _check_split

__all__ = ["unit_layout_for_loss"]

#: Distributed model types: ``units=`` is supported (each unit on one rank), a cut unit
#: (``unit_split=``) is refused.
_DISTRIBUTED = (DistributedDataParallel, DifferentiallyPrivateDistributedDataParallel, FSDPModule)


def unit_layout_for_loss(
    module: Any,
    losses: torch.Tensor,
    units: torch.Tensor | None,
    *,
    split: UnitSplit | tuple[bool, bool] | None = None,
) -> UnitLayout | None:
    """Validate ``units=`` of a criterion call and record the step's layout.

    Called by :class:`~opacus_rc.optimizers.DPLossRandomizedClipping` with the per-sequence
    losses it computed; records the layout (or None) in the module's step state, so that the
    backward hooks pack per unit.

    Args:
        module: The randomized-clipping grad-sample module (or hooks object).
        losses: ``(B,)`` per-sequence losses.
        units: ``(B,)`` integer unit of each sequence, or None.
        split: The batch's :class:`UnitSplit` (a unit cut across physical batches), or None
            (every unit whole).

    Returns:
        The :class:`UnitLayout`, or None without ``units``.

    Raises:
        ValueError: For a module made private by the engine, ``units``/``split`` that are not
            the batch the loader yielded (missing ``units=`` under unit sampling, ``units=``
            under per-sequence sampling, another grouping, another ``unit_split``; see
            :meth:`opacus_rc.units.record.UnitBatchRecord.check`).
        TypeError, ValueError: A malformed ``units`` (see :class:`UnitLayout`), one of another
            length than the losses, per-token losses without ``shape=``, ``batch_first=False``,
            or a step whose other criterion calls disagree
            (:meth:`~opacus_rc.grad_sample.private_step.PrivateStep.set_units`); a ``split``
            that disagrees with the open unit (:func:`_check_split`).
        NotImplementedError: A trainable module that is not token-wise
            (:func:`check_unit_routes`); a cut unit without book-keeping, with a sketched
            module whose norm cannot be taken from a summed gradient, or with a distributed
            model (DDP, DPDDP, FSDP2; whole units are supported there, each on one rank:
            :class:`~opacus_rc.units.DistributedUnitDataLoader`).
    """
    # Made private by the engine: units= must be the loader's batch's (units/record.py); a
    # malformed units= gets its own message below first.
    record = getattr(module, "unit_batch_record", None)
    if record is not None and units is None:
        record.check(units, split)
    step = getattr(module, "private_step", None)
    if units is None:
        if split is not None:
            raise ValueError("unit_split= needs units= (the unit of each sequence)")
        if step is not None:
            _check_split(step, None)
            step.set_units(None)
        return None
    if step is None:
        raise TypeError(
            "units= needs the randomized-clipping module (make_private(..., clipping='randomized'))"
        )
    # Distributed models (DDP, DPDDP, FSDP2) need nothing here: each rank packs its own
    # sequences, and DistributedUnitDataLoader keeps each unit on one rank.
    model = wrapped_module(module)
    if not module.clipping_config.batch_first:
        raise ValueError("units= needs batch_first=True")
    check_unit_routes(model)
    layout = UnitLayout(units.to(losses.device) if isinstance(units, torch.Tensor) else units)
    if losses.dim() != 1 or layout.batch_size != losses.shape[0]:
        raise ValueError(
            f"units has {layout.batch_size} entries but the per-sequence losses have shape "
            f"{tuple(losses.shape)}: pass one unit per sequence of the batch (and shape= for a "
            "per-token loss)"
        )
    if record is not None:
        record.check(units, split)
    if split is not None:
        if not (isinstance(split, tuple) and len(split) == 2):
            raise TypeError(
                "unit_split must be a UnitSplit(continued, continues) (as "
                f"UnitBatchMemoryManager(split_units=True) yields it), got {split!r}"
            )
        split = UnitSplit(bool(split[0]), bool(split[1]))
        layout.split = split if (split.continued or split.continues) else None
        if layout.split is not None and isinstance(model, _DISTRIBUTED):
            raise NotImplementedError(
                f"a unit cut across physical batches (unit_split=) is not supported for a "
                f"distributed model ({type(model).__name__}): each rank cuts its own units, so "
                "the ranks' physical batches (and DDP's or FSDP2's collectives of each "
                "backward) would not line up, and the open unit's buffer is not sharded. Train "
                "whole units: DistributedUnitDataLoader without UnitBatchMemoryManager, "
                "or split units in one process (docs/privacy/units.md#units-distributed)"
            )
    _check_split(step, layout)
    step.set_units(layout)
    return layout
