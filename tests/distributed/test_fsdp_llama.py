"""A tiny tied Llama under FSDP2, every weight trainable: 2 CPU processes, gloo
(tests/distributed/fsdp_llama_worker.py; the worker asserts inside each rank, rank 0 writes the
numbers checked here).

The input embedding tied to the LM head (owned by the root's FSDP2 group), the RMSNorm weights
and every Linear trainable, each decoder layer ``fully_shard``-ed, sigma = 0: each rank's
per-sample norms equal one process's on its samples with the same probes, the RMSNorm norms
equal the float64 oracle's, and the update equals ``theta_0 - lr sum_i c_i g_i / B`` over the
global batch with each sample's gradient computed alone in float64; with book-keeping and two
passes, and under activation checkpointing (``torch.utils.checkpoint`` non-reentrant and HF's
``gradient_checkpointing_enable``, also reentrant); with every module with parameters in a
group of its own (``fully_shard([embed, lm_head])`` for the tied weight); and with peft LoRA
adapters (the base and the tied weight frozen); and an ``nn.LayerNorm`` net with biases (the
LayerNorm's exact norms against the oracle), in the root's group or under ``FSDP2Wrapper``.
What is still refused has its message checked: no root group, a trainable parameter no group
manages, a weight tied other than embedding / head.
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


CASES = (
    "tied_bk",
    "tied_two_pass",
    "tied_ckpt_torch",
    "tied_ckpt_hf",
    "tied_ckpt_hf_reentrant",
    "tied_own_groups",
    "tied_own_groups_ckpt",
    "lora",
    "layernorm_root",
    "layernorm_wrapper",
)
BIASES = {"lora": 0, "layernorm_root": 3, "layernorm_wrapper": 3}  # else 14


def test_two_process_gloo_fsdp2_tied_llama(tmp_path: Path) -> None:
    res = run_worker(tmp_path)
    for key in CASES:
        r = res[key]
        assert r["norms_vs_single_process"] < 1e-5, (key, r)
        assert r["norm_layers_vs_oracle"] < 1e-5, (key, r)
        assert r["update_vs_oracle"] < 2e-6 and r["max_update"] > 1e-3, (key, r)
        assert r["clipped_samples"] >= 4, (key, r)
        # checkpointed book-keeping steps keep the smaller stash (exact norms where smaller)
        assert r["smaller_stash"] is ("ckpt" in key), (key, r)
        assert r["biases"] == BIASES.get(key, 14), (key, r)
    refusals = res["refusals"]
    assert "not fully_shard-ed at its root" in refusals["no_root"]
    assert "no FSDP2 group manages" in refusals["ignored"]
    assert "tied between modules 'a' (FSDPLinear), 'b' (FSDPLinear)" in refusals["tied_two_linears"]
    assert set(res["use_outside"]) == {"bookkeeping", "two_pass"}
    for mode, message in res["use_outside"].items():  # refused in both modes, named
        assert "['lin2.weight'] are used outside the forward" in message, (mode, message)
    # an empty batch the model cannot take: FSDP2's one way out, not noise_only_step()
    assert "Under FSDP2" in res["empty_batch"] and "noise_only_step" not in res["empty_batch"]
