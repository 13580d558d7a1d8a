"""Deprecated: import from :mod:`opacus_rc.units` (this module only re-exports its names).

The unit loaders moved into the package :mod:`opacus_rc.units`; this path is kept for scripts
written against it. Nothing in ``opacus_rc`` imports it.
"""

import warnings

from opacus_rc.units import (
    DistributedUnitDataLoader,
    DistributedUnitPoissonSampler,
    RecordingUnitLoader,
    UnitBatchMemoryManager,
    UnitBatchSplittingSampler,
    UnitDataLoader,
    UnitPoissonSampler,
    check_unit_loader_world,
    pack_whole_units,
    prepare_unit_data_loader,
    select_unit_members,
    split_at_size,
)

__all__ = [
    "DistributedUnitDataLoader",
    "DistributedUnitPoissonSampler",
    "RecordingUnitLoader",
    "UnitBatchMemoryManager",
    "UnitBatchSplittingSampler",
    "UnitDataLoader",
    "UnitPoissonSampler",
    "check_unit_loader_world",
    "pack_whole_units",
    "prepare_unit_data_loader",
    "select_unit_members",
    "split_at_size",
]

warnings.warn(
    "opacus_rc.unit_data_loader is deprecated: import from opacus_rc.units",
    DeprecationWarning,
    stacklevel=2,
)
