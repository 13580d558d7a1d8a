"""Batch independence: a record's loss depends on that record alone (issue 30, item 2).

* Position ids from the attention mask: ``DPTrainer`` on a GPT-2 (learned absolute positions)
  with ``DataCollatorForLanguageModeling`` and left padding releases, at sigma = 0, updates on
  ``D`` and ``D`` minus its longest record that differ by at most ``C`` (1.69 C with positions
  ``0..T-1`` for every row), and each record's loss in the batch is its loss collated alone.
* The check at the first step: on the engine path, GPT-2 with left padding and no position
  ids is refused with the error naming the cause and the fix, and runs with the positions from
  the mask; a batch statistic is refused; on the Trainer path a collator that replaces a row
  and NEFTune are refused, before anything is noised or accounted; the switch turns it off;
  right padding passes and adds no accounting step.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_helpers as th  # noqa: E402

import opacus_rc  # noqa: E402
from opacus_rc import BatchIndependenceError, PrivacyEngine  # noqa: E402
from opacus_rc.batch_independence import independence_forward  # noqa: E402
from opacus_rc.integrations.model_inputs import (  # noqa: E402
    model_inputs,
    unpadded_next_token_labels,
)
from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments  # noqa: E402

SGD = {"optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant", "weight_decay": 0.0}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message="PrivacyArguments.seed")
    warnings.filterwarnings("ignore", message="epsilon cannot be computed")


def word_tokenizer(side: str) -> Any:
    """A 64-token word-level tokenizer (``t0`` is padding), padding on ``side``."""
    vocab = {f"t{i}": i for i in range(th.VOCAB)}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token=f"t{th.PAD}", unk_token="t1"
    )
    tok.padding_side = side
    return tok


def lm_collator(side: str) -> Any:
    return transformers.DataCollatorForLanguageModeling(word_tokenizer(side), mlm=False)


def records(n: int, *, longest_last: bool = True) -> list[dict]:
    """``n`` examples of lengths 3..8 and, last, one of length 14 (the longest)."""
    out = th.token_examples(n - 1, seed=3, min_len=3, max_len=9)
    g = torch.Generator().manual_seed(7)
    last = {"input_ids": torch.randint(1, th.VOCAB, (14,), generator=g).tolist()}
    return [*out, last] if longest_last else [last, *out]


def dp_trainer(
    tmp_path: Path,
    data: list[dict],
    *,
    collator: Any,
    model: nn.Module | None = None,
    privacy: dict | None = None,
    **args: Any,
) -> DPTrainer:
    p = {
        "noise_multiplier": 0.0,
        "target_delta": 1e-3,
        "expected_batch_size": 8,
        "max_grad_norm": 1.0,
        "seed": 1,
    }
    p.update(privacy or {})
    kw = {"max_steps": 1, "per_device_train_batch_size": 8, **SGD}
    kw.update(args)
    return DPTrainer(
        model=th.tiny_gpt2_exact() if model is None else model,
        args=th.training_args(tmp_path, **kw),
        train_dataset=data,
        data_collator=collator,
        privacy_args=PrivacyArguments(**p),
    )


def release(tmp_path: Path, data: list[dict], side: str) -> torch.Tensor:
    """The released sum of one step at sigma = 0 (lr = 1: ``-update * B_exp``); every record
    is in the step (q = 1: expected batch 8 >= N)."""
    model = th.tiny_gpt2_exact()
    start = th.params(model)
    tr = dp_trainer(tmp_path, data, collator=lm_collator(side), model=model)
    tr.train()
    assert len(tr.privacy_engine.accountant) == 1
    after = th.params(tr.model)
    b_exp = tr.dp_optimizer.expected_batch_size
    return torch.cat([(start[n] - after[n]).flatten().double() * b_exp for n in start])


# --------------------------------------------------------------------------------------------
# Position ids from the attention mask
# --------------------------------------------------------------------------------------------


def test_position_ids_from_attention_mask_start_at_each_rows_first_token() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    got = opacus_rc.position_ids_from_attention_mask(mask)
    want = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 1, 2, 3, 4]])
    assert torch.equal(got, want) and got.dtype == torch.long
    assert torch.equal(opacus_rc.position_ids_from_attention_mask(mask.bool()), want)
    with pytest.raises(ValueError, match=r"\(B, T\) attention mask"):
        opacus_rc.position_ids_from_attention_mask(mask[0])


@pytest.mark.parametrize("side", ["left", "right"])
def test_removing_one_record_moves_the_release_by_at_most_c(tmp_path: Path, side: str) -> None:
    """D (8 records, the last the longest) and D minus the last, one step, every record in it.
    Learned positions 0..T-1 for every row moved the other records' gradients with left
    padding: 1.69 C. Positions from the mask: exactly the removed record's clipped gradient."""
    data = records(8)
    full = release(tmp_path / "d", data, side)
    minus = release(tmp_path / "d1", data[:-1], side)
    moved = float((full - minus).norm())
    assert moved <= 1.0 * (1 + 1e-4), moved  # C = 1
    assert moved >= 1.0 * (1 - 1e-4), moved  # the removed record is clipped (its norm > C)


