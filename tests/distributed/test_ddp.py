"""Randomized clipping under torch.distributed: 2 CPU processes, gloo
(tests/distributed/ddp_worker.py).

One spawn runs every scenario (process start-up dominates the cost); the worker asserts inside
each rank and rank 0 writes the numbers checked here:

* sigma = 0, exact norms with clipping active: DPDDP (mean and sum reductions) and torch DDP
  give exactly the single-process parameters on the same global batch, after 2 steps;
* the same with two backward passes, and with book-keeping (the default: each rank's one-pass
  clipped sum, all-reduced once; torch DDP's reducer is off);
* sigma = 0, sketched norms (fixed rank-seeded probes): the update is
  theta - lr sum_i c_i g_i / B over the global batch, and book-keeping equals two passes;
* FLOPs per step per rank (FlopCounterMode): DDP and DPDDP book-keeping equal single-process
  book-keeping on the local batch (<= 1.05x); the old fallback (two passes, full first pass)
  counts >= 1.5x;
* noise is drawn once (rank 0), and step hooks see the all-reduced gradient, whose sd is
  sigma * C (noise twice would give sqrt(2) sigma C);
* PrivacyEngine with a DPDDP model: distributed Poisson loader, the registry's distributed
  optimizer, one accountant step per step on each rank, the single-process epsilon;
* a NaN on one rank: both ranks raise (no hang), no rank steps or accounts, both recover;
* BatchMemoryManager with physical batches of 1 and an empty Poisson batch on one rank (Opacus'
  distributed sampler would skip it): the ranks run different numbers of physical batches
  but meet at every logical step, and account one step per logical batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("ddp_worker.py")


@pytest.mark.slow
def test_two_process_gloo_randomized_clipping(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    # The checkout under test, not whichever opacus_rc is installed (a worktree or a clone
    # beside an installed copy would otherwise test the installed one).
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    for key in (
        "parity_dpddp_mean",
        "parity_dpddp_sum",
        "parity_torch_ddp_mean",
        "parity_dpddp_mean_two_pass",
        "parity_torch_ddp_mean_two_pass",
    ):
        assert res[key]["max_abs_diff"] < 1e-6 and res[key]["clipped_samples"] >= 4
    for wrapper in ("dpddp", "ddp"):
        assert res["bookkeeping_vs_two_pass"][wrapper]["bk_vs_two_pass"] < 1e-6
        assert res["bookkeeping_vs_two_pass"][wrapper]["vs_formula"] < 1e-5
    ratios = res["flops"]["ratios"]
    assert ratios["ddp_bookkeeping"] <= 1.05 and ratios["dpddp_bookkeeping"] <= 1.05
    assert ratios["ddp_old_fallback"] >= 1.5
    assert res["noise_once"]["noise_calls"] == [1, 0]
    assert abs(res["noise_once"]["noise_sd"] - 1.0) < 0.05
    assert res["engine"]["accountant_steps"] == 4
    assert res["failure_on_one_rank"]["recovered"]
    assert res["batch_memory_manager"]["accountant_steps"] == 3
    assert sum(res["batch_memory_manager"]["empty_batches_per_rank"]) >= 1
