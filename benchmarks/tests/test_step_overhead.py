"""``benchmarks/step_overhead.py`` (issue 34): the quick profile writes every cell with its
FLOPs ratio, per-step counts and the attribution table; the counters count what they claim."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import common
from benchmarks import step_overhead as so

pytestmark = pytest.mark.filterwarnings("ignore")


def test_op_counter_and_python_call_counter_count_what_runs() -> None:
    with so.OpCounter() as ops:
        (torch.ones(3) * 2).sum()
    assert ops.total == 3 and ops.counts["mul"] == 1

    from opacus_rc.sketching import sample_absmax

    calls = so.count_python_calls(lambda: sample_absmax(torch.ones(2, 3)), ("opacus_rc", "torch"))
    assert calls["opacus_rc"] == 1


def test_quick_run_writes_every_cell(tmp_path) -> None:
    assert so.main(["--quick", "--out", str(tmp_path), "--checkpointing", "off"]) == 0
    cfg = common.load_profile(so.NAME, "quick")
    rows = common.read_csv(tmp_path / "step_overhead.csv")
    assert list(rows[0]) == so.COLUMNS
    cells = {(r["checkpointing"], int(r["T"]), int(r["B"])) for r in rows}
    assert cells == {("off", T, B) for T in cfg["T"] for B in cfg["B"]}
    for cell in cells:
        methods = [
            r["method"] for r in rows if (r["checkpointing"], int(r["T"]), int(r["B"])) == cell
        ]
        assert methods == cfg["methods"]
    by = {(r["T"], r["B"], r["method"]): r for r in rows}
    for B in cfg["B"]:
        for method in ("non_private", "rc_bookkeeping", "opacus_hooks"):
            r = by[(str(cfg["T"][0]), str(B), method)]
            assert r["status"] == "ok", r["status"]
            assert float(r["flops_ratio"]) >= 1.0
            assert float(r["time_median_s"]) > 0 and int(r["rounds"]) == cfg["rounds"]
            assert int(r["aten_ops"]) > 0 and float(r["time_ratio"]) > 0
            assert int(r["torch_calls"]) > 0
            assert (int(r["package_calls"]) > 0) == (method != "non_private")
            assert r["load_before"] and r["load_after"]
            # Kernel time is part of the step's CPU time in every round, so its median is too.
            assert int(r["page_faults"]) >= 0
            assert 0 <= float(r["system_median_s"]) <= float(r["cpu_median_s"])
        # the private step dispatches more ops than the non-private one
        rc, base = (
            by[(str(cfg["T"][0]), str(B), "rc_bookkeeping")],
            by[(str(cfg["T"][0]), str(B), "non_private")],
        )
        assert int(rc["aten_ops"]) > int(base["aten_ops"])
    att = common.read_csv(tmp_path / "step_overhead_attribution.csv")
    assert list(att[0]) == so.ATTRIBUTION_COLUMNS
    names = [r["name"] for r in att]
    assert names[-2:] == ["untracked", "total (profiled wall)"]
    assert any(r["site"].startswith("opacus_rc/") for r in att)  # rc-only rows name a function
    total = att[-1]
    assert math.isclose(
        float(total["delta_ms"]), float(total["rc_ms"]) - float(total["np_ms"]), rel_tol=1e-3
    )
    text = (tmp_path / "step_overhead.md").read_text()
    for heading in (
        "## Step time",
        "## The issue's floors",
        "## Attribution",
        "max-abs",
        "LlamaRMSNorm",
    ):
        assert heading in text
    assert "uptime_load_average_at_start" in text


def test_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        so.main(["--help"])
    assert exit_.value.code == 0
    assert "--baseline-csv" in capsys.readouterr().out
