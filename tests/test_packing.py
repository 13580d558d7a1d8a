"""Packed batches (opacus_rc.packing, issue 32): the packing itself, the block-diagonal mask,
and tiny random Llama and GPT-2 (learned absolute positions) giving each record of a packed
row what it gets alone.

Oracle: each record (each segment of a record cut across rows) run alone through the same
model, float64. "Alone" has no attention mask and positions 0..l-1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_hf_models as hf  # noqa: E402

from opacus_rc.batch_independence import BatchIndependenceError  # noqa: E402
from opacus_rc.grad_sample.packed import (  # noqa: E402
    RecordLayout,
    linear_record_clipped_sum,
    linear_record_sqnorms,
)
from opacus_rc.packing import (  # noqa: E402
    IGNORE_INDEX,
    PackingCollator,
    block_diagonal_attention_mask,
    check_records_independent,
    pack_records,
    record_ids_from_position_ids,
    record_losses,
    record_segments,
)

VOCAB = 40
#: Ragged records; with max_length 16, rows hold several records and the 20-token record is cut.
LENGTHS = (5, 9, 3, 12, 7, 20, 2)
MAX_LENGTH = 16


def _records(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]


def _model(arch: str, attn: str) -> torch.nn.Module:
    if arch == "llama":
        model = hf.llama(vocab=VOCAB, tie=False, layers=2, attn_implementation=attn)
    else:
        model = hf.gpt2(vocab=VOCAB, tie=False, attn_implementation=attn)
    return model.double().train()


# ----------------------------------------------------------------------------------------------
# pack_records and the mask
# ----------------------------------------------------------------------------------------------


def test_pack_records_layout() -> None:
    recs = _records()
    labels = [r.clone() for r in recs]
    labels[1][:4] = IGNORE_INDEX  # a prompt left out of the loss
    pb = pack_records(recs, max_length=MAX_LENGTH, pad_token_id=0, labels=labels)
    R, T = pb.input_ids.shape
    assert T <= MAX_LENGTH and pb.num_records == len(recs)
    assert sum(LENGTHS) <= R * T < sum(LENGTHS) + R * MAX_LENGTH
    assert pb.segments.tolist() == [1, 1, 1, 1, 1, 2, 1]
    segs = record_segments(pb.record_ids)
    for i, rec in enumerate(recs):
        where = pb.record_ids == i
        order = torch.argsort(pb.token_index[where])
        assert torch.equal(pb.input_ids[where][order], rec)  # every token, once, in order
        mine = [s for s in segs if s[0] == i]
        assert len(mine) == int(pb.segments[i])
        assert len({row for _, row, _, _ in mine}) == len(mine)  # one segment per row
        for _, row, a, b in mine:
            assert pb.position_ids[row, a:b].tolist() == list(range(b - a))
            assert int(pb.labels[row, a]) == IGNORE_INDEX  # not predicted across a boundary
            k = pb.token_index[row, a:b]
            assert torch.equal(pb.labels[row, a + 1 : b], labels[i][k[1:]])
    pad = pb.record_ids < 0
    assert bool((pb.input_ids[pad] == 0).all()) and bool((pb.labels[pad] == IGNORE_INDEX).all())
    assert torch.equal(pb.attention_mask, (~pad).long())
    assert pb.record_units.tolist() == list(range(len(recs)))


def test_pack_records_refusals() -> None:
    with pytest.raises(ValueError, match="max_length"):
        pack_records([[1]], max_length=0, pad_token_id=0)
    with pytest.raises(ValueError, match="empty"):
        pack_records([[1], []], max_length=4, pad_token_id=0)
    with pytest.raises(ValueError, match=r"labels\[0\] has 1 entries"):
        pack_records([[1, 2]], max_length=4, pad_token_id=0, labels=[[1]])
    with pytest.raises(ValueError, match="units"):
        pack_records([[1], [2]], max_length=4, pad_token_id=0, units=[0])


def test_block_diagonal_mask_definition() -> None:
    rid = pack_records(_records(), max_length=MAX_LENGTH, pad_token_id=0).record_ids
    mask = block_diagonal_attention_mask(rid, dtype=torch.bool)
    additive = block_diagonal_attention_mask(rid, dtype=torch.float32)
    R, T = rid.shape
    assert mask.shape == (R, 1, T, T) and additive.dtype == torch.float32
    assert torch.equal(additive == 0, mask)
    assert bool((additive[~mask] == torch.finfo(torch.float32).min).all())
    for r in range(R):
        for q in range(T):
            for k in range(T):
                want = (k <= q and rid[r, q] >= 0 and rid[r, q] == rid[r, k]) or q == k
                assert bool(mask[r, 0, q, k]) == want, (r, q, k)
    with pytest.raises(ValueError, match="floating dtype"):
        block_diagonal_attention_mask(rid, dtype=torch.long)


# ----------------------------------------------------------------------------------------------
# Tiny Llama and GPT-2: each record inside the pack equals the record alone
# ----------------------------------------------------------------------------------------------


def _alone_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of one segment run alone (positions 0..l-1, no mask)."""
    logits = model(input_ids=ids[None]).logits
    return record_losses(logits, labels[None], torch.zeros_like(ids)[None], num_records=1).squeeze(
        0
    )


