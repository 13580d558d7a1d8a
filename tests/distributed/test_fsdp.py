"""Randomized clipping of FSDP2 models: 2 CPU processes, gloo (tests/distributed/fsdp_worker.py).

One spawn runs every scenario; the worker asserts inside each rank and rank 0 writes the
numbers checked here (the tolerances are derived in the worker's docstrings):

* sigma = 0, exact norms, clipping active: FSDP2 with book-keeping (mean and sum reductions)
  and with two passes gives the single-process parameters on the same global batch;
* sigma = 0, sketched norms: k = 8 matches theta - lr sum_i c_i g_i / B with the run's own
  n_hat; k = 512 matches a single process (own probes) within the sketch-variance bound;
* noise drawn once: with one seed on both ranks the unsharded noise is the single-process
  noise of that seed; with per-rank seeds its sd is sigma * C (not sqrt(2) sigma C);
* PrivacyEngine with an FSDP2 model: distributed Poisson loader, the FSDP optimizer, one
  accountant step per step, the single-process epsilon, steps where only one rank's batch is
  empty, ranks in sync; denoise= refused;
* PyTorch's "FSDP2-wrapped module returned a view tensor" warning (issue 20 item 11): raised
  for a hooked nn.Linear on a rank-3 input and for the root only, in-place ops on what the
  caller sees raise, and the update of that run equals the per-sample oracle's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("fsdp_worker.py")


def test_two_process_gloo_fsdp2_randomized_clipping(tmp_path: Path) -> None:
    out = tmp_path / "fsdp.json"
    # The checkout under test, not whichever opacus_rc is installed.
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
    for key in ("parity_exact_mean_bk", "parity_exact_sum_bk", "parity_exact_mean_two_pass"):
        assert res[key]["max_abs_diff"] < 1e-6 and res[key]["clipped_samples"] >= 4
    for key in ("parity_sketched_bk", "parity_sketched_two_pass"):
        assert res[key]["k8_vs_formula"] < 1e-5
        assert res[key]["k512_gap_over_bound"] <= 1.0
    for key in ("noise_once_bk", "noise_once_two_pass"):
        assert res[key]["same_seed"]["equals_single_process"]
        assert abs(res[key]["rank_seed"]["noise_sd"] - 1.0) < 0.05
    assert res["engine"]["accountant_steps"] == 8
    assert res["engine"]["steps_with_one_empty_rank"] >= 1
    assert res["denoise_refused"]["refused"]
    view = res["view_warning"]
    # torch 2.15 no longer names FSDPLinear (the compatibility run of issue 33)
    assert view["flagged"] in (["FSDPLinear", "FSDPViewNet"], ["FSDPViewNet"])
    assert view["vs_formula"] < 1e-5 and view["clipped_samples"] >= 4
    assert view["inplace_root_raises"] and view["inplace_layer_raises"]


def test_torchrun_tutorial_script_fsdp(tmp_path: Path) -> None:
    """tutorials/distributed_training.py under torchrun (2 CPU processes, gloo, FSDP2): it runs
    both epochs and each epoch accounts its 8 steps (the README's launch command)."""
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",
            str(root / "tutorials" / "distributed_training.py"),
            "--parallel",
            "fsdp",
            "--seq-len",
            "8",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "16 steps accounted" in proc.stdout, proc.stdout
    # PyTorch's FSDP2 view-tensor warning, shown on every step before (64 copies in the
    # tutorial's run), is silenced for the two module classes where it provably does not
    # apply (fsdp_worker.scenario_view_warning); nothing else is silenced.
    assert "returned a view tensor" not in proc.stderr, proc.stderr[-4000:]