def test_each_records_loss_in_the_batch_equals_its_loss_alone() -> None:
    """The inputs the trainer gives the model (``model_inputs``): each record's mean loss over
    its labelled tokens, left-padded in a batch of 8, equals the same record collated alone."""
    model = th.tiny_gpt2_exact()
    collate = lm_collator("left")
    data = records(8)

    def losses(batch: dict, positions: bool = True) -> torch.Tensor:
        kwargs, labels, _, _ = model_inputs(batch, expand_positions=positions)
        labels = unpadded_next_token_labels(labels, batch["attention_mask"])
        with torch.no_grad():
            logits = model(**kwargs).logits[:, :-1]
        targets = labels[:, 1:]
        per_token = nn.functional.cross_entropy(
            logits.transpose(1, 2), targets, ignore_index=-100, reduction="none"
        )
        return per_token.sum(-1) / (targets != -100).sum(-1)

    model.eval()
    together = losses(collate(data))
    alone = torch.cat([losses(collate([r])) for r in data])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)
    # Without them (the model's default positions 0..T-1 for every row) the shorter records'
    # losses in the batch are not their losses alone.
    default = losses(collate(data), positions=False)
    assert (default[:-1] - alone[:-1]).abs().min() > 1e-3


# --------------------------------------------------------------------------------------------
# The check, engine path
# --------------------------------------------------------------------------------------------


