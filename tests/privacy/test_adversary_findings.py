"""Violations of the guarantee found by an adversarial pass over issue 30's paths.

Each test runs one step on ``D`` and on ``D`` minus its last record with the same seeds at
``sigma = 0`` (the helpers of :mod:`tests.privacy.neighbouring`) and asserts what the README
and docs/privacy/mechanism.md promise. Each was ``xfail(strict=True)`` until its violation
was fixed or refused; all four are now refused before anything is noised or accounted, and the
tests assert the refusals (with the controls that pass).
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.privacy import neighbouring as nb  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:noise_multiplier=0"),
    pytest.mark.filterwarnings("ignore:RCAccountant recorded a step without noise"),
    pytest.mark.filterwarnings("ignore:PrivacyArguments.seed"),
    pytest.mark.filterwarnings("ignore:PrivacyArguments.sketch_seed"),
    pytest.mark.filterwarnings("ignore:epsilon cannot be computed"),
]

C = 0.1


# ---------------------------------------------------------------------------------------------
# 1. Sequence classification (BERT, [CLS] pooling) with left padding, micro-batched
# ---------------------------------------------------------------------------------------------

#: Records 0-3 (the first micro-batch of 4) have the same length: no padding, so the
#: first-step check compares equal things and passes. Records 4-6 are short and share a
#: label; record 7, the removed one, is the longest: it sets the padding of the second
#: micro-batch (4-7). Under left padding BERT's pooler reads position 0, a pad for 4-6.
BERT_LENGTHS = [6, 6, 6, 6, 2, 2, 2, 16]
BERT_LABELS = [0, 1, 0, 1, 1, 1, 1, 1]


def _bert_records(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(nb.N_RECORDS):
        ids = torch.randint(3, nb.LM_VOCAB, (BERT_LENGTHS[i],), generator=g).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": BERT_LABELS[i]})
    return out[:n]


def _bert_left_padded_step(*, neighbour: bool, side: str) -> nb.Release:
    """``DPTrainer`` on a BERT classifier (only the pooler and the head trained: exact norms),
    ``DataCollatorWithPadding`` with the tokenizer's ``padding_side``, ``q = 1`` (every record
    in the step), micro-batches of 4."""
    import tiny_hf_models as hf
    from transformers import DataCollatorWithPadding

    from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments

    tok = nb._word_tokenizer()
    tok.padding_side = side
    model = hf.bert_classifier(vocab=nb.LM_VOCAB, pad_token_id=nb.PAD)
    for name, p in model.named_parameters():
        if not name.startswith(("bert.pooler", "classifier")):
            p.requires_grad_(False)
    nb.add_probe(model)
    n = nb.N_RECORDS - int(neighbour)
    with tempfile.TemporaryDirectory() as tmp:
        tr = DPTrainer(
            model=model,
            args=nb._trainer_args(tmp, per_device_train_batch_size=4),
            train_dataset=_bert_records(n),
            data_collator=DataCollatorWithPadding(tok),
            privacy_args=PrivacyArguments(
                noise_multiplier=0.0,
                target_delta=1e-3,
                max_grad_norm=C,
                expected_batch_size=nb.N_RECORDS,
                seed=nb.TRAINER_SEED,
                dataset_size=nb.N_RECORDS,
            ),
        )
        return nb._train_one_step(tr, None)


def test_bert_right_padding_micro_batched_is_within_c() -> None:
    # The control: the same step with right padding moves the release by C (1.000 C).
    a = _bert_left_padded_step(neighbour=False, side="right")
    b = _bert_left_padded_step(neighbour=True, side="right")
    assert nb.N_RECORDS - 1 in a.sampled and len(b.sampled) == nb.N_RECORDS - 1
    d = nb.release_distance(a, b)
    assert 0.5 * C <= d <= nb.sensitivity_bound(max_grad_norm=C, sketch_dim=None, others=7)


def test_bert_left_padding_in_a_later_micro_batch_is_refused() -> None:
    """BERT [CLS] pooling under left padding: position 0 is a pad for short records, so their
    loss depends on the longest record of their micro-batch (1.264 C measured when the check
    saw only the first micro-batch, which here has no padding). Now the check waits for a
    padded micro-batch: D's second one is refused; D-1's (equal lengths) trains."""
    from opacus_rc.batch_independence import BatchIndependenceError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BatchIndependenceError):
            _bert_left_padded_step(neighbour=False, side="left")
        b = _bert_left_padded_step(neighbour=True, side="left")
    assert len(b.sampled) == nb.N_RECORDS - 1


# ---------------------------------------------------------------------------------------------
# 2. The engine with Opacus' BatchMemoryManager: GPT-2, left padding, no position ids
# ---------------------------------------------------------------------------------------------

#: The first physical batch (records 0-3) has no padding; records 4-6 are short, 7 (removed)
#: the longest, in the second physical batch of the same logical step.
GPT2_LENGTHS = [6, 6, 6, 6, 2, 2, 2, 16]


def _engine_physical_batches_step(*, neighbour: bool, physical: int) -> nb.Release:
    """The engine on GPT-2 (learned positions, ``wpe`` frozen so that Opacus #841's refusal
    does not apply), left padding, no ``position_ids`` passed (the model's default ``0..T-1``),
    no target predicted from padding, ``q = 1``, one logical batch split by Opacus'
    ``BatchMemoryManager`` into physical batches of ``physical`` records."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager
    from torch.utils.data import DataLoader

    from opacus_rc.integrations.per_sample_loss import per_sample_cross_entropy

    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, nb.LM_VOCAB, (n,), generator=g).tolist() for n in GPT2_LENGTHS]
    n = nb.N_RECORDS - int(neighbour)
    model, _ = nb.lm_model("gpt2")
    model.transformer.wpe.weight.requires_grad_(False)

    def collate(rows: list) -> tuple[dict, torch.Tensor]:
        batch = nb.pad_batch([r[0] for r in rows], side="left", ignore_pad_targets=True)
        return batch, torch.tensor([r[1] for r in rows], dtype=torch.long)

    loader = DataLoader(
        nb.Indexed(seqs[:n]),
        batch_size=nb.N_RECORDS,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(1),
    )
    engine, m, opt, crit, dl = nb._make_private(
        model,
        loader,
        noise_multiplier=0.0,
        max_grad_norm=C,
        sketch_dim=2,
        dataset_size=nb.N_RECORDS,
    )
    before = nb.trainable(m)
    sampled: list[int] = []
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=physical, optimizer=opt) as mem:
        for batch, idx in mem:
            sampled += idx.tolist()
            labels = batch.pop("labels")
            per_sample_cross_entropy(crit, m(**batch).logits, labels, shift=True).backward()
            opt.step()
            opt.zero_grad()
            if len(engine.accountant.history):
                break
    return nb.release_of_sgd_step(
        before,
        m,
        nb._engine_mechanism(engine, dl, opt, dl.sample_rate),
        sampled,
        None,
        nb.N_RECORDS - 1,
    )


