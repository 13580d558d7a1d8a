"""The measurement helpers: live-tensor-bytes tracker, memory skips, floors, config, ratios."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from benchmarks import common, layer_norm_cost, training_step
from benchmarks.common import LiveTensorBytes, load_profile, peak_extra_bytes
from benchmarks.norm_methods import get_method


def test_tracker_counts_new_storages_once_and_frees():
    x = torch.ones(100)
    with LiveTensorBytes() as mem:
        a = torch.empty(1000)  # 4000 bytes
        v = a.view(10, 100)  # a view: no new storage
        _ = x.view(10, 10)  # view of a pre-existing tensor: free
        b = a + 1  # another 4000
        del a, v
        c = b * 2  # a is still alive? no: a and v were the only references
    assert mem.peak == 8000
    assert mem.live == 8000  # b and c
    del b, c


def test_tracker_peak_sees_freed_temporaries():
    with LiveTensorBytes() as mem:
        t = torch.empty(256)  # 1 KiB
        del t
        u = torch.empty(128)  # 512 B
    assert mem.peak == 1024
    assert mem.live == 512
    del u


@pytest.mark.parametrize("method", ["ghost", "fgc"])
def test_meta_and_real_measurements_agree(method):
    B, T, d, p = 2, 24, 16, 12
    fn = get_method(method)
    results = []
    for device in ("cpu", "meta"):
        layer = nn.Linear(d, p, device=device)
        A = torch.randn(B, T, d, device=device)
        G = torch.randn(B, T, p, device=device)
        _, flops = common.count_flops(lambda: fn(layer, A, G))  # noqa: B023
        mem, source = peak_extra_bytes(lambda: fn(layer, A, G), torch.device(device))  # noqa: B023
        assert source == "dispatch-tracker"
        results.append((flops, mem))
    assert results[0] == results[1]


def test_ghost_memory_is_the_gram_matrices():
    # Two B x T x T Grams, their product, and the bias branch's second G G^T (fp32).
    B, T, d = 2, 64, 8
    flops, mem = layer_norm_cost._measure_meta("ghost", B, T, d, d, bias=True)
    assert 2 * 4 * B * T * T <= mem <= 4 * 4 * B * T * T + 1024


def _tiny_cfg(**overrides):
    cfg = load_profile("layer_norm_cost", "quick")
    cfg.update(d=[16], T=[8, 32], k=[4], repeats=1, warmup=0)
    cfg.update(overrides)
    return cfg


def test_configurations_that_do_not_fit_are_marked_not_dropped():
    # Inputs at T=32: 2*32*32*4 = 8 KiB; ghost's Grams another ~24 KiB: over 16 KiB.
    cfg = _tiny_cfg(memory_budget_gib=16 * 1024 / common.GiB)
    rows = layer_norm_cost.run(cfg, torch.device("cpu"), log=lambda *_: None)
    ghost = {r["T"]: r for r in rows if r["method"] == "ghost"}
    assert ghost[8]["status"] == "ok"
    assert ghost[32]["status"].startswith("skipped: would need")
    assert ghost[32]["flops"] == ghost[32]["flops_closed_form"]  # still reported
    assert ghost[32]["peak_extra_bytes"] > 0
    assert len(rows) == 2 * 5  # ghost, fgc, mixed, hutchinson, hutch++ for each T
    by = {(r["method"], r["T"]): r for r in rows}
    # 2 T^2 = 2048 > p d = 256 at T=32: the mixed rule materializes (and so it fits).
    assert by[("mixed", 32)]["flops"] == by[("fgc", 32)]["flops"] < ghost[32]["flops"]
    assert by[("mixed", 32)]["status"] == "ok"
    # 2 T^2 = 128 <= 256 at T=8: ghost.
    assert by[("mixed", 8)]["flops"] == ghost[8]["flops"]


def test_untimed_run_and_floor_check():
    cfg = _tiny_cfg(T=[32], methods=["ghost", "fgc", "hutchinson"])
    rows = layer_norm_cost.run(cfg, torch.device("cpu"), timed=False, log=lambda *_: None)
    assert all(r["status"] == "not timed (--no-time)" for r in rows)
    assert all(r["flops"] == r["flops_closed_form"] for r in rows)
    floors = layer_norm_cost.check_floors(
        rows,
        [
            {
                "metric": "flops",
                "method": "hutchinson",
                "baseline": "ghost",
                "where": {"T": 32, "d": 16, "k": 4},
                "max_ratio": 0.5,
            },
            {
                "metric": "flops",
                "method": "hutchinson",
                "baseline": "ghost",
                "where": {"T": 32, "d": 16, "k": 4},
                "max_ratio": 0.001,
            },
            {
                "metric": "flops",
                "method": "hutchinson",
                "baseline": "ghost",
                "where": {"T": 999, "d": 16, "k": 4},
                "max_ratio": 0.5,
            },
        ],
    )
    assert [f["passed"] for f in floors] == [True, False, None]
    expected = (2 * 2 * 32 * 4 * 32) / (
        2 * 2 * 32 * 32 * 32 + 2 * 2 * 32 * 32 + 2 * 2 * 32 * 32 * 16
    )
    assert floors[0]["ratio"] == pytest.approx(expected)


def test_profiles_merge_over_full(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"s": {"full": {"a": 1, "b": 2}, "quick": {"b": 3}}}))
    assert load_profile("s", "quick", path) == {"a": 1, "b": 3, "profile": "quick"}
    assert load_profile("s", "full", path) == {"a": 1, "b": 2, "profile": "full"}
    with pytest.raises(KeyError, match="no profile 'gpu'"):
        load_profile("s", "gpu", path)


def test_every_section_has_all_profiles():
    config = json.loads(common.CONFIG_PATH.read_text())
    for name in ("layer_norm_cost", "estimate_quality", "training_step", "privacy_cost"):
        assert set(config[name]) == set(common.PROFILES), name


def test_training_ratios_and_criteria():
    rows = [
        {
            "T": 1024,
            "method": "non_private",
            "status": "ok",
            "time_median_s": 1.0,
            "peak_bytes": 100,
            "prefix_forward_s": 3.0,
        },
        {
            "T": 1024,
            "method": "opacus_ghost",
            "status": "ok",
            "time_median_s": 3.0,
            "peak_bytes": 150,
            "prefix_forward_s": 3.0,
        },
        {
            "T": 1024,
            "method": "rc_hutchinson",
            "status": "ok",
            "time_median_s": 1.5,
            "peak_bytes": 120,
            "prefix_forward_s": 3.0,
        },
        {"T": 1024, "method": "opacus_hooks", "status": "skipped: would need 9.0 GiB"},
    ]
    training_step.add_ratios(rows)
    assert rows[2]["time_ratio"] == 1.5
    assert rows[2]["full_step_ratio"] == pytest.approx(4.5 / 4.0)
    assert rows[2]["memory_ratio"] == 1.2
    assert "time_ratio" not in rows[3]
    cfg = {"T": [1024], "faster_than_ghost_from_T": 1024, "within_T": 1024, "within_ratio": 1.3}
    crit = {c["requirement"]: c["passed"] for c in training_step.criteria(rows, cfg)}
    assert crit["rc_hutchinson faster than opacus_ghost at T=1024"] is True
    assert crit["rc_hutchinson time_ratio vs non_private at T=1024"] is False
    assert crit["rc_hutchinson full_step_ratio vs non_private at T=1024"] is True