def engine_step(
    model: nn.Module,
    batch: dict,
    *,
    positions: str,
    check: bool = True,
    pad_targets: bool = False,
) -> PrivacyEngine:
    """One private step of a causal LM on ``batch`` (input_ids, attention_mask), with position
    ids ``"mask"`` (from the attention mask), ``"arange"`` (``0..T-1`` per row) or ``"none"``
    (the model's default). A target predicted from a padding position is ignored unless
    ``pad_targets`` (then the last left pad predicts each record's first token)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    engine = PrivacyEngine(accountant="rc")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=4)
    m, o, crit, _ = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        check_batch_independence=check,
    )
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if positions == "mask":
        kwargs["position_ids"] = opacus_rc.position_ids_from_attention_mask(mask)
    elif positions == "arange":
        kwargs["position_ids"] = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    logits = m(**kwargs).logits[:, :-1]
    ignored = mask[:, 1:] == 0
    if not pad_targets:
        ignored = ignored | (mask[:, :-1] == 0)
    targets = ids[:, 1:].masked_fill(ignored, -100)
    loss = crit(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), shape=targets.shape)
    loss.backward()
    o.step()
    return engine


def _padded(side: str) -> dict:
    return lm_collator(side)(records(4))


def test_engine_left_padding_with_learned_positions_is_refused_then_runs_with_mask_positions() -> (
    None
):
    model = th.tiny_gpt2_exact()
    before = th.params(model)
    with pytest.raises(BatchIndependenceError) as err:
        engine_step(model, _padded("left"), positions="none")
    msg = str(err.value)
    assert "left padding with learned absolute positions" in msg
    assert "position_ids_from_attention_mask" in msg and "check_batch_independence=False" in msg
    assert "Nothing was noised or accounted" in msg
    after = th.params(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    engine = engine_step(th.tiny_gpt2_exact(), _padded("left"), positions="mask")
    assert len(engine.accountant) == 1


def test_engine_refuses_a_target_predicted_from_left_padding() -> None:
    """Positions from the mask, but the last left pad's logit predicts each record's first
    token (labels -100 only on padding): its output depends on the batch's padding (1.04 C in
    the neighbouring-dataset harness), and outputs at real tokens cannot show it; the DP
    criterion's first call refuses it before anything is noised or accounted."""
    model = th.tiny_gpt2_exact()
    before = th.params(model)
    with pytest.raises(BatchIndependenceError, match="predicted from padding positions") as err:
        engine_step(model, _padded("left"), positions="mask", pad_targets=True)
    assert "Nothing was noised or accounted" in str(err.value)
    after = th.params(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    # Right padding: the pads predict only ignored labels; the check off lets it run.
    engine_step(th.tiny_gpt2_exact(), _padded("right"), positions="arange", pad_targets=True)
    engine = engine_step(
        th.tiny_gpt2_exact(), _padded("left"), positions="mask", pad_targets=True, check=False
    )
    assert len(engine.accountant) == 1


def test_engine_right_padding_passes_and_adds_no_accounting_step() -> None:
    engine = engine_step(th.tiny_gpt2_exact(), _padded("right"), positions="arange")
    assert len(engine.accountant) == 1  # the one step taken; the check accounts nothing


def test_engine_check_leaves_training_unchanged() -> None:
    """Same seeds, check on and off: the same weights (the check restores buffers and RNG)."""
    out = []
    for check in (True, False):
        model = th.tiny_gpt2_exact()
        torch.manual_seed(5)
        engine_step(model, _padded("right"), positions="arange", check=check)
        out.append(th.params(model))
    assert all(torch.equal(out[0][n], out[1][n]) for n in out[0])


def test_engine_check_holds_dropout_off_and_restores_it() -> None:
    """GPT-2 with dropout 0.3 everywhere passes (its dropout is off during the check, in train
    mode) and trains with its dropout back; a check that kept dropout on would refuse it."""
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=th.VOCAB,
            n_embd=16,
            n_layer=1,
            n_head=2,
            n_positions=32,
            resid_pdrop=0.3,
            embd_pdrop=0.3,
            attn_pdrop=0.3,
            use_cache=False,
        )
    )
    before = {n: m.p for n, m in model.named_modules() if isinstance(m, nn.Dropout)}
    assert len(before) >= 3 and all(p == 0.3 for p in before.values())
    engine = engine_step(model, _padded("right"), positions="arange")
    assert len(engine.accountant) == 1
    after = {n: m.p for n, m in model.named_modules() if isinstance(m, nn.Dropout)}
    assert after == before and model.config.attn_pdrop == 0.3


