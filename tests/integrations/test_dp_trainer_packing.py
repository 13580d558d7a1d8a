"""Packed and padding-free training through ``DPTrainer`` (a ``PackingCollator``) and
``DPSFTTrainer`` (``packing=True``, ``padding_free=True``) on tiny random Llama and GPT-2
models (docs/packing.md#packing-trainer).

Checked against oracles outside the library:

* the micro-batch plan packs each logical batch's records into at most
  ``per_device_train_batch_size`` rows, with every record (and every segment of a record
  longer than a row) in one micro-batch, and the packed rows hold each record's own tokens;
* at sigma = 0 one packed step equals ``-lr / B_exp * sum_r min(1, C / ||g_r||) g_r`` with
  ``g_r`` each record's gradient computed alone, unpadded, in float64 (GPT-2: exact norms,
  learned positions, clipping active), so no record moves the weights by more than ``C``;
* the packed and the padded runs (same seeds: the same Poisson records) give the same update
  and the same epsilon; with TRL, ``packing=True`` and ``padding_free=True`` equal the padded
  ``DPSFTTrainer`` run;
* a packed batch whose attention crosses records is refused before anything is noised; the
  configurations that cannot be exact are refused with what to do.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_helpers as th  # noqa: E402

from opacus_rc.batch_independence import BatchIndependenceError  # noqa: E402
from opacus_rc.integrations.packed_batches import (  # noqa: E402
    PackedLogicalBatchCollator,
    packing_rows,
    plan_packed_micro_batches,
)
from opacus_rc.integrations.transformers import LogicalBatch, PrivacyArguments  # noqa: E402
from opacus_rc.packing import PackingCollator, pack_records  # noqa: E402

DELTA = 1e-3
SGD = {"optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant", "weight_decay": 0.0}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message="PrivacyArguments.seed")
    warnings.filterwarnings("ignore", message="epsilon cannot be computed")


# --------------------------------------------------------------------------------------------
# The data side: the plan and the packed logical batch
# --------------------------------------------------------------------------------------------


def test_plan_fits_the_rows_and_keeps_records_whole() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(1, 40, (60,), generator=g)]  # some > max_length
    bounds = plan_packed_micro_batches(lengths, max_length=16, max_rows=4)
    assert bounds[0][0] == 0 and bounds[-1][1] == 60
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    for lo, hi in bounds:
        rows = pack_records([[1] * n for n in lengths[lo:hi]], max_length=16, pad_token_id=0)
        assert rows.input_ids.shape[0] == packing_rows(lengths[lo:hi], max_length=16) <= 4
        # Greedy: the next record would not have fitted.
        if hi < 60:
            assert packing_rows(lengths[lo : hi + 1], max_length=16) > 4
    with pytest.raises(ValueError, match="packs into 3 rows.*per_device_train_batch_size=2"):
        plan_packed_micro_batches([5, 40], max_length=16, max_rows=2)
    assert plan_packed_micro_batches([], max_length=16, max_rows=2) == []


def test_packed_logical_batch_holds_each_record_once_with_its_own_tokens() -> None:
    examples = th.token_examples(11, seed=3, min_len=2, max_len=14)
    examples[4] = {"input_ids": list(range(1, 30))}  # longer than a row: cut across 2 rows
    collate = PackedLogicalBatchCollator(
        packing=PackingCollator(max_length=16, pad_token_id=th.PAD), max_physical_batch_size=3
    )
    batch = collate(examples)
    assert isinstance(batch, LogicalBatch) and batch.num_examples == 11
    assert len(batch.sizes) > 1
    seen = 0
    for micro, exs in zip(batch.micro_batches, batch.micro_examples):
        rid = micro["record_ids"]
        assert micro["input_ids"].shape[0] <= 3
        assert micro["attention_mask"].shape == (rid.shape[0], 1, rid.shape[1], rid.shape[1])
        assert int(rid.max()) + 1 == len(exs)
        for i, ex in enumerate(exs):
            tokens = micro["input_ids"][rid == i]  # row-major: the record's segments in order
            assert tokens.tolist() == list(ex["input_ids"])
            for row in range(rid.shape[0]):  # positions restart at each segment
                pos = micro["position_ids"][row][rid[row] == i]
                assert pos.tolist() == list(range(pos.numel()))
        seen += len(exs)
    assert seen == 11
    with pytest.raises(ValueError, match="padding"):
        collate([{"input_ids": [1, 2, 0], "attention_mask": [1, 1, 0]}])


# --------------------------------------------------------------------------------------------
# Through DPTrainer, against an oracle
# --------------------------------------------------------------------------------------------


class Recording(th.recording_trainer()):
    pass


def packing(**kw: Any) -> PackingCollator:
    return PackingCollator(max_length=kw.pop("max_length", 16), pad_token_id=th.PAD, **kw)


def make(
    tmp_path: Path,
    *,
    model: Any,
    collator: Any,
    privacy: dict | None = None,
    data: Any = None,
    **args: Any,
) -> Any:
    p = {"target_epsilon": 4.0, "target_delta": DELTA, "expected_batch_size": 8, "seed": 1}
    p.update(privacy or {})
    return Recording(
        model=model,
        args=th.training_args(tmp_path, **args),
        train_dataset=th.token_examples(40) if data is None else data,
        data_collator=collator,
        privacy_args=PrivacyArguments(**p),
    )


def records_alone_gradients(model: Any, batch: LogicalBatch) -> list[list[torch.Tensor]]:
    """Each sampled record's gradient of its mean next-token loss, alone, unpadded, float64."""
    model = model.double()
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for exs in batch.micro_examples:
        for ex in exs:
            ids = torch.tensor(ex["input_ids"]).unsqueeze(0)
            logits = model(input_ids=ids).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
            grads.append(list(torch.autograd.grad(loss, trainable)))
    return grads


