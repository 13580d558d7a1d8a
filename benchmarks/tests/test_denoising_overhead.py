"""``benchmarks/denoising_overhead.py --quick``: it runs on a tiny random Llama and writes both
CSV files and the Markdown report with values that are consistent with each other."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from benchmarks import denoising_overhead as bench  # noqa: E402


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


@pytest.mark.filterwarnings("ignore:.*non-full backward hook")
def test_quick_run(tmp_path: Path) -> None:
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0

    header, overhead = _read(tmp_path / "denoising_overhead.csv")
    assert header == bench.OVERHEAD_COLUMNS
    assert [r["setting"] for r in overhead] == ["lora_qv", "full_exact"]
    for row in overhead:
        step, den = float(row["step_time_median_s"]), float(row["denoise_time_median_s"])
        # The denoiser runs inside the step: 0 < its time < the step's time.
        assert 0 < den < step
        assert float(row["overhead_fraction"]) == pytest.approx(den / step, rel=1e-4)
        frozen = float(row["frozen_forward_per_batch_s"])
        assert float(row["overhead_fraction_uncached"]) == pytest.approx(
            den / (step + frozen), rel=1e-4
        )
    # LoRA r = 8 on q and v of one block: A (8, 64) twice, B (64, 8) and (32, 8); the whole
    # block: 7 weight matrices of the tiny Llama (hidden 64, MLP 128, 2 KV heads of 16).
    assert [int(r["matrices"]) for r in overhead] == [4, 7]
    assert overhead[1]["largest_matrix"] in ("128x64", "64x128")

    header, steps = _read(tmp_path / "denoising_steps_to_target.csv")
    assert header == bench.STEPS_COLUMNS
    assert [(r["seed"], r["denoise"]) for r in steps] == [
        (str(s), d) for s in (0, 1, 2) for d in ("none", "spectral")
    ]
    for seed in ("0", "1", "2"):
        eps = {r["epsilon"] for r in steps if r["seed"] == seed}
        assert len(eps) == 1 and math.isfinite(float(eps.pop()))  # post-processing
    for row in steps:
        assert float(row["best_loss"]) <= float(row["final_loss"]) + 1e-12
        if row["steps_to_target"]:
            assert 0 <= int(row["steps_to_target"]) <= int(row["steps"])
        if row["denoise"] == "none":
            assert row["denoised_fraction"] == ""
        else:
            assert 0.0 <= float(row["denoised_fraction"]) <= 1.0

    report = (tmp_path / "denoising_overhead.md").read_text()
    assert report.startswith("# Spectral denoising: overhead per step")
    assert "| lora_qv |" in report and "| spectral |" in report
