"""Issue 35, item 3 (``benchmarks/fsdp_regime.py``) at a tiny size: the counted FLOPs of the
randomized-clipping step equal the closed form, meta equals CPU, the tracker leaves the
gradients to FSDP2's sharded state, and the quick run writes ratios >= 1. No timing."""

from __future__ import annotations

import csv

import pytest
import torch
from torch import nn

from benchmarks import common, fsdp_regime

CFG = {"model": "tiny-llama", "k": 4, "seed": 0}


@pytest.fixture(scope="module")
def tiny_cells() -> dict[str, dict]:
    return {
        m: fsdp_regime.measure_cell(CFG, "off", 32, m) for m in ("non_private", "rc_bookkeeping")
    }


def test_rc_flops_equal_closed_form(tiny_cells):
    extra = tiny_cells["rc_bookkeeping"]["step_flops"] - tiny_cells["non_private"]["step_flops"]
    # 2 blocks of 7 Linears: q, k, v, o (p d = 4096, 2048, 2048, 4096 <= T (p + d) = 4096,
    # 3072, 3072, 4096) keep per-sample gradients, sketched from them (2Bpdk); gate, up, down
    # (8192 > 6144) keep A and G (2BTk(p + d)); the tied LM head 2BTk(V + d) and the tied
    # embedding 2BTkd; the 5 RMSNorms' clipped sums scale their one stashed per-sample
    # gradient in place (B = 1: no product).
    expected = (
        2 * (2 * 4 * (4096 + 2048 + 2048 + 4096) + 2 * 32 * 4 * (192 + 192 + 192))
        + 2 * 32 * 4 * 576
        + 2 * 32 * 4 * 64
    )
    assert fsdp_regime.closed_form_extra_flops("tiny-llama", T=32, k=4) == expected
    assert extra == expected


def test_meta_counts_equal_cpu(tiny_cells):
    cpu = fsdp_regime.measure_cell(CFG, "off", 32, "rc_bookkeeping", device="cpu")
    meta = tiny_cells["rc_bookkeeping"]
    assert cpu["step_flops"] == meta["step_flops"]
    # The probes are drawn on the CPU on meta (torch.Generator has no meta device): B p k
    # floats per layer counted twice there, so meta may only exceed CPU, and by little.
    assert cpu["local_peak_bytes"] <= meta["local_peak_bytes"] <= 1.1 * cpu["local_peak_bytes"]


def test_every_weight_trainable_and_unit_sizes():
    model = fsdp_regime.build_model("tiny-llama", T=32, device="meta", tied=True)
    sizes = fsdp_regime.unit_sizes(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.requires_grad for p in model.parameters())
    assert sizes["params"] == sizes["trainable"] == sum(p.numel() for p in model.parameters())
    # root: the tied 512 x 64 weight and the final norm; a block: 7 Linears and 2 norms.
    assert sizes["root"] == 512 * 64 + 64
    assert sizes["block"] == 64 * (64 + 32 + 32 + 64 + 3 * 128) + 2 * 64
    assert sizes["params"] == sizes["root"] + 2 * sizes["block"]


def test_tracker_shards_a_block_gradient_once_the_next_block_has_one():
    """Two "blocks" (Linears) and a root Linear: a block's gradient leaves the local peak once
    the next block's gradient appears; the root's gradient stays counted."""
    torch.manual_seed(0)
    root, b1, b0 = (nn.Linear(64, 64, bias=False, device="meta") for _ in range(3))
    x = torch.empty(1, 8, 64, device="meta")
    tracker = fsdp_regime.ShardableBytes([[b0.weight], [b1.weight]])
    grad = 64 * 64 * 4
    with tracker:
        tracker.set_phase("forward")
        out = root(b1(b0(x))).sum()
        tracker.set_phase("backward")
        out.backward()  # gradients appear in the order root, b1, b0
        # b1's: b0 is the current block (its gradient came last); the root is never sharded.
        assert tracker._sharded_gradients() == grad
        assert tracker.current_block == 0
        tracker.local_peak = 0
        assert tracker.after_loss_peak == 0  # the loss was never marked done
        tracker.mark_loss_done()
        big = torch.zeros(100_000, device="meta")
    assert tracker.local_peak == tracker.after_loss_peak == tracker.live - grad
    assert tracker.live >= big.numel() * 4 + 3 * grad


def test_per_rank_memory_shards_state():
    measured = {
        "params": 1000,
        "trainable": 1000,
        "root": 100,
        "root_trainable": 100,
        "block": 450,
        "block_trainable": 450,
        "local_peak_bytes": 7,
        "after_loss_peak_bytes": 5,
        "step_phase_bytes": 8000,
    }
    two = fsdp_regime.per_rank(measured, 2)
    four = fsdp_regime.per_rank(measured, 4)
    assert two["sharded_state_bytes"] == 16 * 1000 // 2 == 2 * four["sharded_state_bytes"]
    assert two["gathered_bytes"] == 4 * (100 + 2 * 450) == four["gathered_bytes"]
    assert two["peak_bytes_per_rank"] == two["sharded_state_bytes"] + two["gathered_bytes"] + 7
    assert two["after_loss_bytes_per_rank"] == two["peak_bytes_per_rank"] - 2
    # With a large step phase, the step is the peak: (4P + 8P_t) / W + step_phase / W.
    big = dict(measured, step_phase_bytes=100_000)
    assert fsdp_regime.per_rank(big, 2)["peak_bytes_per_rank"] == 12 * 1000 // 2 + 50_000


def test_quick_run_ratios(tmp_path):
    assert fsdp_regime.main(["--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "fsdp_regime.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == fsdp_regime.COLUMNS
        rows = list(reader)
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["method"] for r in ok} >= {"non_private", "rc_bookkeeping", "opacus_ghost"}
    for r in ok:
        assert float(r["flops_ratio"]) >= 1 and float(r["memory_ratio"]) >= 1, r
        if r["method"] == r["baseline"]:
            assert float(r["flops_ratio"]) == float(r["memory_ratio"]) == 1
    refused = [r for r in rows if r["status"] != "ok"]
    # Opacus ghost under checkpointing: the recomputed forward is refused as parameter tying.
    assert {(r["method"], r["checkpointing"]) for r in refused} == {
        ("opacus_ghost", "non-reentrant")
    }
    assert all("Parameter tying is not supported" in r["status"] for r in refused)
    rc = next(r for r in ok if r["method"] == "rc_bookkeeping" and r["checkpointing"] == "off")
    assert int(rc["flops_closed_form"]) == int(rc["step_flops"])
    text = (tmp_path / "fsdp_regime.md").read_text()
    assert text.startswith("# ") and "## Floor (issue 35)" in text
    assert common.read_csv(tmp_path / "fsdp_regime.csv") == rows
