"""The varlen SDPA over packed records (opacus_rc/packed_attention.py) and the
packed-attention guard's check of a varlen attention (opacus_rc/packed_loss.py).

Oracles: a tiny random float64 Llama (two layers, grouped-query attention: two query heads,
one key/value head) run (a) on the packed rows with ``attn_implementation="sdpa"`` and the 4D
block-diagonal mask, and (b) on each record segment alone, unpadded, at positions ``0..l-1``.
The varlen attention must give the same logits and the same per-record gradients at ``1e-10``
(float64: only the order of the sums differs; a record that saw another record would move
by ``O(1)``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_hf_models as hf  # noqa: E402
from test_packed_loss import _private, record_grads, records  # noqa: E402

from opacus_rc.batch_independence import BatchIndependenceError  # noqa: E402
from opacus_rc.packed_attention import (  # noqa: E402
    PACKED_SDPA,
    packed_sdpa_attention_forward,
    register_packed_sdpa,
    segment_starts,
)
from opacus_rc.packed_loss import check_varlen_segments  # noqa: E402
from opacus_rc.packing import IGNORE_INDEX, pack_records, record_segments  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:a sketch_generator was passed:UserWarning"),
    pytest.mark.filterwarnings("ignore:noise_multiplier=0"),
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
]

VOCAB = 40
MAX_LENGTH = 16
TOL = 1e-10


def llama(*, varlen: bool, layers: int = 2, **config: Any) -> nn.Module:
    model = hf.llama(vocab=VOCAB, tie=True, layers=layers, pad_token_id=0, **config)
    if varlen:
        model.set_attn_implementation(register_packed_sdpa())
    return model.double().train()


def packed_batch() -> Any:
    packed = pack_records(records(), max_length=MAX_LENGTH, pad_token_id=0)
    assert int(packed.segments.max()) == 2  # a record cut across two rows
    assert bool((packed.record_ids < 0).any())  # padding
    return packed


def per_record_grads(model: nn.Module, inputs: dict, packed: Any) -> torch.Tensor:
    """``(N, P)``: each record's mean next-token loss inside the pack, its gradient."""
    params = [p for p in model.parameters() if p.requires_grad]
    labels = packed.labels
    rid = packed.record_ids
    out = []
    for r in range(packed.num_records):
        logits = model(**inputs).logits
        target = labels[:, 1:]
        keep = (target != IGNORE_INDEX) & (rid[:, :-1] == r)
        tok = nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), target.clamp(min=0).reshape(-1), reduction="none"
        )
        loss = tok[keep.reshape(-1)].sum() / keep.sum()
        out.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
    return torch.stack(out)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=TOL, atol=TOL * max(1.0, float(b.abs().max())))