def _segment_inputs(pb, record: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, labels) of each segment of ``record``, as the pack holds them."""
    return [
        (pb.input_ids[row, a:b], pb.labels[row, a:b])
        for r, row, a, b in record_segments(pb.record_ids)
        if r == record
    ]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_records_equal_records_alone(arch: str, attn: str) -> None:
    model = _model(arch, attn)
    pb = pack_records(_records(), max_length=MAX_LENGTH, pad_token_id=0)
    inputs = pb.model_inputs(dtype=torch.float64)
    check = check_records_independent(model, {**inputs, "record_ids": pb.record_ids})
    assert len(check.segments) == sum(pb.segments.tolist())
    assert check.max_difference <= check.tolerance
    with torch.no_grad():
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        packed = record_losses(logits, pb.labels, pb.record_ids, num_records=pb.num_records)
        for r in range(pb.num_records):
            alone = sum(_alone_loss(model, ids, lab) for ids, lab in _segment_inputs(pb, r))
            torch.testing.assert_close(packed[r], alone, rtol=1e-6, atol=1e-9)
        # Hugging Face's own loss over the pack is the records' summed losses over their
        # counted targets (nothing predicted across a boundary or from padding).
        counted = int((pb.labels[:, 1:] != IGNORE_INDEX).sum())
        hf_loss = model(**inputs).loss
        # (its cross-entropy runs in float32)
        torch.testing.assert_close(hf_loss.double() * counted, packed.sum(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_padding_free_inputs_keep_records_apart(arch: str) -> None:
    # transformers >= 5 builds the block mask from restarting position ids when
    # attention_mask is None (masking_utils.find_packed_sequence_indices).
    model = _model(arch, "sdpa")
    pb = pack_records(_records(), max_length=MAX_LENGTH, pad_token_id=0)
    inputs = pb.model_inputs(padding_free=True)
    assert "attention_mask" not in inputs
    check = check_records_independent(model, {**inputs, "record_ids": pb.record_ids})
    assert check.max_difference <= check.tolerance


def _layer(model: torch.nn.Module, arch: str) -> torch.nn.Linear:
    if arch == "llama":
        return model.model.layers[0].mlp.down_proj
    return model.lm_head


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_per_record_norms_and_clipped_sum_equal_records_alone(arch: str) -> None:
    # The premise of per-record clipping in a pack: record r's output-gradient rows inside the
    # pack are those of r alone, so a layer's per-record norm from the packed (A, G) is the
    # norm of r's own gradient, and the one-pass clipped sum is the float64 sum of each
    # record's own clipped gradient (sigma = 0 release of that layer).
    model = _model(arch, "sdpa")
    layer = _layer(model, arch)
    pb = pack_records(_records(), max_length=MAX_LENGTH, pad_token_id=0)
    n = pb.num_records

    alone = []
    for r in range(n):
        model.zero_grad()
        loss = sum(_alone_loss(model, ids, lab) for ids, lab in _segment_inputs(pb, r))
        loss.backward()
        alone.append(layer.weight.grad.detach().clone())

    saved = {}
    fwd = layer.register_forward_hook(lambda m, i, o: saved.__setitem__("A", i[0].detach()))
    bwd = layer.register_full_backward_hook(
        lambda m, gi, go: saved.__setitem__("G", go[0].detach())
    )
    try:
        inputs = pb.model_inputs(dtype=torch.float64)
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        losses = record_losses(logits, pb.labels, pb.record_ids, num_records=n)
        model.zero_grad()
        losses.sum().backward()
    finally:
        fwd.remove()
        bwd.remove()
    A, G = saved["A"], saved["G"]
    layout = RecordLayout.from_record_ids(pb.record_ids, chunk_size=4)
    norms, _ = linear_record_sqnorms(A, G, layout=layout)
    torch.testing.assert_close(
        norms, torch.stack([g.pow(2).sum() for g in alone]), rtol=1e-9, atol=0
    )
    C = 0.5 * float(norms.sqrt().median())
    coef = (C / (norms.sqrt() + 1e-6)).clamp(max=1.0)
    assert float(coef.min()) < 1.0 and float(coef.max()) == 1.0  # some clipped, some not
    weight, _ = linear_record_clipped_sum(A, G, record_ids=pb.record_ids, coef=coef)
    torch.testing.assert_close(
        weight, sum(c * g for c, g in zip(coef, alone)), rtol=1e-9, atol=1e-12
    )


# ----------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_mask_crossing_records_is_refused(arch: str) -> None:
    model = _model(arch, "sdpa")
    pb = pack_records(_records(), max_length=MAX_LENGTH, pad_token_id=0)
    R, T = pb.input_ids.shape
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(R, 1, T, T)  # crosses records
    inputs = {"input_ids": pb.input_ids, "position_ids": pb.position_ids}
    with pytest.raises(BatchIndependenceError, match="attention crosses records.*block_diagonal"):
        check_records_independent(
            model, {**inputs, "attention_mask": causal}, record_ids=pb.record_ids
        )
    # A 2D padding mask: the model builds one causal mask over the whole row.
    with pytest.raises(BatchIndependenceError, match="other logits alone than inside"):
        check_records_independent(
            model, {**inputs, "attention_mask": pb.attention_mask}, record_ids=pb.record_ids
        )


def test_mask_letting_records_see_padding_is_refused() -> None:
    model = _model("llama", "sdpa")
    pb = pack_records(_records(), max_length=MAX_LENGTH, pad_token_id=0)
    mask = block_diagonal_attention_mask(pb.record_ids, dtype=torch.bool).clone()
    row, t = (int(v) for v in (pb.record_ids < 0).nonzero()[0])
    mask[row, 0, t - 1 :, t] = True  # the last real token before padding sees a padding token
    with pytest.raises(BatchIndependenceError, match="attends token .* of padding"):
        check_records_independent(
            model,
            {"input_ids": pb.input_ids, "attention_mask": mask, "record_ids": pb.record_ids},
        )


def test_positions_not_restarting_are_refused_for_learned_positions() -> None:
    # GPT-2 learns absolute positions: a record placed after another one in the row, with
    # positions 0..T-1, gets other logits than alone.
    model = _model("gpt2", "sdpa")
    pb = pack_records(_records(), max_length=MAX_LENGTH, pad_token_id=0)
    R, T = pb.input_ids.shape
    inputs = pb.model_inputs(dtype=torch.float64)
    inputs["position_ids"] = torch.arange(T).expand(R, T)
    with pytest.raises(BatchIndependenceError, match="positions that do not restart"):
        check_records_independent(model, {**inputs, "record_ids": pb.record_ids})


def test_check_needs_record_ids() -> None:
    model = _model("llama", "sdpa")
    with pytest.raises(ValueError, match="needs record_ids"):
        check_records_independent(model, {"input_ids": torch.ones(1, 3, dtype=torch.long)})


# ----------------------------------------------------------------------------------------------
# The collator
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding_free", [False, True])
def test_packing_collator(padding_free: bool) -> None:
    recs = _records()
    examples = [
        {"input_ids": r.tolist(), "unit": i // 2} if i % 3 else r.tolist()
        for i, r in enumerate(recs)
    ]
    collate = PackingCollator(
        max_length=MAX_LENGTH, pad_token_id=0, padding_free=padding_free, mask_dtype=torch.float64
    )
    batch = collate(examples)
    pb = pack_records(recs, max_length=MAX_LENGTH, pad_token_id=0)
    assert torch.equal(batch["input_ids"], pb.input_ids)
    assert torch.equal(batch["record_ids"], pb.record_ids)
    assert batch["record_units"].tolist() == [i // 2 if i % 3 else i for i in range(len(recs))]
    assert ("attention_mask" in batch) is not padding_free
    model = _model("gpt2", "sdpa")
    check = check_records_independent(model, batch)
    assert check.max_difference <= check.tolerance
    with pytest.raises(ValueError, match="no 'input_ids'"):
        collate([{"ids": [1]}])


def test_record_ids_from_trl_padding_free_position_ids() -> None:
    # TRL's padding-free collator: one row, positions restarting at each example.
    trl = pytest.importorskip("trl")
    collate = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(
        pad_token_id=0, padding_free=True
    )
    recs = [r.tolist() for r in _records() if r.numel() <= MAX_LENGTH]
    batch = collate([{"input_ids": r} for r in recs])
    rid = record_ids_from_position_ids(batch["position_ids"])
    assert rid.shape == batch["input_ids"].shape
    assert torch.equal(torch.bincount(rid.reshape(-1)), torch.tensor([len(r) for r in recs]))
    for i, r in enumerate(recs):
        assert batch["input_ids"][rid == i].tolist() == r
    padded = record_ids_from_position_ids(
        torch.tensor([[0, 1, 2, 0, 1, 0, 0]]), padding_mask=torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
    )
    assert padded.tolist() == [[0, 0, 0, 1, 1, -1, -1]]
    with pytest.raises(ValueError, match="continues a record"):
        record_ids_from_position_ids(torch.tensor([[3, 4, 0, 1]]))


def test_check_of_a_few_segments_takes_those_after_another_record() -> None:
    # With max_segments, the segments not at the start of their row go first: they are the
    # ones a crossing mask would let see another record.
    model = _model("gpt2", "sdpa")
    pb = pack_records(_records(), max_length=MAX_LENGTH, pad_token_id=0)
    batch = {**pb.model_inputs(dtype=torch.float64), "record_ids": pb.record_ids}
    check = check_records_independent(model, batch, max_segments=2)
    assert len(check.segments) == 2 and all(start > 0 for _, _, start, _ in check.segments)
    R, T = pb.input_ids.shape
    batch["attention_mask"] = torch.ones(R, T, dtype=torch.long)  # 2D: crosses records
    with pytest.raises(BatchIndependenceError):
        check_records_independent(model, batch, max_segments=1)


def test_record_losses_mean_is_each_records_mean_token_loss() -> None:
    # reduction="mean": each record's cross-entropy averaged over its own counted targets,
    # as nn.CrossEntropyLoss gives the record alone.
    torch.manual_seed(0)
    recs = _records()
    pb = pack_records(recs, max_length=MAX_LENGTH, pad_token_id=0)
    logits = torch.randn(*pb.input_ids.shape, VOCAB, dtype=torch.float64)
    got = record_losses(
        logits, pb.labels, pb.record_ids, num_records=pb.num_records, reduction="mean"
    )
    for r in range(pb.num_records):
        tokens, targets = [], []
        for _, row, a, b in (s for s in record_segments(pb.record_ids) if s[0] == r):
            tokens.append(logits[row, a : b - 1])
            targets.append(pb.labels[row, a + 1 : b])
        want = torch.nn.functional.cross_entropy(torch.cat(tokens), torch.cat(targets))
        torch.testing.assert_close(got[r], want, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="reduction"):
        record_losses(logits, pb.labels, pb.record_ids, num_records=1, reduction="none")
