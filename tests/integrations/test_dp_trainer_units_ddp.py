"""``DPTrainer`` with ``PrivacyArguments.privacy_unit`` under a 2-process ``torchrun`` launch
(CPU, gloo; ``units_ddp_worker.py``): each sampled document is trained on rank ``u % 2``.

Each run is compared with the same run in one process (same seed), whose update
``test_dp_trainer_units.py::test_one_step_is_the_per_unit_clipped_sum`` checks against a
float64 per-unit oracle. With the same seed the ranks' shares partition the single process'
batches of documents, so:

* every step's documents are split between the ranks, document ``u`` on rank ``u % 2`` only;
* at sigma = 0 (clipping active) the DDP weights equal the single-process weights: each rank
  clips its own documents and the clipped sums are divided by the expected *global* number of
  documents (per rank ``int(U q) / 2 = 2``);
* at sigma = 1 they are equal too: the noise is added once (rank 0; on both ranks its std would
  be ``sqrt(2)`` times larger, a difference of order 1 per coordinate at lr 1, C = 4, E = 4);
* every rank's accountant records the single process' schedule at the unit rate, and the
  weights are bitwise identical across ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import units_ddp_worker as uw  # noqa: E402


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The records of both ranks of one ``torchrun --nproc-per-node 2`` launch."""
    out = tmp_path_factory.mktemp("units_ddp")
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    worker = Path(__file__).with_name("units_ddp_worker.py")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(worker), str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("units_single")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: uw.train(name, out / name) for name in uw.RUNS}


@pytest.mark.slow
@pytest.mark.parametrize("run", sorted(uw.RUNS))
def test_ddp_units_equal_single_process(launch: list, single: dict, run: str) -> None:
    ranks, one = [r[run] for r in launch], single[run]
    assert [r["world_size"] for r in ranks] == [2, 2] and one["world_size"] == 1
    index = one["unit_index"]
    for step, (a, b, whole) in enumerate(
        zip(ranks[0]["shares"], ranks[1]["shares"], one["shares"])
    ):
        assert sorted(a + b) == whole, step  # the ranks partition the single-process batch
        assert all(index[d] % 2 == 0 for d in a) and all(index[d] % 2 == 1 for d in b)
    assert any(a and b for a, b in zip(ranks[0]["shares"], ranks[1]["shares"]))  # both train
    assert [r["expected_batch_size"] for r in ranks] == [2.0, 2.0]  # int(12 / 3) / 2 ranks
    assert one["expected_batch_size"] == 4.0
    start = uw.th.params(uw.th.tiny_gpt2_exact())
    assert any(not torch.equal(p, start[name]) for name, p in one["params"].items())
    for name, p in one["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], p, rtol=1e-5, atol=1e-5)
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
    for r in ranks:
        assert r["history"] == one["history"]
        assert r["epsilon"] == one["epsilon"]
    [(sigma, q, steps, _spec)] = one["history"]
    assert q == 1 / 3 and steps == uw.RUNS[run]["args"]["max_steps"]
    assert sigma == uw.RUNS[run]["privacy"]["noise_multiplier"]
