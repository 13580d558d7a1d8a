"""``DPTrainer`` under a 2-process ``torchrun`` launch (CPU, gloo): the DDP path.

One launch of ``multiprocess_worker.py`` trains two runs on each rank (GPT-2 with exact
per-example norms, so clipping is deterministic; SGD with lr 1, so the update is the gradient):

* ``clip``: sigma = 0 with clipping active (C = 2.6, the examples' norms are 1.9-4.0);
* ``budget``: the noise searched for epsilon 4 over 4 steps, with a logical batch small enough
  that one rank's share is empty at some step.

Each is compared with the same run in one process (same seed), whose update the single-process
tests check against a float64 per-example oracle
(``test_dp_trainer.py::test_update_is_the_clipped_sum_and_no_example_exceeds_c``). With the same
seed the ranks' shares partition the single process' Poisson batches, so:

* (a) at sigma = 0 the DDP weights equal the single-process weights: the clipped per-example
  gradients of both ranks are summed and divided by the expected *global* batch size;
* with noise they are equal too: the noise is added once (rank 0; added on both ranks the
  noise would have std ``sqrt(2)`` times larger, a difference of ~0.5 per coordinate here);
* (b) every rank's epsilon after the 4 steps equals the single-process run's and what
  ``PrivacyEngine``'s RC accountant gives for the recorded schedule (sigma, q, steps);
* (c) the trained weights are identical (bitwise) across ranks.

A checkpoint written at step 2 (by rank 0, with every rank's sketch-generator state) resumes
on both ranks (``resume_exact=True``) to the uninterrupted run's epsilon and weights; the
default (fresh) resume takes rank 0's nonce on both ranks. FSDP2 with FSDP's activation
checkpointing through the Trainer is refused on every rank with a message that says what to set
(FSDP2 through the Trainer: test_dp_trainer_fsdp.py).
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
import multiprocess_worker as mw  # noqa: E402

from opacus_rc import PrivacyEngine  # noqa: E402
from opacus_rc.integrations.transformers import PoissonLogicalBatchSampler  # noqa: E402


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The records of both ranks of one ``torchrun --nproc-per-node 2`` launch."""
    out = tmp_path_factory.mktemp("ddp")
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    worker = Path(__file__).with_name("multiprocess_worker.py")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(worker), str(out)],
        capture_output=True, text=True, timeout=400, env=env, cwd=out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The same runs in this one process."""
    out = tmp_path_factory.mktemp("single")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: mw.train(name, out / name)[1] for name in mw.RUNS}


def _check_shares(ranks: list[dict], one: dict) -> None:
    """The ranks' shares partition the single process' logical batches."""
    per_rank = [[n for n, _ in r["shares"]] for r in ranks]
    assert [a + b for a, b in zip(*per_rank)] == [n for n, _ in one["shares"]]


@pytest.mark.slow
def test_ddp_sigma_zero_update_equals_single_process(launch: list, single: dict) -> None:
    ranks, one = [r["clip"] for r in launch], single["clip"]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert all(r["ddp_wrapped"] == "DistributedDataParallel" for r in ranks)  # accelerate's DDP
    _check_shares(ranks, one)
    # The ranks split their shares into different numbers of micro-batches at some step.
    assert any(a[1] != b[1] for a, b in zip(ranks[0]["shares"], ranks[1]["shares"]))
    start = mw.th.params(mw.th.tiny_gpt2_exact())
    assert all(not torch.equal(p, start[name]) for name, p in one["params"].items())
    for name, p in one["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], p, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_ddp_noise_added_once_and_epsilon_equals_single_process(launch: list, single: dict) -> None:
    ranks, one = [r["budget"] for r in launch], single["budget"]
    _check_shares(ranks, one)
    assert any(n == 0 for r in ranks for n, _ in r["shares"])  # a noise-only share
    for name, p in one["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], p, rtol=1e-5, atol=1e-5)
    [(sigma, q, steps, spec)] = one["history"]
    assert steps == 4 and q == 1 / 14  # q = 1 / ceil(40 / 3)
    fresh = PrivacyEngine(accountant="rc").accountant
    fresh.history = [(sigma, q, steps, spec)]
    reference = fresh.get_epsilon(mw.DELTA)
    assert 4.0 - 0.01 <= reference <= 4.0
    for r in ranks:
        assert r["history"] == one["history"] and r["noise_multiplier"] == sigma
        assert r["epsilon"] == one["epsilon"] == pytest.approx(reference, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("run", sorted(mw.RUNS))
def test_ddp_weights_identical_across_ranks(launch: list, run: str) -> None:
    a, b = (r[run]["params"] for r in launch)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
def test_ddp_token_count_is_the_global_one_and_no_hook_is_left(launch: list, single: dict) -> None:
    """The opt-in token count (``non_private/num_input_tokens_seen``) sums both ranks' shares:
    every rank logs the single-process run's counts (its batches are the ranks' shares
    together). After ``train()`` no privacy attribute is left on any rank's parameters."""
    ranks, one = [r["clip"] for r in launch], single["clip"]
    counts = one["tokens_logged"]
    assert len(counts) == 4 and all(c > 0 for c in counts)  # 3 steps, then the final metrics
    assert counts[:3] == sorted(counts[:3]) and counts[2] == counts[3]
    for r in ranks:
        assert r["tokens_logged"] == counts
    for r in (*ranks, one):
        assert r["left_on_params"] == []