class BatchMean(nn.Module):
    """Subtracts the batch mean of its input (a batch statistic, as batch normalisation)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.out(h - h.mean(0, keepdim=True))


def _classifier_step(model: nn.Module, *, check: bool) -> PrivacyEngine:
    engine = PrivacyEngine(accountant="rc")
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
    m, o, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        check_batch_independence=check,
    )
    x, y = data[:8]
    crit(m(x), y).backward()
    o.step()
    return engine


def test_engine_batch_statistic_is_refused_and_the_switch_turns_the_check_off() -> None:
    torch.manual_seed(0)
    with pytest.raises(BatchIndependenceError, match="batch normalisation"):
        _classifier_step(BatchMean(), check=True)
    torch.manual_seed(0)
    assert len(_classifier_step(BatchMean(), check=False).accountant) == 1
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    assert len(_classifier_step(plain, check=True).accountant) == 1


def test_engine_check_argument_must_be_bool() -> None:
    model = nn.Linear(4, 3)
    with pytest.raises(TypeError, match="check_batch_independence must be True or False"):
        PrivacyEngine(accountant="rc").make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            clipping="randomized",
            check_batch_independence="yes",
        )


# --------------------------------------------------------------------------------------------
# The check, Trainer path
# --------------------------------------------------------------------------------------------


class ReplacingCollator:
    """Right padding, then row 1 replaced by a copy of row 0 (row count unchanged)."""

    def __call__(self, rows: list[dict]) -> dict:
        batch = th.pad_collate(rows)
        if len(rows) > 1:
            for key in batch:
                batch[key][1] = batch[key][0]
        return batch


def _refused_before_anything(tr: DPTrainer, model: nn.Module, before: dict, match: str) -> None:
    with pytest.raises(BatchIndependenceError, match=match):
        tr.train()
    assert len(tr.privacy_engine.accountant) == 0
    after = th.params(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_trainer_collator_that_replaces_a_row_is_refused(tmp_path: Path) -> None:
    model = th.tiny_gpt2_exact()
    before = th.params(model)
    tr = dp_trainer(tmp_path, records(8), collator=ReplacingCollator(), model=model)
    _refused_before_anything(tr, model, before, "row 1 of the first collated micro-batch")


def test_trainer_neftune_is_refused_and_runs_with_the_check_off(tmp_path: Path) -> None:
    model = th.tiny_gpt2_exact()
    before = th.params(model)
    tr = dp_trainer(
        tmp_path / "on",
        records(8),
        collator=lm_collator("right"),
        model=model,
        neftune_noise_alpha=5.0,
    )
    _refused_before_anything(tr, model, before, "NEFTune")
    tr = dp_trainer(
        tmp_path / "off",
        records(8),
        collator=lm_collator("right"),
        privacy={"check_batch_independence": False},
        neftune_noise_alpha=5.0,
    )
    tr.train()
    assert len(tr.privacy_engine.accountant) == 1


def test_trainer_right_and_left_padding_pass_and_add_no_accounting_step(tmp_path: Path) -> None:
    for side in ("right", "left"):
        tr = dp_trainer(tmp_path / side, records(8), collator=lm_collator(side), max_steps=2)
        tr.train()
        assert tr._batch_independence_checked
        assert len(tr.privacy_engine.accountant) == 2


class ArangePositions:
    """A left-padding LM collator that gives every row positions ``0..T-1`` (a record's
    positions then depend on the longest record of its batch)."""

    def __init__(self) -> None:
        self.inner = lm_collator("left")

    def __call__(self, rows: list[dict]) -> dict:
        batch = self.inner(rows)
        b, t = batch["input_ids"].shape
        batch["position_ids"] = torch.arange(t).expand(b, -1).clone()
        return batch


def test_trainer_position_ids_0_to_t_with_left_padding_are_refused(tmp_path: Path) -> None:
    """The check catches what the positions from the mask fixed: a collator that gives every
    row positions 0..T-1 under left padding."""

    tr = dp_trainer(tmp_path, records(8), collator=ArangePositions())
    with pytest.raises(BatchIndependenceError, match="left padding with learned"):
        tr.train()
    assert len(tr.privacy_engine.accountant) == 0


def test_engine_check_under_fsdp_says_it_did_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under FSDP the check cannot run its extra forwards (collectives on some ranks only); it
    says so in a warning instead of being skipped silently (the FSDP test is our own
    _is_fsdp, forced here: a one-process model without a process group)."""
    import opacus_rc.batch_independence as bi

    monkeypatch.setattr(bi, "_is_fsdp", lambda model: True)
    with pytest.warns(UserWarning, match="does not run under FSDP"):
        engine_step(th.tiny_gpt2_exact(), _padded("right"), positions="arange")


# --------------------------------------------------------------------------------------------
# bf16 mixed precision: accelerate's autocast inside the model's forward (issue 34)
# --------------------------------------------------------------------------------------------