def test_packed_update_is_the_sum_of_records_clipped_alone(tmp_path: Path) -> None:
    """GPT-2 (learned positions, exact norms), rows of 16 tokens holding several records."""
    model = th.tiny_gpt2_exact()
    start = th.snapshot(model)
    C = 2.6
    tr = make(
        tmp_path,
        model=model,
        collator=packing(),
        privacy={"noise_multiplier": 0.0, "target_epsilon": None, "max_grad_norm": C},
        max_steps=1,
        per_device_train_batch_size=2,
        **SGD,
    )
    tr.train()
    [batch] = tr.batches
    assert len(batch.sizes) > 1  # several micro-batches
    assert any(
        (m["record_ids"][:, 0] != m["record_ids"].max(dim=1).values).any()
        for m in batch.micro_batches
    )  # some row holds several records
    g = records_alone_gradients(start, batch)
    norms = torch.stack([torch.sqrt(sum((x**2).sum() for x in gi)) for gi in g])
    assert (norms > C).sum() >= 2 and (norms < C).sum() >= 1  # clipping is active
    factors = torch.clamp(C / (norms + 1e-6), max=1.0)
    b_exp = tr.dp_optimizer.expected_batch_size
    names = [n for n, p in start.named_parameters() if p.requires_grad]
    before, after = dict(start.named_parameters()), dict(tr.model.named_parameters())
    update_sq = 0.0
    for j, name in enumerate(names):
        expected = -sum(f * gi[j] for f, gi in zip(factors, g)) / b_exp
        got = (after[name].detach() - before[name].detach()).double()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
        update_sq += float((got**2).sum())
    assert math.sqrt(update_sq) * b_exp <= C * batch.num_examples * (1 + 1e-5)


def _run(tmp_path: Path, name: str, model_fn: Any, collator: Any, **kw: Any) -> Any:
    privacy = kw.pop("privacy", {"noise_multiplier": 0.0, "target_epsilon": None})
    tr = make(tmp_path / name, model=model_fn(), collator=collator, privacy=privacy, **kw)
    tr.train()
    return tr


