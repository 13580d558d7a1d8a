"""Resuming a ``DPTrainer`` run: no mask trained twice, no noise shared, the same epsilon.

What is checked, and against what (N = 40 token examples, expected_batch_size 8: q = 1/5,
5 steps per epoch; every example is a distinct random token sequence, so a trained row is
mapped back to its record by its unpadded tokens):

* the default resume draws *fresh* Poisson masks and noise: with ``ignore_data_skip=True``
  (the Trainer restarts the checkpoint's epoch from its first batch) no resumed step trains the
  records of a step the checkpoint already trained and accounted (today's sampler replayed
  them: steps 3-4 trained exactly the records of steps 1-2); two masks drawn independently at
  q = 1/5 over 40 records are equal with probability ``(0.8^2 + 0.2^2)^40 = 2e-7``;
* two continuations of one checkpoint add independent noise: the difference of their weights
  after one step, divided by ``lr / B``, has the norm of the difference of two independent
  ``N(0, sigma^2 C^2 I_d)`` draws, ``sigma C sqrt(2 d)`` (relative sd ``1 / sqrt(4 d)`` < 1%
  here), up to the two clipped sums (at most ``2 B C``, under 1% of it); restored noise gives 0;
* a fresh resume's accountant history and epsilon equal the uninterrupted run's, its batches are
  new draws, and its later checkpoints record the resume's nonce;
* ``resume_exact=True`` with ``ignore_data_skip=True`` is refused (it would replay the
  accounted masks); ``resume_exact=True`` continuations are identical (the documented unsafe
  case; the bit-identical resume itself: ``test_dp_trainer.py::
  test_resume_exact_equals_uninterrupted``);
* ``dataloader_num_workers=2`` draws the batches of 0 workers for the same seed (a ``DataLoader``
  with workers makes an iterator of the batch sampler that it discards, which moved the
  sampler to the next epoch), and a mid-epoch ``resume_exact`` resume with 2 workers equals the
  uninterrupted run bit for bit.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_helpers as th  # noqa: E402

from opacus_rc.integrations.logical_batches import (  # noqa: E402
    IndexDataset,
    UnitLogicalBatchSampler,
)
from opacus_rc.integrations.transformers import (  # noqa: E402
    PRIVACY_STATE_NAME,
    PoissonLogicalBatchSampler,
    PrivacyArguments,
)

N = 40
DATA = th.token_examples(N)
INDEX = {tuple(x["input_ids"]): i for i, x in enumerate(DATA)}
SGD = {"optim": "sgd", "lr_scheduler_type": "constant", "weight_decay": 0.0}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message="PrivacyArguments.seed")
    warnings.filterwarnings("ignore", message="PrivacyArguments.sketch_seed")


def make(tmp_path: Path, *, privacy: dict | None = None, **args: Any) -> Any:
    p = {"target_epsilon": 4.0, "target_delta": 1e-3, "expected_batch_size": 8, "seed": 1}
    p.update(privacy or {})
    return th.recording_trainer()(
        model=th.tiny_llama(),
        args=th.training_args(tmp_path, **args),
        train_dataset=DATA,
        data_collator=th.pad_collate,
        privacy_args=PrivacyArguments(**p),
    )


def records(batch: Any) -> frozenset[int]:
    """The records a logical batch trained (each row mapped back by its unpadded tokens)."""
    out = set()
    for micro in batch.micro_batches:
        for ids, mask in zip(micro["input_ids"], micro["attention_mask"]):
            out.add(INDEX[tuple(ids[mask.bool()].tolist())])
    return frozenset(out)


def test_fresh_resume_with_ignore_data_skip_trains_no_accounted_mask_again(
    tmp_path: Path,
) -> None:
    save = {"save_strategy": "steps", "save_steps": 2, "max_steps": 4}
    full = make(tmp_path / "full", **save)
    full.train()
    accounted = [records(b) for b in full.batches[:2]]
    resumed = make(tmp_path / "resumed", ignore_data_skip=True, **save)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "out" / "checkpoint-2"))
    trained = [records(b) for b in resumed.batches]
    assert len(trained) == 2 and len(resumed.privacy_engine.accountant) == 4
    for mask in trained:
        assert mask not in accounted, (trained, accounted)
    assert resumed.get_epsilon() == full.get_epsilon()


def test_exact_resume_refuses_ignore_data_skip_and_skips_accounted_masks(tmp_path: Path) -> None:
    """With ``resume_exact`` the Trainer's skip is what keeps the accounted masks out: without
    ``ignore_data_skip`` the resumed steps train the uninterrupted run's steps 3-4 (never 1-2);
    with it the resume is refused before any step."""
    save = {"save_strategy": "steps", "save_steps": 2, "max_steps": 4}
    exact = {"resume_exact": True}
    full = make(tmp_path / "full", privacy=exact, **save)
    full.train()
    checkpoint = str(tmp_path / "full" / "out" / "checkpoint-2")
    replaying = make(tmp_path / "replay", privacy=exact, ignore_data_skip=True, **save)
    with pytest.raises(ValueError, match="resume_exact=True with TrainingArguments.ignore_data"):
        replaying.train(resume_from_checkpoint=checkpoint)
    assert replaying.batches == []
    resumed = make(tmp_path / "resumed", privacy=exact, **save)
    resumed.train(resume_from_checkpoint=checkpoint)
    every = [records(b) for b in full.batches]
    assert [records(b) for b in resumed.batches] == every[2:]
    assert not set(every[2:]) & set(every[:2])


def test_two_continuations_of_a_checkpoint_add_independent_noise(tmp_path: Path) -> None:
    sigma, c, b, lr = 20.0, 1.0, 8, 0.01
    privacy = {
        "target_epsilon": None,
        "noise_multiplier": sigma,
        "max_grad_norm": c,
        "sketch_seed": 5,
    }
    save = {"save_strategy": "steps", "save_steps": 2, "max_steps": 3, "learning_rate": lr, **SGD}
    make(tmp_path / "full", privacy=privacy, **save).train()
    checkpoint = str(tmp_path / "full" / "out" / "checkpoint-2")

    def continuation(name: str, **extra: Any) -> dict[str, torch.Tensor]:
        tr = make(tmp_path / name, privacy={**privacy, **extra}, **save)
        tr.train(resume_from_checkpoint=checkpoint)
        assert len(tr.batches) == 1
        return th.params(tr.model)

    a, b_ = continuation("a"), continuation("b")
    d = sum(p.numel() for p in a.values())
    diff = math.sqrt(sum(float(((a[n] - b_[n]) ** 2).sum()) for n in a)) * b / lr
    expected = sigma * c * math.sqrt(2 * d)
    assert 0.95 < diff / expected < 1.05, (diff, expected)
    # resume_exact restores the noise: the continuations are the same release (unsafe to
    # publish both, as PrivacyArguments.resume_exact says).
    x, y = continuation("x", resume_exact=True), continuation("y", resume_exact=True)
    assert all(torch.equal(x[n], y[n]) for n in x)


def test_fresh_resume_has_the_uninterrupted_epsilon_and_new_batches(tmp_path: Path) -> None:
    save = {"save_strategy": "steps", "save_steps": 3, "max_steps": 7}
    full = make(tmp_path / "full", **save)
    full.train()
    resumed = make(tmp_path / "resumed", **save)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "out" / "checkpoint-3"))
    assert resumed.state.global_step == 7 and len(resumed.batches) == 4
    assert resumed.privacy_engine.accountant.history == full.privacy_engine.accountant.history
    assert resumed.get_epsilon() == full.get_epsilon()
    # New draws: none of the resumed masks is the uninterrupted run's mask of that step.
    for x, y in zip(full.batches[3:], resumed.batches, strict=True):
        assert records(x) != records(y)
    # The resume's nonce is in the continued run's later checkpoints (with its new seed).
    [nonce] = resumed._private.fresh_resumes
    state = torch.load(
        tmp_path / "resumed" / "out" / "checkpoint-6" / PRIVACY_STATE_NAME, weights_only=False
    )
    assert state["fresh_resumes"] == [nonce]
    assert state["sampler_seed"] == resumed._poisson_sampler.seed != full._poisson_sampler.seed


@pytest.mark.parametrize("units", [False, True], ids=["examples", "units"])
def test_samplers_draw_the_same_batches_with_workers(units: bool) -> None:
    """Two epochs through a ``DataLoader`` with 0 and 2 workers: the same index batches."""

    def epochs(workers: int) -> list:
        if units:
            sampler: Any = UnitLogicalBatchSampler(
                members=[[2 * u, 2 * u + 1] for u in range(20)], sample_rate=0.2, steps=5, seed=3
            )
        else:
            sampler = PoissonLogicalBatchSampler(num_samples=N, sample_rate=0.2, steps=5, seed=3)
        loader = DataLoader(
            IndexDataset(N), batch_sampler=sampler, num_workers=workers, collate_fn=list
        )
        out = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            out.append([[i for (i,) in batch] for batch in loader])
        return out

    zero = epochs(0)
    assert zero[0] != zero[1]
    assert epochs(2) == zero


def test_two_workers_train_the_zero_worker_batches_and_resume_exactly(tmp_path: Path) -> None:
    privacy = {"sketch_seed": 5, "resume_exact": True}
    save = {"save_strategy": "steps", "save_steps": 3, "max_steps": 7}
    zero = make(tmp_path / "zero", privacy=privacy, **save)
    zero.train()
    two = make(tmp_path / "two", privacy=privacy, dataloader_num_workers=2, **save)
    two.train()
    assert [records(b) for b in two.batches] == [records(b) for b in zero.batches]
    resumed = make(tmp_path / "resumed", privacy=privacy, dataloader_num_workers=2, **save)
    resumed.train(resume_from_checkpoint=str(tmp_path / "two" / "out" / "checkpoint-3"))
    assert [records(b) for b in resumed.batches] == [records(b) for b in zero.batches[3:]]
    assert resumed.get_epsilon() == zero.get_epsilon()
    a, b, c = th.params(zero.model), th.params(two.model), th.params(resumed.model)
    for name in a:
        assert torch.equal(a[name], b[name]) and torch.equal(a[name], c[name]), name


def test_resume_exact_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="resume_exact must be a bool"):
        PrivacyArguments(noise_multiplier=1.0, expected_batch_size=8, resume_exact="yes")
