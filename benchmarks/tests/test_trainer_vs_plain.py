"""``benchmarks/trainer_vs_plain.py --quick``: the DP trainer and the plain Trainer train on
the same Poisson logical batches (every step, the same example counts), every step is timed,
and the report's ratios are those of its CSV (the timing itself is not asserted: it is a
benchmark)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from benchmarks import trainer_vs_plain as bench  # noqa: E402


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_quick_run(tmp_path: Path) -> None:
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "trainer_vs_plain.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        header, rows = list(reader.fieldnames or []), list(reader)
    cfg = bench.PROFILES["quick"]
    assert header == bench.COLUMNS and len(rows) == cfg["pairs"]
    for row in rows:
        assert row["same_batches"] == "True"
        sizes = [int(n) for n in row["examples_per_step"].split()]
        assert len(sizes) == cfg["steps"] and all(n > 0 for n in sizes)
        dp, plain = float(row["dp_steps_s"]), float(row["plain_steps_s"])
        assert dp > 0 and plain > 0
        assert float(row["ratio"]) == pytest.approx(dp / plain, rel=1e-4)
    text = (tmp_path / "trainer_vs_plain.md").read_text()
    assert "Ratio (median over pairs)" in text and "floor <= 1.15x" in text