def test_register_is_on_demand_and_idempotent() -> None:
    # Importing the module registers nothing (a fresh interpreter); the call registers once.
    code = (
        "import opacus_rc.packed_attention as pa\n"
        "from transformers import AttentionInterface, AttentionMaskInterface\n"
        "assert pa.PACKED_SDPA not in AttentionInterface._global_mapping\n"
        "assert pa.PACKED_SDPA not in AttentionMaskInterface._global_mapping\n"
        "assert pa.register_packed_sdpa() == pa.register_packed_sdpa() == pa.PACKED_SDPA\n"
        "assert AttentionInterface._global_mapping[pa.PACKED_SDPA] is "
        "pa.packed_sdpa_attention_forward\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root, timeout=300)


def test_logits_and_record_gradients_equal_block_mask_and_records_alone() -> None:
    packed = packed_batch()
    varlen, sdpa = llama(varlen=True), llama(varlen=False)
    assert varlen.config._attn_implementation == PACKED_SDPA
    assert sdpa.config._attn_implementation == "sdpa"
    free = packed.model_inputs(padding_free=True)
    free.pop("labels")
    masked = packed.model_inputs(dtype=torch.float64)
    masked.pop("labels")
    real = packed.record_ids >= 0
    with torch.no_grad():
        got = varlen(**free).logits
        close(got[real], sdpa(**masked).logits[real])
        for _, row, start, end in record_segments(packed.record_ids):
            ids = packed.input_ids[row : row + 1, start:end]
            alone = sdpa(input_ids=ids, position_ids=torch.arange(end - start)[None]).logits
            close(got[row, start:end], alone[0])
        # Positions over the whole row: one causal record per row, not the records.
        whole = dict(free, position_ids=torch.arange(free["input_ids"].shape[1])[None])
        assert float((varlen(**whole).logits - got)[real].abs().max()) > 1e-3
    g_varlen = per_record_grads(varlen, free, packed)
    close(g_varlen, per_record_grads(sdpa, masked, packed))
    close(g_varlen, record_grads(sdpa, packed, torch.arange(packed.num_records)))


def test_cu_seq_lens_of_a_flattened_batch_give_the_records() -> None:
    # transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True): one row,
    # restarting position ids and cu_seq_lens_q / _k over the records.
    recs = [r for r in records() if r.numel() <= MAX_LENGTH]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collate([{"input_ids": r.tolist()} for r in recs])
    assert "cu_seq_lens_q" in batch and batch["input_ids"].shape[0] == 1
    batch.pop("labels")
    varlen, sdpa = llama(varlen=True), llama(varlen=False)
    with torch.no_grad():
        got = varlen(**batch).logits[0]
        at = 0
        for r in recs:
            n = r.numel()
            alone = sdpa(input_ids=r[None], position_ids=torch.arange(n)[None]).logits[0]
            close(got[at : at + n], alone)
            at += n
        # The records come from cu_seq_lens when given: positions over the whole row with the
        # same cu_seq_lens keep the records apart (rotary: equal up to float32 cos/sin rounding
        # at other positions), where a causal row would move them by O(1).
        whole = dict(batch, position_ids=torch.arange(at)[None])
        torch.testing.assert_close(varlen(**whole).logits[0], got, rtol=1e-4, atol=1e-5)
        no_cu = {k: v for k, v in whole.items() if not k.startswith(("cu_", "max_length"))}
        assert float((varlen(**no_cu).logits[0] - got).abs().max()) > 1e-3


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_2d_padding_mask_keeps_real_tokens_off_padding(side: str) -> None:
    # A padded batch (one record a row) with its 2D mask and positions 0..T-1: what SDPA with
    # the same 2D mask gives every real token; padding attends nothing.
    recs = records()[:4]
    T = max(r.numel() for r in recs)
    ids = torch.zeros((len(recs), T), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(recs):
        sl = slice(0, r.numel()) if side == "right" else slice(T - r.numel(), T)
        ids[i, sl], mask[i, sl] = r, 1
    varlen, sdpa = llama(varlen=True), llama(varlen=False)
    with torch.no_grad():
        got = varlen(input_ids=ids, attention_mask=mask).logits
        want = sdpa(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    close(got[real], want[real])
    assert torch.isfinite(got).all()


def test_sigma0_packed_update_with_varlen_equals_records_clipped_alone() -> None:
    # The DP step through make_private on the padding-free packed rows: the float64 oracle of
    # each record clipped alone (tests/test_packed_loss.py's check, Llama sketched at k=4096).
    import test_packed_loss as tpl

    tpl.check("llama-varlen", padding_free=True)
    tpl.check("llama-varlen", padding_free=True, units=tpl.UNITS)


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------


class Attn(nn.Module):
    is_causal = True
    sliding_window = None
    num_key_value_groups = 2


def qkv(B: int = 1, T: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(B, 2, T, 4, generator=g),
        torch.randn(B, 1, T, 4, generator=g),
        torch.randn(B, 1, T, 4, generator=g),
    )


def test_refusals_name_the_fix() -> None:
    q, k, v = qkv()
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    out, w = packed_sdpa_attention_forward(Attn(), q, k, v, None, position_ids=pos)
    assert out.shape == (1, 6, 2, 4) and w is None
    cases = [
        ({}, "no position_ids and no cu_seq_lens_q.*restarting at 0"),
        ({"position_ids": pos, "dropout": 0.1}, "dropout 0.1.*attention_dropout to 0"),
        ({"position_ids": pos, "softcap": 30.0}, "softcap"),
        ({"position_ids": pos, "sliding_window": 4}, "sliding window"),
        ({"position_ids": pos, "output_attentions": True}, "output_attentions"),
        ({"position_ids": pos, "is_causal": False}, "non-causal"),
        ({"position_ids": pos, "s_aux": torch.zeros(2)}, "sinks"),
        (
            {"cu_seq_lens_q": torch.tensor([0, 3, 6]), "cu_seq_lens_k": torch.tensor([0, 2, 6])},
            "cu_seq_lens_k differs",
        ),
        ({"cu_seq_lens_q": torch.tensor([0, 3, 5])}, "from 0 to B \\* T = 6"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            packed_sdpa_attention_forward(Attn(), q, k, v, None, **kw)
    window = Attn()
    window.sliding_window = 4
    with pytest.raises(ValueError, match="sliding window"):
        packed_sdpa_attention_forward(window, q, k, v, None, position_ids=pos)
    with pytest.raises(ValueError, match="a 4D mask.*padding_free=True.*'sdpa'"):
        packed_sdpa_attention_forward(Attn(), q, k, v, torch.ones(1, 1, 6, 6), position_ids=pos)
    with pytest.raises(ValueError, match="KV cache.*'sdpa'"):
        packed_sdpa_attention_forward(Attn(), q[:, :, :1], k, v, None, position_ids=pos)
    q2, k2, v2 = qkv(B=2, T=3)
    with pytest.raises(ValueError, match="crossing rows"):
        packed_sdpa_attention_forward(
            Attn(), q2, k2, v2, None, cu_seq_lens_q=torch.tensor([0, 2, 4, 6])
        )
    # Through a model: the 4D block mask with the varlen attention, dropout in training.
    packed = packed_batch()
    masked = packed.model_inputs(dtype=torch.float64)
    masked.pop("labels")
    with pytest.raises(ValueError, match="a 4D mask"):
        llama(varlen=True)(**masked)
    free = packed.model_inputs(padding_free=True)
    free.pop("labels")
    with pytest.raises(ValueError, match="dropout"):
        llama(varlen=True, attention_dropout=0.1)(**free)


def test_segment_starts() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    want = torch.tensor([[1, 0, 0, 1, 0, 1], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(segment_starts((2, 6), position_ids=pos), want)
    cu = torch.tensor([0, 3, 5, 6, 12])
    assert torch.equal(segment_starts((2, 6), cu_seq_lens=cu), want)


# --------------------------------------------------------------------------------------------
# The guard (make_private's PackedAttentionGuard) with the varlen attention
# --------------------------------------------------------------------------------------------


def _packed_loss(m: nn.Module, crit: Any, inputs: dict, packed: Any) -> Any:
    labels = packed.labels
    logits = m(**inputs).logits
    R, T = labels.shape
    return crit(
        logits[:, :-1].reshape(-1, VOCAB),
        labels[:, 1:].reshape(-1),
        shape=(R, T - 1),
        record_ids=packed.record_ids,
    )


def test_guard_accepts_varlen_and_refuses_its_crossing_segments_at_every_batch() -> None:
    packed = packed_batch()
    m, opt, crit = _private(llama(varlen=True))
    free = packed.model_inputs(padding_free=True)
    free.pop("labels")
    _packed_loss(m, crit, free, packed).backward()  # the logits check passes
    assert m.packed_attention_guard.full_checked
    opt.step()
    opt.zero_grad()
    # A later batch with padding (2D mask): accepted (padding is kept out of every segment).
    _packed_loss(m, crit, dict(free, attention_mask=packed.attention_mask), packed).backward()
    opt.zero_grad()
    # A later batch whose positions run over the whole row: refused without a forward check.
    whole = dict(free, position_ids=torch.arange(free["input_ids"].shape[1])[None])
    with pytest.raises(BatchIndependenceError, match="crosses records.*starts no attention"):
        _packed_loss(m, crit, whole, packed)


def test_plain_sdpa_without_a_block_mask_is_still_refused() -> None:
    # sdpa, a 2D padding mask over packed rows (one causal mask per row, across its records):
    # refused at the first packed batch by the logits check, as before.
    packed = packed_batch()
    m, _, crit = _private(llama(varlen=False))
    free = packed.model_inputs(padding_free=True)
    free.pop("labels")
    with pytest.raises(BatchIndependenceError, match="other logits alone"):
        _packed_loss(m, crit, dict(free, attention_mask=packed.attention_mask), packed)


class Flash(nn.Module):
    def __init__(self, impl: str) -> None:
        super().__init__()
        self.config = transformers.LlamaConfig()
        self.config._attn_implementation = impl


def test_varlen_segments_check() -> None:
    rid = torch.tensor([[0, 0, 1, 1, 1, -1], [2, 2, 2, 3, -1, -1]])
    pos = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 0, 0, 1]])
    for impl in ("flash_attention_2", PACKED_SDPA):
        check_varlen_segments(Flash(impl), {"position_ids": pos}, rid)
        with pytest.raises(BatchIndependenceError, match="record 1 starts no attention"):
            check_varlen_segments(Flash(impl), {"position_ids": torch.arange(6)[None]}, rid)
        cu = torch.tensor([0, 2, 5, 6, 9, 12])
        check_varlen_segments(Flash(impl), {"cu_seq_lens_q": cu}, rid)
        split = torch.tensor([0, 2, 3, 5, 6, 9, 12])
        with pytest.raises(BatchIndependenceError, match="inside its record"):
            check_varlen_segments(Flash(impl), {"cu_seq_lens_q": split}, rid)
    mask = (rid >= 0).long()
    with pytest.raises(BatchIndependenceError, match="flash_attention_2 with a 2D padding mask"):
        check_varlen_segments(Flash("flash_attention_2"), {"attention_mask": mask}, rid)
    # The varlen SDPA with left padding before a record in one position run: no padding is
    # attended, accepted.
    left = torch.tensor([[-1, -1, 0, 0, 0, 0]])
    check_varlen_segments(
        Flash(PACKED_SDPA),
        {"position_ids": torch.arange(6)[None], "attention_mask": (left >= 0).long()},
        left,
    )
    # Other implementations are left to the 4D mask and the logits check.
    check_varlen_segments(Flash("sdpa"), {"position_ids": torch.arange(6)[None]}, rid)


def test_segments_found_once_per_forward_follow_the_shape_and_in_place_changes() -> None:
    # The segments are cached on the (weakly referenced) position ids object: reusing the
    # object for another batch size, or changing it in place, must give the new segments.
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])

    def want(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list) -> torch.Tensor:
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        outs = [
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, s:e], kk[:, :, s:e], vv[:, :, s:e], is_causal=True
            )
            for s, e in bounds
        ]
        return torch.cat(outs, dim=2).transpose(1, 2)

    for B in (1, 2):
        q, k, v = qkv(B=B)
        out, _ = packed_sdpa_attention_forward(Attn(), q, k, v, None, position_ids=pos)
        close(out, want(q, k, v, [(0, 3), (3, 6)]))
    pos[0, 3:] = torch.tensor([3, 4, 5])  # one record now
    out, _ = packed_sdpa_attention_forward(Attn(), q, k, v, None, position_ids=pos)
    close(out, want(q, k, v, [(0, 6)]))
