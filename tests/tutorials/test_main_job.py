"""The main job, tutorials/long_document_classification.py, on the real model and real data.

``--smoke`` runs a few randomized-clipping steps of the packaged SmolLM2-135M on the vendored
Brown corpus at a short length (seconds of compute on two cores; slower on a loaded machine),
in a subprocess exactly as a user runs it, and the results table it writes with
``--output-json`` is checked field by field.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tutorials" / "long_document_classification.py"


def run_job(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_help() -> None:
    proc = run_job("--help", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for option in (
        "--clipping",
        "--sketch",
        "--sketch-dim",
        "--epsilon",
        "--max-length",
        "--epochs",
        "--batch-size",
        "--lr",
        "--trainable-layers",
        "--dataset",
        "--seed",
        "--smoke",
        "--output-json",
    ):
        assert option in proc.stdout, option
    assert "{randomized,ghost,none}" in proc.stdout and "{brown,spam}" in proc.stdout


@pytest.mark.slow
def test_smoke_run_results_table(tmp_path) -> None:
    out = tmp_path / "results.json"
    proc = run_job("--smoke", "--no-progress", "--output-json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())

    # What ran: randomized clipping (Hutchinson, k = 32) on Brown, as the default run.
    assert (r["dataset"], r["clipping"], r["sketch"], r["sketch_dim"]) == (
        "brown",
        "randomized",
        "hutchinson",
        32,
    )
    assert r["smoke"] is True and r["steps"] > 0 and r["train_docs"] > 0 and r["test_docs"] > 0
    # Training: finite losses.
    assert math.isfinite(r["first_loss"]) and math.isfinite(r["final_loss"])
    # Privacy: a real noise multiplier, epsilon spent in (0, target].
    assert r["noise_multiplier"] > 0 and math.isfinite(r["noise_multiplier"])
    assert 0 < r["epsilon"] <= r["target_epsilon"] == 8.0 and r["delta"] == 1e-5
    # Evaluation and costs.
    assert 0.0 <= r["test_accuracy"] <= 1.0 and 0.5 <= r["majority_baseline"] <= 1.0
    assert r["wall_time_s"] > 0 and r["peak_memory_gib"] > 0
    # The table is printed too.
    for row in ("test accuracy", "majority-class baseline", "noise multiplier", "peak memory"):
        assert row in proc.stdout
