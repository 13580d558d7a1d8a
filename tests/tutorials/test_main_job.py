"""The main job, tutorials/long_document_classification.py, on the real model and real data.

``--smoke`` runs a few randomized-clipping steps of the packaged SmolLM2-135M on the vendored
Brown corpus at a short length (seconds of compute on two cores; slower on a loaded machine),
in a subprocess exactly as a user runs it, and the results table it writes with
``--output-json`` is checked field by field. The split of the model into a frozen bottom,
computed once per document, and a trainable top is checked to be exact.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "tutorials" / "long_document_classification.py"


def load_job():
    """The main job's script as a module (its functions, without running ``main``)."""
    spec = importlib.util.spec_from_file_location("long_document_classification", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_frozen_bottom_split_is_exact() -> None:
    """Top blocks on ``frozen_features`` == the whole (untruncated) body on the token ids."""
    job = load_job()
    args = job.parse_args(["--max-length", "32", "--num-layers", "3", "--trainable-layers", "1"])
    tokenizer = job.rc_models.load_smollm2_tokenizer()
    texts = [
        "The Fulton County Grand Jury said Friday an investigation of Atlanta's recent primary "
        "election produced no evidence that any irregularities took place, and the jury "
        "further said in term-end presentments that the City Executive Committee had over-all "
        "charge of the election.",
        "She closed the door and listened to the rain.",  # shorter than 32 tokens: padded
    ]
    data = job.rc_data.TokenizedDataset(texts, [0, 1], tokenizer, max_length=32)
    ids, mask = data.input_ids, data.attention_mask
    assert mask[0].all() and not mask[1].all()

    # Reference: embeddings, 3 blocks and the final norm, run directly on the token ids.
    full = job.load_body(args).eval()
    assert len(full.layers) == 3
    with torch.no_grad():
        hidden = full(input_ids=ids, attention_mask=mask).last_hidden_state
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    expected = (hidden * weights).sum(dim=1) / weights.sum(dim=1)

    # Split: the bottom (embeddings + 2 blocks) once, then the classifier on the top block.
    body = job.load_body(args)
    with job.frozen_bottom(body, args.num_layers - args.trainable_layers) as bottom:
        features = job.frozen_features(bottom, data, desc="", disable=True)
    assert features.shape == (2, 32, 576) and len(body.layers) == 3  # restored on exit
    model, counts = job.build_classifier(body, args, (features, mask))
    assert len(model.top.layers) == 1 and counts["trainable"] > 0
    model.eval()
    with torch.no_grad():
        pooled = model.pool(features, mask)
    torch.testing.assert_close(pooled, expected, atol=1e-4, rtol=1e-4)