def test_engine_left_padding_without_positions_is_refused_in_one_physical_batch() -> None:
    # The control: with the whole logical batch in one physical batch, the check refuses.
    from opacus_rc.batch_independence import BatchIndependenceError

    with pytest.raises(BatchIndependenceError):
        _engine_physical_batches_step(neighbour=False, physical=nb.N_RECORDS)


def test_engine_left_padding_in_a_later_physical_batch_is_refused() -> None:
    """Before: the engine's check ran on the first physical batch only (here without padding);
    the second physical batch of the same step, left-padded to the removed record's length with
    positions 0..T-1, moved the release by 1.384 C. Now the check waits for a padded batch:
    D's second physical batch is refused; D-1's (records of equal length) trains."""
    from opacus_rc.batch_independence import BatchIndependenceError

    with pytest.raises(BatchIndependenceError, match="left padding with learned"):
        _engine_physical_batches_step(neighbour=False, physical=4)
    b = _engine_physical_batches_step(neighbour=True, physical=4)
    assert nb.N_RECORDS - 1 not in b.sampled and len(b.sampled) == nb.N_RECORDS - 1


# ---------------------------------------------------------------------------------------------
# 3. Encoder-decoder (T5) through DPTrainer
# ---------------------------------------------------------------------------------------------

#: Source and target lengths; the longest (8) is the last record, so ``D``'s batch of 8 is
#: padded to 8 and ``D - 1``'s batch of 7 to 7: the batch size equals the padded length.
T5_LENGTHS = [3, 4, 5, 6, 7, 5, 4, 8]


