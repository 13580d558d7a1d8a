"""``DPTrainer`` with a packing collator (:class:`~opacus_rc.packing.PackingCollator`, the
criterion's ``record_ids=``) under a 2-process ``torchrun`` launch (CPU, gloo;
``packing_ddp_worker.py``), issue 32.

Each run is compared with the same run in one process (same seed), whose packed update
``test_dp_trainer_packing.py::test_packed_update_is_the_sum_of_records_clipped_alone`` checks
against a float64 oracle (each record's gradient alone, unpadded). With the same seed the
ranks' shares partition the single process' Poisson batches of records, each rank packs its
own share into rows, so:

* every step's records are split between the ranks (each record on exactly one rank), and each
  rank's packed rows hold at most ``per_device_train_batch_size`` rows of at most 16 tokens;
* at sigma = 0 (GPT-2, exact per-record norms, clipping active) the DDP weights equal the
  single-process weights: each rank clips its own records inside its packed rows and the
  clipped sums are divided by the expected *global* number of records (per rank ``8 / 2``);
* at a target epsilon (tiny Llama: tied embedding / LM head, RMSNorm, sketched norms) every
  rank's noise multiplier, accountant history and epsilon are the single process';
* the weights are bitwise identical across ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import packing_ddp_worker as pw  # noqa: E402


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The records of both ranks of one ``torchrun --nproc-per-node 2`` launch."""
    out = tmp_path_factory.mktemp("packing_ddp")
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    worker = Path(__file__).with_name("packing_ddp_worker.py")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(worker), str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("packing_single")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: pw.train(name, out / name) for name in pw.RUNS}


def _check_shares(ranks: list[dict], one: dict) -> None:
    steps = len(one["shares"])
    assert [len(r["shares"]) for r in ranks] == [steps, steps]
    for step in range(steps):
        a, b = (Counter(map(tuple, r["shares"][step])) for r in ranks)
        assert a + b == Counter(map(tuple, one["shares"][step])), step  # a partition
        for r in ranks:
            assert all(rows <= 2 and t <= 16 for rows, t in r["rows"][step])
    assert any(r0 and r1 for r0, r1 in zip(ranks[0]["shares"], ranks[1]["shares"]))


@pytest.mark.slow
def test_ddp_packed_clip_equals_single_process(launch: list, single: dict) -> None:
    ranks, one = [r["clip"] for r in launch], single["clip"]
    assert [r["world_size"] for r in ranks] == [2, 2] and one["world_size"] == 1
    _check_shares(ranks, one)
    assert [r["expected_batch_size"] for r in ranks] == [4.0, 4.0]  # 8 records / 2 ranks
    assert one["expected_batch_size"] == 8.0
    start = pw.th.params(pw.th.tiny_gpt2_exact())
    assert any(not torch.equal(p, start[name]) for name, p in one["params"].items())
    for name, p in one["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], p, rtol=1e-5, atol=1e-6)
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
    for r in ranks:
        assert r["history"] == one["history"]


@pytest.mark.slow
def test_ddp_packed_epsilon_equals_single_process(launch: list, single: dict) -> None:
    ranks, one = [r["budget"] for r in launch], single["budget"]
    _check_shares(ranks, one)
    assert 3.9 <= one["epsilon"] <= 4.0
    for r in ranks:
        assert r["noise_multiplier"] == one["noise_multiplier"] > 0
        assert r["history"] == one["history"]
        assert r["epsilon"] == one["epsilon"]
    for name, p in ranks[0]["params"].items():
        assert torch.equal(p, ranks[1]["params"][name]), name
