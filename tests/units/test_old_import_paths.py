"""The import paths of the unit modules before they moved into ``opacus_rc.units`` still work:
they give the very objects of ``opacus_rc.units``, with a ``DeprecationWarning``."""

from __future__ import annotations

import importlib
import sys

import pytest

import opacus_rc.units as units


@pytest.mark.parametrize("old", ["opacus_rc.unit_data_loader", "opacus_rc.grad_sample.units"])
def test_an_old_path_re_exports_the_units_package_and_warns(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match="import from opacus_rc.units"):
        module = importlib.import_module(old)
    assert module.__all__, old
    for name in module.__all__:
        assert getattr(module, name) is getattr(units, name), name
    assert set(module.__all__) <= set(units.__all__)


def test_the_old_paths_cover_every_name_they_exported() -> None:
    sys.modules.pop("opacus_rc.unit_data_loader", None)
    sys.modules.pop("opacus_rc.grad_sample.units", None)
    with pytest.warns(DeprecationWarning):
        old_loader = importlib.import_module("opacus_rc.unit_data_loader")
        old_layout = importlib.import_module("opacus_rc.grad_sample.units")
    # the public names of the two modules before the move (their __all__ at 0de4de3)
    assert set(old_loader.__all__) == {
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
    }
    assert set(old_layout.__all__) == {
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
    }
    assert old_layout.open_unit_of is units.split.open_unit_of
