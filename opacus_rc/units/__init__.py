"""Unit-level DP: the privacy unit is a document or a user, not a sequence (docs/privacy/units.md).

One package, each module one concept; every arrow below is an import, and none goes back up:

* :mod:`~opacus_rc.units.layout`: which sequences of a batch belong to which unit and how
  they are packed (:class:`UnitLayout`, :class:`UnitSplit`, the token-wise types).
* :mod:`~opacus_rc.units.split`: a unit cut across physical batches, kept open in an
  :class:`OpenUnit` buffer until its last sequence is in (imports ``layout``).
* :mod:`~opacus_rc.units.criterion`: the criterion's ``units=`` and ``unit_split=``, checked
  and recorded for the step (:func:`unit_layout_for_loss`; imports ``layout`` and ``split``).
* :mod:`~opacus_rc.units.record`: what the loader yielded, which the criterion's ``units=``
  is checked against (imports ``layout``).
* :mod:`~opacus_rc.units.data_loader`: Poisson sampling of units (:class:`UnitDataLoader`;
  imports ``record``).
* :mod:`~opacus_rc.units.distributed`: one rank's share of each sample of units
  (:class:`DistributedUnitDataLoader`) and the check that a loader matches the model's data
  parallelism (imports ``data_loader``).
* :mod:`~opacus_rc.units.batches`: virtual steps of units (:class:`UnitBatchMemoryManager`;
  imports ``data_loader``, ``distributed``, ``layout`` and ``record``).
"""

from opacus_rc.units.batches import UnitBatchMemoryManager, UnitBatchSplittingSampler
from opacus_rc.units.criterion import unit_layout_for_loss
from opacus_rc.units.data_loader import (
    RecordingUnitLoader,
    UnitDataLoader,
    UnitPoissonSampler,
    pack_whole_units,
    select_unit_members,
    split_at_size,
)
from opacus_rc.units.distributed import (
    DistributedUnitDataLoader,
    DistributedUnitPoissonSampler,
    check_unit_loader_world,
    prepare_unit_data_loader,
)
from opacus_rc.units.layout import (
    TOKENWISE_TYPES,
    UnitLayout,
    UnitSplit,
    check_unit_routes,
    pack_for_units,
    register_tokenwise,
)
from opacus_rc.units.split import (
    OpenUnit,
    check_no_open_unit,
    drop_open_unit,
    unit_norm_kinds,
    write_split_clipped_sums,
)

__all__ = [
    "TOKENWISE_TYPES",
    "DistributedUnitDataLoader",
    "DistributedUnitPoissonSampler",
    "OpenUnit",
    "RecordingUnitLoader",
    "UnitBatchMemoryManager",
    "UnitBatchSplittingSampler",
    "UnitDataLoader",
    "UnitLayout",
    "UnitPoissonSampler",
    "UnitSplit",
    "check_no_open_unit",
    "check_unit_loader_world",
    "check_unit_routes",
    "drop_open_unit",
    "pack_for_units",
    "pack_whole_units",
    "prepare_unit_data_loader",
    "register_tokenwise",
    "select_unit_members",
    "split_at_size",
    "unit_layout_for_loss",
    "unit_norm_kinds",
    "write_split_clipped_sums",
]
