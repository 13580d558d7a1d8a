"""``benchmarks/trainer_overhead.py --quick``: the DPTrainer and the hand-written loop train on
the same Poisson batches, their epsilons are equal and equal to what
``make_private_with_epsilon`` gives for the same schedule, and the written report is
consistent with its CSV (the timing itself is not asserted: it is a benchmark)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from benchmarks import trainer_overhead as bench  # noqa: E402


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0 and "usage" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_quick_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "trainer_overhead.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        header, rows = list(reader.fieldnames or []), list(reader)
    assert header == bench.COLUMNS and len(rows) == bench.PROFILES["quick"]["pairs"]
    for row in rows:
        t, lp = float(row["trainer_steps_sum_s"]), float(row["loop_steps_sum_s"])
        assert float(row["ratio"]) == pytest.approx(t / lp, rel=1e-4)
        c, lc = float(row["trainer_cpu_sum_s"]), float(row["loop_cpu_sum_s"])
        assert float(row["ratio_cpu"]) == pytest.approx(c / lc, rel=1e-4)
        assert c > 0 and lc > 0
    printed = capsys.readouterr().out
    # main() raises unless both paths collated the same examples and recorded the same history;
    # the printed epsilons are the trainer's and the loop engine's.
    line = next(x for x in printed.splitlines() if x.startswith("DPTrainer / hand-written"))
    eps_trainer, eps_loop = (float(x.split()[0]) for x in line.split("epsilon ")[1].split(" = "))
    assert eps_trainer == eps_loop and 7.99 <= eps_trainer <= 8.0
    report = (tmp_path / "trainer_overhead.md").read_text()
    assert "(equal: True)" in report and "uptime_load_average_after=" in report
    # make_private_with_epsilon for the same target and schedule finds the same noise.
    sigma = float(report.split("noise multiplier ")[1].split(",")[0])
    search = float(report.split("same target and schedule: noise multiplier ")[1].split(",")[0])
    assert math.isclose(sigma, search, rel_tol=1e-6)
