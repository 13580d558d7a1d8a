"""Unit-level (document/user-level) randomized clipping under DDP: 2 CPU processes, gloo
(tests/distributed/units_worker.py; issue 23, item 1's distributed path).

One spawn runs every scenario; the worker asserts inside each rank (tolerances derived in its
docstring) and rank 0 writes the numbers checked here:

* DPDDP and torch DDP, module and optimizer by hand, sigma = 0, 2 steps: with one seed on both
  ranks the ranks' units partition the single-process loader's batch, each unit on rank
  ``u % 2``; the update equals a float64 oracle's per-unit clipped sum over both ranks' units
  divided by the global expected number of units; the sketched norms at k = 4096 match the
  exact norms of the units' summed gradients (and not the per-sequence norms);
* PrivacyEngine with DPDDP and DistributedUnitDataLoader: the loader used as it is, the
  per-rank divisor ``int(N_units q) / 2``, one accountant step per step at the unit rate; at
  sigma = 0 the oracle's update, at sigma = 1 noise of sd sigma C (drawn once, not per rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("units_worker.py")


def test_two_process_gloo_unit_level_clipping(tmp_path: Path) -> None:
    out = tmp_path / "units.json"
    root = str(Path(__file__).resolve().parents[2])  # the checkout under test
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    for key in ("raw_dpddp", "raw_ddp"):
        steps = res[key]["steps"]
        assert len(steps) == 2
        for step in steps:
            assert step["max_abs_diff"] < 1e-5
            assert step["norm_rel_err"] < 0.06 < step["naive_rel_gap"]
            assert step["clipped_units"] >= 2
            assert len(step["units"]) == len(set(step["units"]))  # each unit once
    assert res["engine_sigma0"]["max_abs_diff"] < 1e-5
    assert res["engine_sigma0"]["expected_batch_size"] == 2.0  # int(8 * 0.5) / 2 ranks
    assert res["engine_sigma0"]["accountant_steps"] == 2
    assert abs(res["engine_sigma1"]["noise_sd_over_sigma_C"] - 1.0) < 0.15
