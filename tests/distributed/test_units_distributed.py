"""Unit-level (document/user-level) randomized clipping under DDP and FSDP2: 2 CPU processes,
gloo (tests/distributed/units_worker.py; issue 23, item 1's distributed paths).

One spawn per wrapper runs its scenarios; the worker asserts inside each rank (tolerances
derived in its docstring) and rank 0 writes the numbers checked here:

* module and optimizer by hand, sigma = 0, 2 steps (DPDDP, torch DDP and DPDDP with activation
  checkpointing; FSDP2 with book-keeping and with two passes): with one seed on both ranks the
  ranks' units partition the single-process loader's batch, each unit on rank ``u % 2``; the
  update equals a float64 oracle's per-unit clipped sum over both ranks' units divided by the
  global expected number of units; the sketched norms at k = 4096 match the exact norms of the
  units' summed gradients (and not the per-sequence norms); then a cut unit (``unit_split=``)
  is refused (not implemented under DDP/FSDP2);
* PrivacyEngine with DistributedUnitDataLoader (DPDDP; FSDP2): the loader used as it is, the
  per-rank divisor ``int(N_units q) / 2``, one accountant step per step at the unit rate; at
  sigma = 0 the oracle's update, at sigma = 1 noise of sd sigma C (drawn once, not per rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("units_worker.py")
RTOL = 0.06  # the worker's norm tolerance


def spawn(out: Path, which: str, *, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    root = str(Path(__file__).resolve().parents[2])  # the checkout under test
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, str(WORKER), str(out), which],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=out.parent,
    )


def run_worker(tmp_path: Path, which: str) -> dict[str, Any]:
    out = tmp_path / f"units_{which}.json"
    proc = spawn(out, which)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def check(res: dict[str, Any], raw: tuple[str, ...]) -> None:
    for key in raw:
        steps = res[key]["steps"]
        assert len(steps) == 2
        for step in steps:
            assert step["max_abs_diff"] < 1e-5
            assert step["norm_rel_err"] < RTOL < step["naive_rel_gap"]
            assert step["clipped_units"] >= 2
            assert len(step["units"]) == len(set(step["units"]))  # each unit once
        assert res[key]["split_refused"] is True  # a cut unit: not under DDP/FSDP2
    assert res["engine_sigma0"]["max_abs_diff"] < 1e-5
    assert res["engine_sigma0"]["expected_batch_size"] == 2.0  # int(8 * 0.5) / 2 ranks
    assert res["engine_sigma0"]["accountant_steps"] == 2
    assert abs(res["engine_sigma1"]["noise_sd_over_sigma_C"] - 1.0) < 0.15


def test_two_process_gloo_unit_level_clipping_ddp(tmp_path: Path) -> None:
    check(run_worker(tmp_path, "ddp"), ("raw_dpddp", "raw_ddp", "raw_dpddp_checkpointed"))


def test_two_process_gloo_unit_level_clipping_fsdp2(tmp_path: Path) -> None:
    check(run_worker(tmp_path, "fsdp"), ("raw_fsdp_bk", "raw_fsdp_two_pass"))


def test_worker_refuses_an_unknown_scenario(tmp_path: Path) -> None:
    """The worker's scenario choice is a closed set: a typo exits non-zero before spawning
    (it must not silently run the FSDP2 scenarios, or nothing)."""
    proc = spawn(tmp_path / "x.json", "fsdp2", timeout=60)
    assert proc.returncode != 0 and "usage" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "x.json").exists()