@pytest.mark.slow
def test_ddp_fsdp_through_the_trainer_is_refused(launch: list) -> None:
    """FSDP2 through the Trainer runs since issue 35 (test_dp_trainer_fsdp.py); what is still
    refused is refused on every rank of a launch, saying what to set: here FSDP's activation
    checkpointing."""
    for r in launch:
        assert r["fsdp"]["error"] == "NotImplementedError"
        message = r["fsdp"]["message"]
        assert "FSDP2 through a DP trainer does not support" in message
        assert 'fsdp_config["activation_checkpointing"]=True' in message
        assert "set it to False" in message


def test_rank_shares_partition_the_single_process_batches() -> None:
    """Same seed: shard r keeps the indices i % 2 == r of the one global Poisson mask."""
    kw = {"num_samples": 101, "sample_rate": 0.1, "steps": 30, "seed": 5}
    whole = PoissonLogicalBatchSampler(**kw)
    shards = [PoissonLogicalBatchSampler(**kw, rank=r, world_size=2) for r in (0, 1)]
    for epoch in (0, 3):
        for s in (whole, *shards):
            s.set_epoch(epoch)
        for full, s0, s1 in zip(whole, *shards):
            assert all(i % 2 == 0 for i in s0) and all(i % 2 == 1 for i in s1)
            assert sorted(s0 + s1) == sorted(full)
    with pytest.raises(ValueError, match="rank"):
        PoissonLogicalBatchSampler(**kw, rank=2, world_size=2)


@pytest.mark.slow
def test_ddp_resume_exact_equals_uninterrupted(launch: list) -> None:
    """Saved at step 2 by rank 0 (seeded sketch: every rank's sketch state in the checkpoint),
    resumed on both ranks with ``resume_exact=True``: epsilon, history, weights and each rank's
    sketch state equal the uninterrupted run's."""
    for r in launch:
        a, b = r["resume"]["uninterrupted"], r["resume"]["resumed"]
        assert b["epsilon"] == a["epsilon"] and b["history"] == a["history"]
        assert torch.equal(b["sketch_state"], a["sketch_state"])
        for name in a["params"]:
            torch.testing.assert_close(b["params"][name], a["params"][name], rtol=1e-6, atol=1e-7)
    states = [r["resume"]["resumed"]["sketch_state"] for r in launch]
    assert not torch.equal(*states)  # each rank draws its own probes


@pytest.mark.slow
def test_ddp_fresh_resume_agrees_across_ranks(launch: list) -> None:
    """The default resume draws fresh masks and noise from rank 0's nonce (broadcast): both
    ranks take the same nonce and sampler seed (so their shares still partition one Poisson
    batch) and end with identical weights, other than the uninterrupted run's, at its
    epsilon."""
    fresh = [r["resume"]["fresh"] for r in launch]
    a = launch[0]["resume"]["uninterrupted"]
    assert fresh[0]["fresh_resumes"] == fresh[1]["fresh_resumes"] and fresh[0]["fresh_resumes"]
    assert fresh[0]["sampler_seed"] == fresh[1]["sampler_seed"] != a["sampler_seed"]
    for f in fresh:
        assert f["epsilon"] == a["epsilon"] and f["history"] == a["history"]
    for name in a["params"]:
        assert torch.equal(fresh[0]["params"][name], fresh[1]["params"][name]), name
    assert any(not torch.equal(fresh[0]["params"][n], a["params"][n]) for n in a["params"])
