"""benchmarks/overhead_bound.py: the quick run writes a consistent table."""

from __future__ import annotations

import math

import pytest

from benchmarks import common
from benchmarks import overhead_bound as ob


def test_quick_run_writes_a_consistent_table(tmp_path) -> None:
    assert ob.main(["--quick", "--out", str(tmp_path), "--rounds", "1"]) == 0
    rows = common.read_csv(tmp_path / "overhead_bound_off_8x2.csv")
    assert list(rows[0]) == ob.COLUMNS
    ms = {r["quantity"]: float(r["ms"]) for r in rows}
    assert list(ms)[: len(ob.COMPONENTS) + 1] == ["non_private step", *ob.COMPONENTS]
    # The bound is the non-private step plus the four components, as the table says
    assert math.isclose(
        ms["bound"], ms["non_private step"] + sum(ms[c] for c in ob.COMPONENTS), rel_tol=1e-4
    )
    assert math.isclose(
        ms["rest (rc - bound)"], ms["rc step (measured)"] - ms["bound"], rel_tol=1e-4, abs_tol=1e-3
    )
    # Work that only the private step does takes time
    assert ms["noise"] > 0 and ms["sketch"] > 0 and ms["clipped sums (rc)"] > 0
    assert ms["per-sample gradients in the hooks (rc)"] == 0  # T = 8: A and G are kept
    ratio = {r["quantity"]: r["ratio"] for r in rows}
    assert math.isclose(float(ratio["bound"]), ms["bound"] / ms["non_private step"], rel_tol=1e-3)
    assert (tmp_path / "overhead_bound_off_8x2.md").read_text().startswith("# The floor under")


def test_a_cell_of_per_sample_gradient_stashes_counts_their_products(tmp_path) -> None:
    """At T = 64 every layer of the tiny model keeps its per-sample gradients: they are formed
    in the hooks (timed, > 0) and the clipped sums only scale them."""
    assert ob.main(["--quick", "--out", str(tmp_path), "--cell", "off:64:1", "--rounds", "1"]) == 0
    ms = {
        r["quantity"]: float(r["ms"])
        for r in common.read_csv(tmp_path / "overhead_bound_off_64x1.csv")
    }
    assert ms["per-sample gradients in the hooks (rc)"] > 0
    assert math.isclose(
        ms["bound"], ms["non_private step"] + sum(ms[c] for c in ob.COMPONENTS), rel_tol=1e-4
    )


def test_a_mixed_cell_is_refused(tmp_path) -> None:
    with pytest.raises(SystemExit, match="keep per-sample gradients and the others"):
        ob.main(["--quick", "--out", str(tmp_path), "--cell", "off:32:1", "--rounds", "1"])


def test_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        ob.main(["--help"])
    assert exit_info.value.code == 0
    assert "Opacus' Gaussian draw" in capsys.readouterr().out
