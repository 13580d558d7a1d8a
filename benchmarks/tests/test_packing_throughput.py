"""``benchmarks/packing_throughput.py --quick``: every method trains the same tokens per step,
the DP methods reach the same epsilon, and the written report is consistent with its CSV (the
timing itself is not asserted: it is a benchmark)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from benchmarks import packing_throughput as bench  # noqa: E402


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0 and "usage" in capsys.readouterr().out


def test_records_are_ragged_real_passages() -> None:
    cfg = bench.PROFILES["full"]
    train, heldout = bench.make_records(cfg)
    lengths = [len(r["input_ids"]) for r in train]
    assert len(train) == cfg["n_train"] and len(heldout) == cfg["n_heldout"]
    assert min(lengths) >= cfg["min_len"] and max(lengths) <= cfg["max_length"]
    assert sum(x < 64 for x in lengths) > 0.25 * len(lengths)  # many short records
    assert sum(x > 512 for x in lengths) > 0.05 * len(lengths)  # a few long ones
    text = bytes(t - 1 for t in train[0]["input_ids"]).decode("utf-8", errors="replace")
    assert sum(c.isalpha() for c in text) > 0.5 * len(text)  # English text, not noise


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_quick_run(tmp_path: Path) -> None:
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "packing_throughput.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        header, rows = list(reader.fieldnames or []), list(reader)
    assert header == bench.COLUMNS
    assert sorted(r["method"] for r in rows) == sorted(bench.METHODS)
    # main() raises unless the methods trained the same tokens and the DP epsilons are equal.
    assert len({r["tokens"] for r in rows}) == 1
    eps = {float(r["epsilon"]) for r in rows if r["method"] in bench.DP_METHODS}
    assert len(eps) == 1 and 7.9 <= eps.pop() <= 8.0
    for r in rows:
        assert float(r["tokens_per_s"]) == pytest.approx(
            float(r["tokens"]) / float(r["steps_sum_s"]), rel=1e-4
        )
    by = {r["method"]: r for r in rows}
    # Packing takes fewer micro-batches than one row per record.
    assert int(by["packed"]["micro_batches"]) < int(by["padded"]["micro_batches"])
    report = (tmp_path / "packing_throughput.md").read_text()
    assert "uptime_load_average_after=" in report
    ratio = float(report.split("packed / padded tokens per second: ")[1].split("x")[0])
    step = lambda m: float(by[m]["steps_sum_s"])  # noqa: E731
    assert math.isclose(ratio, step("padded") / step("packed"), rel_tol=0.01)