@pytest.mark.parametrize("padding_free", [False, True], ids=["packed", "padding_free"])
def test_packed_run_equals_the_padded_run(tmp_path: Path, padding_free: bool) -> None:
    """Llama (rotary, sketched norms; C above every norm, so every factor is 1 whatever the
    sketch draws), same seeds: the same Poisson records, the same update, the same epsilon."""
    privacy = {"noise_multiplier": 0.0, "target_epsilon": None, "max_grad_norm": 1e3}
    kw = {"max_steps": 3, "per_device_train_batch_size": 3, "privacy": privacy, **SGD}
    padded = _run(tmp_path, "padded", th.tiny_llama, th.pad_collate, **kw)
    packed = _run(tmp_path, "packed", th.tiny_llama, packing(padding_free=padding_free), **kw)
    assert [b.num_examples for b in padded.batches] == [b.num_examples for b in packed.batches]
    assert sum(len(b.sizes) for b in packed.batches) < sum(len(b.sizes) for b in padded.batches)
    a, b = th.params(padded.model), th.params(packed.model)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6)
    start = th.params(th.tiny_llama())
    assert any(not torch.allclose(start[n], b[n]) for n in b)


def test_packed_epsilon_is_the_padded_epsilon(tmp_path: Path) -> None:
    kw = {"max_steps": 4, "privacy": {"target_epsilon": 3.0}}
    padded = _run(tmp_path, "padded", th.tiny_llama, th.pad_collate, **kw)
    packed = _run(tmp_path, "packed", th.tiny_llama, packing(), **kw)
    assert packed.dp_optimizer.noise_multiplier == padded.dp_optimizer.noise_multiplier
    assert packed.get_epsilon() == padded.get_epsilon() and 2.97 <= packed.get_epsilon() <= 3.0
    assert packed.dp_optimizer.expected_batch_size == padded.dp_optimizer.expected_batch_size


class CrossingCollator(PackingCollator):
    """A packing collator whose mask is one causal mask over each row (crosses records)."""

    def __call__(self, examples: Any) -> dict:
        out = super().__call__(examples)
        t = out["input_ids"].shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        out["attention_mask"] = causal.expand(out["input_ids"].shape[0], 1, t, t).clone()
        return out


def test_packed_attention_across_records_is_refused_before_any_step(tmp_path: Path) -> None:
    model = th.tiny_llama()
    start = th.params(model)
    collator = CrossingCollator(max_length=16, pad_token_id=th.PAD, mask_dtype=torch.bool)
    tr = make(tmp_path, model=model, collator=collator, max_steps=1)
    with pytest.raises(BatchIndependenceError, match="attention crosses records"):
        tr.train()
    assert len(tr.privacy_engine.accountant) == 0
    after = th.params(tr.model)
    assert all(torch.equal(start[n], after[n]) for n in start)


