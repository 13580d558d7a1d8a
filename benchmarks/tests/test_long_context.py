"""``benchmarks/long_context.py``: the meta measurement equals the CPU one, the scalar-read
oracle answers what it can and refuses the rest, the mixed rule picks what fastDP picks, and the
quick run writes every cell (failures as such) and the floor rows."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from benchmarks import long_context as lc
from benchmarks.long_context import BenignScalarReads, MetaScalarReadError

pytestmark = pytest.mark.filterwarnings("ignore")
TINY = {"model": "tiny-llama", "layers": 1, "seed": 0, "k": 4}


def test_oracle_answers_the_healthy_branch_on_meta():
    x = torch.empty(3, 4, device="meta")
    with BenignScalarReads() as oracle:
        assert bool(torch.isfinite(x).all()) is True
        assert bool((~torch.isfinite(x)).any()) is False
        assert bool(torch.isnan(x).any() | torch.isinf(x).any()) is False
        assert bool((x > 1e30).any()) is False  # nothing flagged
        assert bool((x[:, -1] == 0).all()) is True  # every element passes
        assert bool(~torch.isfinite(x).all()) is False
        with pytest.raises(MetaScalarReadError, match="cannot be inferred"):
            (x > 0).sum().item()
        with pytest.raises(MetaScalarReadError):
            x.sum().item()
        # Real tensors are read as they are.
        assert bool(torch.tensor([1.0, float("nan")]).isfinite().all()) is False
    assert sum(oracle.answered.values()) == 6


def test_mixed_rule_thresholds():
    assert lc.mixed_rule_uses_ghost(32, 64, 64)  # 2 * 32^2 = 2048 <= 4096
    assert not lc.mixed_rule_uses_ghost(46, 64, 64)  # 4232 > 4096
    assert lc.mixed_rule_uses_ghost(32, 32, 64)  # the equality case: ghost (fastDP's <=)
    assert not lc.mixed_rule_uses_ghost(33, 32, 64)


@pytest.mark.parametrize(("T", "ghost"), [(32, "7/7"), (48, "3/7")])
def test_mixed_module_chooses_per_layer(T, ghost):
    # tiny Llama: q, o 64x64; k, v 32x64; MLP 128x64 (three). At T=32 all 7 per block are
    # ghost; at T=48 (2 T^2 = 4608) only the MLP's three (p d = 8192).
    rows = lc.measure_meta(
        {**TINY, "methods": ["opacus_ghost", "mixed_ghost"]}, "off", T, 1, log=lambda *_: None
    )
    ghost_row, mixed_row = rows
    assert mixed_row["status"] == "ok", mixed_row["status"]
    assert mixed_row["ghost_layers"] == ghost
    same = mixed_row["step_flops"] == ghost_row["step_flops"]
    assert same == (ghost == "7/7")


def test_meta_measurement_equals_cpu():
    cfg = {**TINY, "methods": list(lc.METHODS)}
    meta = lc.measure_meta(cfg, "off", 24, 2, log=lambda *_: None)
    cpu = lc.measure_meta(cfg, "off", 24, 2, log=lambda *_: None, device="cpu")
    for m, c in zip(meta, cpu, strict=True):
        assert m["status"] == c["status"] == "ok", (m["method"], m["status"], c["status"])
        assert m["step_flops"] == c["step_flops"], m["method"]
        assert m["step_extra_bytes"] == c["step_extra_bytes"], m["method"]
        assert m["persistent_bytes"] == c["persistent_bytes"]
    by = {r["method"]: r for r in meta}
    # Book-keeping skips the second backward: fewer FLOPs than the two-pass method.
    assert by["rc_bookkeeping"]["step_flops"] < by["rc_two_pass"]["step_flops"]
    assert by["non_private"]["step_flops"] < by["rc_bookkeeping"]["step_flops"]


def test_floors_fail_on_failed_cells():
    base = {"checkpointing": "reentrant", "T": 8, "B": 1}
    rows = [
        {**base, "method": "non_private", "status": "ok", "step_flops": 10, "peak_bytes": 100},
        {**base, "method": "rc_two_pass", "status": "ok", "step_flops": 15, "peak_bytes": 130},
        {**base, "method": "rc_bookkeeping", "status": "failed: RuntimeError: x"},
    ]
    lc.add_ratios(rows)
    cfg = {"floor": {"checkpointing": ["reentrant"], "T": 8, "B": 1, "memory": 1.2, "flops": 1.6}}
    out = {
        (c["requirement"].split()[0], c["requirement"].split()[1]): c for c in lc.floors(rows, cfg)
    }
    assert out[("rc_two_pass", "flops_ratio")]["passed"] is True  # 1.5 <= 1.6
    assert out[("rc_two_pass", "memory_ratio")]["passed"] is False  # 1.3 > 1.2
    failed = out[("rc_bookkeeping", "memory_ratio")]
    assert failed["passed"] is False and failed["value"] is None
    assert failed["status"].startswith("failed: RuntimeError")


def test_quick_run(tmp_path: Path):
    assert lc.main(["--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "long_context.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == lc.COLUMNS
        rows = list(reader)
    cfg = lc.common.load_profile("long_context", "quick")
    cells = {(r["checkpointing"], int(r["T"]), int(r["B"]), r["method"]) for r in rows}
    expected = {
        (c, T, B, m)
        for c in cfg["checkpointing"]
        for T in cfg["T"]
        for B in cfg["B"]
        for m in cfg["methods"]
    }
    assert cells == expected  # every cell present, failed or not
    for r in rows:
        assert r["status"] == "ok" or r["status"].startswith("failed: "), r["status"]
        if r["method"] == "non_private":
            assert r["status"] == "ok" and float(r["flops_ratio"]) == 1.0
    timed = [r for r in rows if r["time_status"]]
    assert {r["method"] for r in timed} == set(cfg["methods"])
    report = (tmp_path / "long_context.md").read_text()
    assert report.startswith("# Long-context whole-model DP fine-tuning")
    assert report.count("| rc_") >= 4 * len(cfg["floor"]["checkpointing"]) // 2
    assert (tmp_path / "long_context.png").stat().st_size > 10_000
