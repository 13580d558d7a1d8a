"""``benchmarks/unit_cost.py`` (issue 23, item 5): the three per-unit norms against a float64
oracle of the unit's summed gradient, their FLOP counts against the closed forms (slopes 1 and 2
in tokens), the meta step with ``units=`` against the same step on real tensors, the value
shadows of the scalar-read oracle, and the quick run's files and floor rows."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks import long_context as lc
from benchmarks import norm_methods as nm
from benchmarks import unit_cost as uc

pytestmark = pytest.mark.filterwarnings("ignore")
TINY = {"model": "tiny-llama", "layers": 1, "seed": 0, "k": 4}


def test_unit_norms_against_float64_oracle():
    gen = torch.Generator().manual_seed(0)
    m, T, d, p = 3, 5, 6, 4
    layer = nn.Linear(d, p, bias=False).double()
    A = torch.randn(m, T, d, generator=gen, dtype=torch.float64)
    G = torch.randn(m, T, p, generator=gen, dtype=torch.float64)
    # The unit's summed gradient, window by window: sum_j G_j^T A_j (p x d).
    oracle = sum(G[j].T @ A[j] for j in range(m)).norm()
    for name in ("ghost_unit", "per_sample_unit"):
        got = nm.get_unit_method(name)(layer, A, G)[layer.weight]
        assert got.shape == (1,)
        torch.testing.assert_close(got.double()[0], oracle, rtol=1e-6, atol=0)
    # The sketch: E[n_hat^2] = ||grad||^2; at k = 4096 its relative std is at most
    # sqrt(2 / k) = 0.022 in the squared norm (docs/privacy/estimators.md), so 0.011 in the
    # norm; 5 sigma = 0.055.
    k = 4096
    est = nm.get_unit_method("rc_unit")(layer, A, G, k=k, generator=gen)[layer.weight]
    assert abs(float(est[0]) / float(oracle) - 1) < 5 * math.sqrt(2 / k) / 2
    with pytest.raises(ValueError, match="unknown unit norm method"):
        nm.get_unit_method("hooks")


@pytest.mark.parametrize("method", nm.UNIT_METHODS)
def test_unit_flops_equal_closed_form_and_grow_as_expected(method):
    counts = []
    for m in (1, 2, 4):
        flops, _ = uc.measure_norm(method, m=m, T=16, d=12, p=20, k=4)
        assert flops == nm.unit_closed_form_flops(method, m=m, T=16, d=12, p=20, k=4)
        counts.append(flops)
    slope = math.log(counts[2] / counts[1]) / math.log(2)
    assert slope == pytest.approx(2.0 if method == "ghost_unit" else 1.0, abs=1e-9)


def test_shadows_give_values_of_small_integer_meta_tensors():
    units = torch.tensor([0, 0, 1, 2, 2, 2])
    with lc.BenignScalarReads():
        x = units.to("meta")
        assert int(x.max()) == 2 and int(x.min()) == 0
        counts = torch.bincount(x, minlength=3)  # no meta kernel: computed on the shadow
        assert counts.is_meta and counts.shape == (3,)
        assert counts.cpu().tolist() == [2, 1, 3]
        assert bool((counts == 0).any()) is False
        r = torch.arange(6, device="meta")
        assert bool((x * 0 + r == r).all()) is True
        slot = torch.empty_like(x)
        slot[torch.tensor([1, 0]).to("meta")] = torch.tensor([7, 8]).to("meta")
        slot.zero_()  # a mutating op on the shadow too
        assert int(slot.sum()) == 0
        with pytest.raises(lc.MetaScalarReadError):  # floats are never shadowed
            torch.ones(2).to("meta").sum().item()


def test_unit_step_on_meta_equals_cpu():
    cfg = dict(TINY)
    out = {}
    for device in ("meta", "cpu"):
        model, ids = lc.build_base(cfg, 16, 3, torch.device(device))
        units = torch.tensor([0, 0, 1])
        method = lc.LMMethod("rc_bookkeeping", model, ids, cfg, "non-reentrant", units=units)
        out[device] = lc.measure_step(method, torch.device(device))
        assert method.model.per_sample_gradient_norms.shape == (2,)  # one norm per unit
    assert out["meta"]["step_flops"] == out["cpu"]["step_flops"]
    # The unit layout's few (B,)-sized integer tensors are made on the CPU shadows and copied
    # to meta there, so their bytes may be counted differently (tens of bytes here, against
    # hundreds of KiB of activations): equal within 1 KiB.
    assert abs(out["meta"]["step_extra_bytes"] - out["cpu"]["step_extra_bytes"]) <= 1024


def test_floors_fail_on_failed_cells():
    cfg = {"floor": {"windows": 2, "flops": 1.05, "memory": 1.1}, "step_checkpointing": ["x"]}
    cfg["window"] = 8
    rows = [
        {"part": "step", "checkpointing": "x", "method": "rc_unit_bookkeeping", "status": "failed"}
    ]
    crit = uc.floors(rows, cfg)
    assert [c["passed"] for c in crit] == [False, False]
    rows[0].update(status="ok", flops_ratio=1.04, memory_ratio=1.2)
    assert [c["passed"] for c in uc.floors(rows, cfg)] == [True, False]


def test_quick_run(tmp_path: Path):
    assert uc.main(["--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "unit_cost.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == uc.COLUMNS
        rows = list(reader)
    cfg = uc.common.load_profile("unit_cost", "quick")
    norm = [r for r in rows if r["part"] == "norm"]
    assert len(norm) == len(cfg["windows"]) * len(nm.UNIT_METHODS)
    assert all(r["status"] == "ok" for r in norm)  # every count equals its closed form
    steps = {r["method"]: r for r in rows if r["part"] == "step"}
    assert set(steps) == set(cfg["step_methods"])
    assert all(r["status"] == "ok" for r in steps.values()), steps
    assert float(steps["non_private"]["flops_ratio"]) == 1.0
    report = (tmp_path / "unit_cost.md").read_text()
    assert report.startswith("# Per-unit norm cost")
    assert report.count("| unit-level step") == 2 * len(cfg["step_checkpointing"])
    assert (tmp_path / "unit_cost.png").stat().st_size > 10_000
