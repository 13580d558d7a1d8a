"""Edge cases of distributed randomized clipping: 2 CPU processes, gloo
(tests/distributed/edge_worker.py; the worker asserts inside each rank):

* rand_on_empty=True under DPDDP: an empty Poisson batch, a rank's first included, is a random
  batch of size 1 (a model that cannot take B = 0 trains), every step accounted;
* FSDP2: a trainable module without a sampler (like HF's LlamaRMSNorm) is refused with a
  message naming it and what to do, whether FSDP2Wrapper left it unsharded or it was sharded
  by hand (no bare AssertionError from Opacus' functorch deepcopy);
* FSDP2: a tied embedding / LM head in one group is accepted (issue 35; it was refused);
* FSDP2: a rank that skips its forward/backward raises StepProtocolError instead of deadlocking.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("edge_worker.py")


def test_two_process_gloo_edge_cases(tmp_path: Path) -> None:
    out = tmp_path / "edge.json"
    root = str(Path(__file__).resolve().parents[2])  # the checkout under test
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["rand_on_empty"]["first_batch_random"] >= 1
    assert set(res["norm_without_sampler"]) == {"wrapper", "by_hand"}
    assert res["tied"]["accepted"]
    assert res["skip_forward"]["raised"]