def _t5() -> torch.nn.Module:
    import transformers

    cfg = transformers.T5Config(
        vocab_size=nb.LM_VOCAB,
        d_model=16,
        d_kv=8,
        d_ff=24,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=0,
        decoder_start_token_id=0,
        eos_token_id=1,
        use_cache=False,
        relative_attention_num_buckets=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg)
    model.shared.weight.requires_grad_(False)  # tied to both embeddings: refused otherwise
    return nb.add_probe(model)


def _t5_records(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [
        {
            "input_ids": torch.randint(3, nb.LM_VOCAB, (n_,), generator=g).tolist(),
            "labels": torch.randint(3, nb.LM_VOCAB, (n_,), generator=g).tolist(),
        }
        for n_ in T5_LENGTHS
    ][:n]


def _t5_collate(rows: list[dict], *, decoder_inputs: bool = True) -> dict:
    def pad(seqs: list[list[int]], value: int) -> torch.Tensor:
        t = max(len(s) for s in seqs)
        return torch.tensor([s + [value] * (t - len(s)) for s in seqs])

    ids = pad([r["input_ids"] for r in rows], 0)
    labels = pad([r["labels"] for r in rows], -100)
    out = {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}
    if decoder_inputs:
        start = torch.zeros(len(rows), 1, dtype=torch.long)
        out["decoder_input_ids"] = torch.cat([start, labels[:, :-1].clamp(min=0)], 1)
    return out


def _t5_trainer(tmp: str, *, n: int, decoder_inputs: bool, batch: int) -> object:
    from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments

    return DPTrainer(
        model=_t5(),
        args=nb._trainer_args(tmp, per_device_train_batch_size=batch),
        train_dataset=_t5_records(n),
        data_collator=lambda rows: _t5_collate(rows, decoder_inputs=decoder_inputs),
        privacy_args=PrivacyArguments(
            noise_multiplier=0.0,
            target_delta=1e-3,
            max_grad_norm=C,
            expected_batch_size=nb.N_RECORDS,
            sketch_dim=nb.LARGE_K,
            sketch_seed=3,
            seed=nb.TRAINER_SEED,
            dataset_size=nb.N_RECORDS,
        ),
    )


def test_t5_relative_bias_is_refused_when_the_batch_is_not_the_length() -> None:
    # The control: T5's relative_attention_bias embedding takes (T, T) bucket ids, broadcast
    # over the batch (Opacus #841): at a batch of 7 padded to 8 the library refuses.
    with tempfile.TemporaryDirectory() as tmp:
        tr = _t5_trainer(tmp, n=nb.N_RECORDS, decoder_inputs=True, batch=7)
        with pytest.raises(ValueError, match="no batch axis of size 1"):
            tr.train()


def test_t5_relative_bias_is_refused_when_the_batch_equals_the_length() -> None:
    # Before: at 8 records padded to 8 the (T, T) bucket ids passed the batch-size check and
    # the bias was clipped per query position, silently. The check's one-record forwards now
    # see the module's input batch axis of T, not 1, whatever B.
    with tempfile.TemporaryDirectory() as tmp:
        tr = _t5_trainer(tmp, n=nb.N_RECORDS, decoder_inputs=True, batch=nb.N_RECORDS)
        with pytest.raises(ValueError, match="no batch axis of size 1"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr.train()


def test_t5_without_decoder_inputs_gets_a_clear_error() -> None:
    # Before: "You must specify exactly one of input_ids or inputs_embeds" from inside T5 (the
    # trainer pops labels, so the model cannot build its decoder inputs from them).
    with tempfile.TemporaryDirectory() as tmp:
        tr = _t5_trainer(tmp, n=nb.N_RECORDS, decoder_inputs=False, batch=4)
        with (
            pytest.raises(ValueError, match="DataCollatorForSeq2Seq") as info,
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            tr.train()
        assert "decoder_input_ids" in str(info.value)
        assert len(tr.privacy_engine.accountant) == 0
