"""Deprecated: import from :mod:`opacus_rc.units` (this module only re-exports its names).

The per-unit layout, the cut-unit buffer and the criterion's ``units=`` moved into the package
:mod:`opacus_rc.units`; this path is kept for scripts written against it (e.g. to
``register_tokenwise`` a module type). Nothing in ``opacus_rc`` imports it.
"""

import warnings

from opacus_rc.units import (
    TOKENWISE_TYPES,
    OpenUnit,
    UnitLayout,
    UnitSplit,
    check_no_open_unit,
    check_unit_routes,
    drop_open_unit,
    pack_for_units,
    register_tokenwise,
    unit_layout_for_loss,
    unit_norm_kinds,
    write_split_clipped_sums,
)
from opacus_rc.units.split import open_unit_of  # noqa: F401  (importable here before the move)

__all__ = [
    "TOKENWISE_TYPES",
    "OpenUnit",
    "UnitLayout",
    "UnitSplit",
    "check_no_open_unit",
    "check_unit_routes",
    "drop_open_unit",
    "pack_for_units",
    "register_tokenwise",
    "unit_layout_for_loss",
    "unit_norm_kinds",
    "write_split_clipped_sums",
]

warnings.warn(
    "opacus_rc.grad_sample.units is deprecated: import from opacus_rc.units",
    DeprecationWarning,
    stacklevel=2,
)