def test_packed_units_equal_the_padded_units_run(tmp_path: Path) -> None:
    """``privacy_unit`` with a packing collator: units Poisson-sampled, a unit's records packed
    into the same micro-batch and clipped together (``units=`` over records). GPT-2, exact
    norms, clipping active: the same update as the padded privacy-unit run (same seeds)."""
    data = [dict(ex, user=i // 2) for i, ex in enumerate(th.token_examples(40))]  # 20 units
    privacy = {
        "noise_multiplier": 0.0, "target_epsilon": None, "max_grad_norm": 2.6,
        "privacy_unit": "user", "expected_batch_size": 6,
    }  # fmt: skip
    kw = {"max_steps": 2, "per_device_train_batch_size": 4, **SGD}
    padded = make(tmp_path / "a", model=th.tiny_gpt2_exact(), collator=th.pad_collate,
                  data=data, privacy=privacy, **kw)  # fmt: skip
    padded.train()
    packed = make(tmp_path / "b", model=th.tiny_gpt2_exact(), collator=packing(),
                  data=data, privacy=privacy, **kw)  # fmt: skip
    packed.train()
    assert [b.num_examples for b in packed.batches] == [b.num_examples for b in padded.batches]
    micro = [m for b in packed.batches for m in b.micro_batches]
    assert all(m["dp_privacy_units"].numel() == int(m["record_ids"].max()) + 1 for m in micro)
    assert any(torch.unique(m["dp_privacy_units"]).numel() < m["dp_privacy_units"].numel()
               for m in micro)  # fmt: skip
    a, b = th.params(padded.model), th.params(packed.model)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6)
    start = th.params(th.tiny_gpt2_exact())
    assert any(not torch.allclose(start[n], b[n]) for n in b)


def test_evaluation_gets_packed_rows_without_the_criterion_keys(tmp_path: Path) -> None:
    tr = make(tmp_path, model=th.tiny_llama(), collator=packing(), max_steps=1)
    tr.train()
    metrics = tr.evaluate(eval_dataset=th.token_examples(6, seed=9))
    assert math.isfinite(metrics["eval_loss"])


def tiny_llama_varlen() -> Any:
    """:func:`trainer_helpers.tiny_llama` with the varlen SDPA over records."""
    from opacus_rc.packed_attention import PACKED_SDPA, register_packed_sdpa

    model = th.tiny_llama()
    model.set_attn_implementation(register_packed_sdpa())
    assert model.config._attn_implementation == PACKED_SDPA
    return model


def test_varlen_packed_run_equals_the_padded_sdpa_run(tmp_path: Path) -> None:
    """A ``PackingCollator(padding_free=True)`` with the varlen attention (no 4D mask: SDPA
    on each record segment) against the padded run with plain SDPA (same seeds, sigma = 0,
    C above every norm): the same update; its evaluation runs padded rows with a 2D mask."""
    privacy = {"noise_multiplier": 0.0, "target_epsilon": None, "max_grad_norm": 1e3}
    kw = {"max_steps": 3, "per_device_train_batch_size": 3, "privacy": privacy, **SGD}
    padded = _run(tmp_path, "padded", th.tiny_llama, th.pad_collate, **kw)
    packed = _run(tmp_path, "varlen", tiny_llama_varlen, packing(padding_free=True), **kw)
    assert packed.model.config._attn_implementation != padded.model.config._attn_implementation
    micro = [m for b in packed.batches for m in b.micro_batches]
    assert all("attention_mask" not in m for m in micro)
    assert any((m["record_ids"][:, 0] != m["record_ids"].max(dim=1).values).any() for m in micro)
    a, b = th.params(padded.model), th.params(packed.model)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6)
    start = th.params(th.tiny_llama())
    assert any(not torch.allclose(start[n], b[n]) for n in b)
    assert math.isfinite(packed.evaluate(eval_dataset=th.token_examples(6, seed=9))["eval_loss"])


def test_varlen_run_whose_positions_do_not_restart_is_refused(tmp_path: Path) -> None:
    """The varlen attention reads the records from the position ids: a collator whose
    positions run over the whole row is refused before any step."""

    class WholeRowPositions(PackingCollator):
        def __call__(self, examples: Any) -> dict:
            out = super().__call__(examples)
            out["position_ids"] = torch.arange(out["input_ids"].shape[1]).expand_as(
                out["input_ids"]
            )
            return out

    model = tiny_llama_varlen()
    start = th.params(model)
    collator = WholeRowPositions(max_length=16, pad_token_id=th.PAD, padding_free=True)
    tr = make(tmp_path, model=model, collator=collator, max_steps=1)
    # The trainer's first-batch logits check refuses it (the guard's segment check would too).
    with pytest.raises(BatchIndependenceError, match="other logits alone.*register_packed_sdpa"):
        tr.train()
    assert len(tr.privacy_engine.accountant) == 0
    after = th.params(tr.model)
    assert all(torch.equal(start[n], after[n]) for n in start)
