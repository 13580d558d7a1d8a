"""A tiny tied Llama under FSDP2, every weight trainable: 2 CPU processes, gloo
(tests/distributed/fsdp_llama_worker.py; the worker asserts inside each rank, rank 0 writes the
numbers checked here).

The input embedding tied to the LM head (owned by the root's FSDP2 group), the RMSNorm weights
and every Linear trainable, each decoder layer ``fully_shard``-ed, sigma = 0: each rank's
per-sample norms equal one process's on its samples with the same probes, the RMSNorm norms
equal the float64 oracle's, and the update equals ``theta_0 - lr sum_i c_i g_i / B`` over the
global batch with each sample's gradient computed alone in float64; with book-keeping and two
passes, and under activation checkpointing (``torch.utils.checkpoint`` non-reentrant and HF's
``gradient_checkpointing_enable``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("fsdp_llama_worker.py")


def run_worker(tmp_path: Path) -> dict:
    out = tmp_path / "fsdp_llama.json"
    root = str(Path(__file__).resolve().parents[2])  # the checkout under test
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    env.pop("FSDP_LLAMA_ONLY", None)
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_two_process_gloo_fsdp2_tied_llama(tmp_path: Path) -> None:
    res = run_worker(tmp_path)
    for key in ("tied_bk", "tied_two_pass", "tied_ckpt_torch", "tied_ckpt_hf"):
        r = res[key]
        assert r["norms_vs_single_process"] < 1e-5, (key, r)
        assert r["rmsnorm_vs_oracle"] < 1e-5, (key, r)
        assert r["update_vs_oracle"] < 2e-6 and r["max_update"] > 1e-3, (key, r)
        assert r["clipped_samples"] >= 4, (key, r)