class InnerAutocast(nn.Module):
    """Enters a bfloat16 autocast inside its own forward, as accelerate's ``prepare_model``
    wraps ``model.forward`` under ``bf16=True``; ``leak`` times the batch mean of the hidden
    layer is subtracted (0: each row depends on itself alone)."""

    def __init__(self, *, leak: float = 0.0, width: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(4, width)
        self.out = nn.Linear(width, 3)
        self.leak = leak

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.tanh(self.fc(x))
            return self.out(h - self.leak * h.mean(0, keepdim=True)).float()


def test_independence_forward_turns_off_an_autocast_entered_inside_the_forward() -> None:
    """Inside the check's context the forward computes in float32 (equal to the model run
    without autocast) although it enters a bfloat16 autocast itself; outside, the same forward
    is bfloat16 again and the autocast state is what it was."""
    torch.manual_seed(0)
    model, x = InnerAutocast(), torch.randn(5, 4)
    plain = model.out(torch.tanh(model.fc(x)))  # float32, no autocast anywhere
    with independence_forward(model):
        inside = model(x)
    torch.testing.assert_close(inside, plain.detach(), rtol=0, atol=0)
    outside = model(x)
    assert (outside - plain).abs().max() > 1e-4  # bfloat16 rounding outside the check
    assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with independence_forward(model):
            assert not torch.is_autocast_enabled("cpu")
            torch.testing.assert_close(model(x), plain.detach(), rtol=0, atol=0)
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_engine_inner_bf16_autocast_passes_and_a_small_dependence_is_still_refused() -> None:
    """A correct model whose forward enters a bfloat16 autocast is checked in float32 and
    trains; one whose rows move by 1% of a batch mean (below a bfloat16 tolerance,
    ``sqrt(2**-7)`` = 9% of the outputs' scale) is refused."""
    torch.manual_seed(0)
    assert len(_classifier_step(InnerAutocast(), check=True).accountant) == 1
    torch.manual_seed(0)
    with pytest.raises(BatchIndependenceError, match="record"):
        _classifier_step(InnerAutocast(leak=0.01), check=True)


def llama_d32() -> nn.Module:
    """A one-block Llama with ``d = 32``: wide enough that a bfloat16 autocast's batched and
    single-record products round differently (``2**-10`` on its logits, above the float32
    tolerance ``3.5e-4``)."""
    cfg = transformers.LlamaConfig(
        vocab_size=th.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        use_cache=False,
        pad_token_id=th.PAD,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_trainer_bf16_mixed_precision_trains_checked_in_float32(tmp_path: Path) -> None:
    """``TrainingArguments(bf16=True)``: accelerate runs the training forwards in a bfloat16
    autocast inside the model's forward; the check's forwards run in float32 (before: refused
    at the first batch, ``max |difference| 0.000977, rounding tolerance 0.000345``)."""
    model = llama_d32()
    dtypes: dict[bool, set] = {True: set(), False: set()}
    model.lm_head.register_forward_hook(
        lambda m, i, o: dtypes[torch.is_grad_enabled()].add(o.dtype)
    )
    data = th.token_examples(16, seed=0, min_len=4, max_len=30)
    tr = dp_trainer(tmp_path, data, collator=th.pad_collate, model=model, bf16=True, max_steps=2)
    tr.train()
    assert tr._batch_independence_checked
    assert len(tr.privacy_engine.accountant) == 2
    assert dtypes[True] == {torch.bfloat16}  # training: accelerate's autocast
    assert dtypes[False] == {torch.float32}  # the check: without autocast


def test_trainer_bf16_still_refuses_positions_that_depend_on_the_batch(tmp_path: Path) -> None:
    """With ``bf16=True`` as without: positions ``0..T-1`` for every row under left padding
    make a record's outputs depend on the longest record; refused before anything."""

    model = th.tiny_gpt2_exact()
    before = th.params(model)
    tr = dp_trainer(tmp_path, records(8), collator=ArangePositions(), model=model, bf16=True)
    _refused_before_anything(tr, model, before, "left padding with learned")
