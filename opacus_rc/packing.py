"""Packed and padding-free batches of records, for per-record clipping inside a row
(docs/packing.md#packing).

Supervised fine-tuning data is ragged; packing several records into one row of ``max_length``
tokens (TRL's ``packing=True``), or concatenating them without padding (``padding_free=True``),
avoids training on padding. Per-row clipping would then protect the row, not the record. This
module builds the packed batch and its token-to-record map; the per-record norms, clip factors
and clipped sums inside packed rows are in :mod:`opacus_rc.grad_sample.packed`.

**When packing is exact.** A record's gradient inside a packed row equals its gradient alone
(so that clipping it per record bounds its contribution) when

1. attention stays inside the record: a causal mask that cannot cross records
   (:func:`block_diagonal_attention_mask`, the 4D mask every Hugging Face attention
   implementation accepts as is), or the model's varlen path (flash attention with restarting
   ``position_ids``; in ``transformers`` 5 the SDPA and eager paths also build a block mask from
   restarting ``position_ids`` when ``attention_mask`` is ``None``);
2. positions restart at 0 at each record (``position_ids``), for learned absolute positions
   (GPT-2) as for rotary ones (Llama);
3. every other module acts on each position alone (linear layers, embeddings, layer and RMS
   norms, per-token losses): no statistic over the row (batch normalisation), no convolution
   over positions;
4. no target is predicted across a record boundary: :func:`pack_records` puts the ignore
   index at the first token of every record segment, whose prediction would come from the
   previous record's last token.

:func:`check_records_independent` checks 1-4 on a packed batch: every checked record's logits
alone equal its logits inside the pack (the batch-independence check of
:mod:`opacus_rc.batch_independence`, applied to the records of a row), and a 4D mask that lets
a record attend to another record or to padding is refused before anything runs.

**A record longer than a row** is cut into segments of at most ``max_length`` tokens, each in
its own row, each with positions restarting at 0 and attention inside the segment (as TRL cuts
it). Its segments keep one record id: its gradient is the sum of its segments' gradients, each
a function of the record alone, and it is clipped once, as one unit. The first token of each
continuation segment is no longer predicted (its predictor is in the previous segment).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from opacus_rc.batch_independence import (
    BatchIndependenceError,
    allclose_rounding,
    first_tensor,
    independence_forward,
)

__all__ = [
    "IGNORE_INDEX",
    "PackedBatch",
    "PackedModelInputs",
    "PackingCollator",
    "RecordsCheck",
    "block_diagonal_attention_mask",
    "check_mask_structure",
    "check_records_independent",
    "pack_records",
    "record_ids_from_position_ids",
    "record_losses",
    "record_segments",
]

#: The label of a token no loss is computed for (Hugging Face's and torch's default).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackedBatch:
    """Records packed into rows (:func:`pack_records`). ``R`` rows of ``T`` tokens, ``N``
    records.

    Attributes:
        input_ids: ``(R, T)`` long, ``pad_token_id`` at padding.
        labels: ``(R, T)`` long, unshifted (the model shifts them, as Hugging Face's causal LM
            losses do): the record's labels, with the ignore index at padding and at the first
            token of each record segment.
        position_ids: ``(R, T)`` long, restarting at 0 at each record segment (and at the
            padding run at the end of a row).
        record_ids: ``(R, T)`` long, the record of each token (its index in ``records``), -1 at
            padding. A record cut across rows has the same id in each of them.
        token_index: ``(R, T)`` long, each token's index inside its record (0 at the record's
            first token, continuing across its segments), -1 at padding.
        attention_mask: ``(R, T)`` long, 1 at real tokens, 0 at padding (the 2D padding mask;
            the model needs :func:`block_diagonal_attention_mask` instead, see
            :meth:`model_inputs`).
        record_units: ``(N,)`` long, the unit (privacy record: a user, a document) of each
            record; ``arange(N)`` when every record is its own unit.
        num_records: ``N``.
        segments: ``(N,)`` long, the number of rows each record's tokens occupy (1 unless the
            record is longer than a row).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    record_ids: torch.Tensor
    token_index: torch.Tensor
    attention_mask: torch.Tensor
    record_units: torch.Tensor
    num_records: int
    segments: torch.Tensor

    def model_inputs(
        self, *, padding_free: bool = False, dtype: torch.dtype = torch.float32
    ) -> dict[str, torch.Tensor]:
        """The keyword inputs of a Hugging Face causal LM for this batch.

        Args:
            padding_free: Without a mask: ``input_ids``, ``position_ids`` and ``labels`` only,
                for a model whose attention keeps records apart from the restarting position
                ids (flash attention's varlen path; ``transformers`` >= 5 for SDPA and eager).
                Check it with :func:`check_records_independent`.
            dtype: The 4D mask's dtype (the model's floating dtype, or ``torch.bool``).

        Returns:
            ``{"input_ids", "position_ids", "labels"}`` and, unless ``padding_free``,
            ``"attention_mask"``: the ``(R, 1, T, T)`` :func:`block_diagonal_attention_mask`.
        """
        out = {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "labels": self.labels,
        }
        if not padding_free:
            out["attention_mask"] = block_diagonal_attention_mask(self.record_ids, dtype=dtype)
        return out


def _as_ids(value: Any, what: str) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dim() == 1 and t.numel() == 0:
        return t.long()  # [] reads as float32
    if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{what} must be a 1-D sequence of integers, got shape {tuple(t.shape)}")
    return t.long()


def pack_records(
    records: Sequence[Sequence[int] | torch.Tensor],
    *,
    max_length: int,
    pad_token_id: int,
    labels: Sequence[Sequence[int] | torch.Tensor] | None = None,
    units: Sequence[int] | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> PackedBatch:
    """Pack records into rows of at most ``max_length`` tokens (module docstring).

    First fit in order: a record of at most ``max_length`` tokens goes into the first row with
    room for it (a new row if none); a longer record is cut into segments of ``max_length``
    tokens, each a new row, and a last shorter segment placed by first fit. A row never holds two
    segments of one record. Rows are padded on the right to the longest row.

    Args:
        records: ``N`` token-id sequences (lists or 1-D integer tensors), one per sampled
            record, each non-empty.
        max_length: Most tokens in a row (>= 1).
        pad_token_id: The id put at padding positions.
        labels: Optional ``N`` label sequences, each as long as its record (e.g. with the
            ignore index at the prompt's tokens); default: the record's ids.
        units: Optional ``(N,)`` unit of each record (several records of one user clipped
            together), values ``0..U-1``; default: each record its own unit.
        ignore_index: The label of tokens without a target.

    Returns:
        The :class:`PackedBatch`, on the CPU.

    Raises:
        ValueError: If ``max_length < 1``, there is no record, a record is empty or not 1-D
            integers, a label sequence's length differs from its record's, or ``units`` is not
            ``(N,)`` non-negative integers.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be an int >= 1, got {max_length!r}")
    ids = [_as_ids(r, f"records[{i}]") for i, r in enumerate(records)]
    n = len(ids)
    if n == 0:
        raise ValueError("pack_records needs at least one record")
    for i, r in enumerate(ids):
        if r.numel() == 0:
            raise ValueError(f"records[{i}] is empty: drop empty records before packing")
    if labels is None:
        labs = [r.clone() for r in ids]
    else:
        if len(labels) != n:
            raise ValueError(f"{len(labels)} label sequences for {n} records")
        labs = [_as_ids(lab, f"labels[{i}]") for i, lab in enumerate(labels)]
        for i, (r, lab) in enumerate(zip(ids, labs)):
            if lab.numel() != r.numel():
                raise ValueError(
                    f"labels[{i}] has {lab.numel()} entries for a record of {r.numel()} tokens"
                )
    if units is None:
        record_units = torch.arange(n)
    else:
        record_units = _as_ids(units, "units")
        if record_units.numel() != n or bool((record_units < 0).any()):
            raise ValueError(
                f"units must give each of the {n} records a unit >= 0, got shape "
                f"{tuple(record_units.shape)}"
            )

    # Rows as lists of (record, start, end) segments; first fit in order.
    rows: list[list[tuple[int, int, int]]] = []
    room: list[int] = []
    segments = torch.zeros(n, dtype=torch.long)
    for i, r in enumerate(ids):
        length = r.numel()
        start = 0
        while length - start > max_length:  # full segments: a row each
            rows.append([(i, start, start + max_length)])
            room.append(0)
            segments[i] += 1
            start += max_length
        rest = length - start
        slot = next((j for j, free in enumerate(room) if free >= rest), None)
        if slot is None:
            rows.append([])
            room.append(max_length)
            slot = len(rows) - 1
        rows[slot].append((i, start, length))
        room[slot] -= rest
        segments[i] += 1

    R = len(rows)
    T = max(max_length - free for free in room)
    input_ids = torch.full((R, T), pad_token_id, dtype=torch.long)
    out_labels = torch.full((R, T), ignore_index, dtype=torch.long)
    position_ids = torch.zeros((R, T), dtype=torch.long)
    record_ids = torch.full((R, T), -1, dtype=torch.long)
    token_index = torch.full((R, T), -1, dtype=torch.long)
    for j, row in enumerate(rows):
        at = 0
        for i, start, end in row:
            size = end - start
            input_ids[j, at : at + size] = ids[i][start:end]
            out_labels[j, at : at + size] = labs[i][start:end]
            out_labels[j, at] = ignore_index  # predicted from another record, or from nothing
            position_ids[j, at : at + size] = torch.arange(size)
            record_ids[j, at : at + size] = i
            token_index[j, at : at + size] = torch.arange(start, end)
            at += size
        position_ids[j, at:] = torch.arange(T - at)  # the padding run: a sequence of its own
    return PackedBatch(
        input_ids=input_ids,
        labels=out_labels,
        position_ids=position_ids,
        record_ids=record_ids,
        token_index=token_index,
        attention_mask=(record_ids >= 0).long(),
        record_units=record_units,
        num_records=n,
        segments=segments,
    )


def _check_record_ids(record_ids: Any) -> torch.Tensor:
    if (
        not isinstance(record_ids, torch.Tensor)
        or record_ids.dim() != 2
        or record_ids.is_floating_point()
        or record_ids.is_complex()
        or record_ids.dtype == torch.bool
    ):
        shape = getattr(record_ids, "shape", None)
        raise ValueError(
            "record_ids must be a (R, T) integer tensor (the record of each token, -1 at "
            f"padding), got {type(record_ids).__name__} of shape "
            f"{None if shape is None else tuple(shape)}"
        )
    return record_ids.long()


def block_diagonal_attention_mask(record_ids: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """The causal attention mask of packed rows that cannot cross records.

    Query ``q`` may attend key ``k`` of its row when ``k <= q`` and both lie in the same
    contiguous run of one record id ``>= 0`` (a record segment). A padding query (id -1)
    attends itself only, so that no softmax row is empty (an all-masked row gives NaN under
    SDPA with a boolean mask); no real query attends padding.

    The result is the 4D mask Hugging Face models take as ``attention_mask`` and use as is
    (``transformers.masking_utils``: a 4D mask skips mask creation) in the eager, SDPA and
    flex paths: Llama, Qwen2, Mistral, GPT-2 (``GPT2Model`` adds a float mask to its
    attention scores in eager mode, so eager needs the additive float form).

    Args:
        record_ids: ``(R, T)`` integer tensor, the record of each token, -1 at padding
            (:attr:`PackedBatch.record_ids`).
        dtype: ``torch.bool`` for a boolean mask (True: attend), or a floating dtype (the
            model's) for the additive form: 0 where attending, ``torch.finfo(dtype).min``
            elsewhere (``exp`` of it underflows to exactly 0 in the softmax).

    Returns:
        ``(R, 1, T, T)`` tensor on ``record_ids``'s device.

    Raises:
        ValueError: If ``record_ids`` is not a 2-D integer tensor, or ``dtype`` is neither
            ``torch.bool`` nor floating.
    """
    rid = _check_record_ids(record_ids)
    if dtype != torch.bool and not dtype.is_floating_point:
        raise ValueError(f"dtype must be torch.bool or a floating dtype, got {dtype}")
    R, T = rid.shape
    # A run: maximal stretch of one id. Same run + causal + real query; plus the diagonal.
    change = torch.ones_like(rid, dtype=torch.bool)
    change[:, 1:] = rid[:, 1:] != rid[:, :-1]
    run = change.long().cumsum(-1)
    same = run.unsqueeze(-1) == run.unsqueeze(-2)  # (R, T, T): [r, q, k]
    causal = torch.ones(T, T, dtype=torch.bool, device=rid.device).tril()
    real = (rid >= 0).unsqueeze(-1)
    eye = torch.eye(T, dtype=torch.bool, device=rid.device)
    allowed = (same & causal & real) | eye
    allowed = allowed.unsqueeze(1)
    if dtype == torch.bool:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=rid.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def record_ids_from_position_ids(
    position_ids: torch.Tensor, *, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The token-to-record map of a padding-free batch, from its restarting position ids.

    A record starts wherever a position id is 0 (TRL's ``padding_free=True`` collator gives
    ``position_ids`` ``(1, total)`` restarting at each example, and ``cu_seq_lens`` at the same
    starts). Records are numbered in row-major order over the batch. Only valid when no
    record continues in another row or restarts its positions inside itself (TRL's
    ``"bfd_split"`` and ``"wrapped"`` packing cut examples, and the pieces would be counted as
    separate records): use :func:`pack_records`, which keeps one id for a cut record, for
    those.

    Args:
        position_ids: ``(R, T)`` (or ``(T,)``) integer position ids, 0 at each record's first
            token.
        padding_mask: Optional ``(R, T)``, nonzero at real tokens; padding gets -1.

    Returns:
        ``(R, T)`` long record ids (-1 at padding).

    Raises:
        ValueError: If the shapes are not ``(R, T)``, or a row does not start a record.
    """
    pos = position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids
    if pos.dim() != 2 or pos.is_floating_point():
        raise ValueError(f"position_ids must be (R, T) integers, got {tuple(position_ids.shape)}")
    real = torch.ones_like(pos, dtype=torch.bool) if padding_mask is None else padding_mask != 0
    if real.shape != pos.shape:
        raise ValueError(f"padding_mask {tuple(real.shape)} for position_ids {tuple(pos.shape)}")
    starts = (pos == 0) & real
    first = real.long().argmax(dim=1)  # a row's first real token must start a record
    has_real = real.any(dim=1)
    if bool((has_real & ~starts.gather(1, first[:, None]).squeeze(1)).any()):
        raise ValueError(
            "a row's first real token has a position id other than 0: it continues a record "
            "from another row, which restarting position ids cannot express; pack with "
            "opacus_rc.packing.pack_records (one record id for a cut record)"
        )
    ids = starts.reshape(-1).long().cumsum(0).view_as(pos) - 1
    return torch.where(real, ids, torch.full_like(ids, -1))


def record_segments(record_ids: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """The record segments of packed rows: maximal runs of one record id ``>= 0``.

    Args:
        record_ids: ``(R, T)`` integer tensor, -1 at padding.

    Returns:
        ``[(record, row, start, end), ...]`` in row-major order (tokens ``start:end`` of
        ``row``).

    Raises:
        ValueError: If ``record_ids`` is not a 2-D integer tensor.
    """
    rid = _check_record_ids(record_ids).cpu()
    out = []
    for row in range(rid.shape[0]):
        values = rid[row].tolist()
        start = 0
        for t in range(1, len(values) + 1):
            if t == len(values) or values[t] != values[start]:
                if values[start] >= 0:
                    out.append((values[start], row, start, t))
                start = t
    return out


def record_losses(
    logits: torch.Tensor,
    labels: torch.Tensor,
    record_ids: torch.Tensor,
    *,
    num_records: int,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "sum",
) -> torch.Tensor:
    """Each record's next-token cross-entropy inside packed rows, summed or averaged.

    Position ``t`` predicts ``labels[:, t + 1]`` (the shift of Hugging Face's causal LM loss);
    the target's record is ``record_ids[:, t + 1]``. Targets equal to ``ignore_index`` count
    nothing (:func:`pack_records` puts it at every segment's first token, so no target is
    predicted from another record).

    Args:
        logits: ``(R, T, V)``.
        labels: ``(R, T)`` unshifted labels.
        record_ids: ``(R, T)``, -1 at padding.
        num_records: ``N``.
        ignore_index: Label without a target.
        reduction: ``"sum"`` over the record's counted targets, or ``"mean"`` over them (the
            per-sample loss Opacus' criterion gives an unpacked record with ``shape=``; 0 for
            a record without a counted target).

    Returns:
        ``(N,)`` per-record losses, in ``logits``' dtype (at least float32).

    Raises:
        ValueError: If the shapes disagree or ``reduction`` is neither ``"sum"`` nor
            ``"mean"``.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    rid = _check_record_ids(record_ids)
    if logits.dim() != 3 or logits.shape[:2] != rid.shape or labels.shape != rid.shape:
        raise ValueError(
            f"record_losses: logits {tuple(logits.shape)}, labels {tuple(labels.shape)} and "
            f"record_ids {tuple(rid.shape)} must be (R, T, V), (R, T) and (R, T)"
        )
    target = labels[:, 1:].long()
    owner = rid[:, 1:]
    keep = (target != ignore_index) & (owner >= 0)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    tok = nn.functional.cross_entropy(
        logits[:, :-1].to(dtype).reshape(-1, logits.shape[-1]),
        torch.where(keep, target, 0).reshape(-1),
        reduction="none",
    ).reshape(target.shape)
    tok = torch.where(keep, tok, torch.zeros_like(tok))
    out = torch.zeros(num_records, dtype=dtype, device=logits.device)
    where = torch.where(keep, owner, 0).reshape(-1)
    out = out.index_add(0, where, tok.reshape(-1))
    if reduction == "mean":
        counts = torch.zeros(num_records, dtype=dtype, device=logits.device)
        counts = counts.index_add(0, where, keep.reshape(-1).to(dtype))
        out = out / counts.clamp(min=1)
    return out


class RecordsCheck(NamedTuple):
    """What :func:`check_records_independent` compared."""

    #: The record segments run alone, ``(record, row, start, end)``.
    segments: list[tuple[int, int, int, int]]
    #: The largest ``max |inside - alone|`` over them.
    max_difference: float
    #: The rounding tolerance of that comparison.
    tolerance: float


#: Keys of a packed batch that are not the model's inputs.
_NOT_MODEL_INPUTS = ("labels", "record_ids", "record_units")

_FIX = (
    "Keep attention inside each record: pass attention_mask="
    "opacus_rc.packing.block_diagonal_attention_mask(record_ids, dtype=model dtype) (a 4D "
    "mask) with position_ids restarting at 0 at each record (pack_records returns both; "
    "PackedBatch.model_inputs() builds the inputs), or the model's padding-free path "
    "(attention_mask=None and restarting position_ids, with flash attention's varlen "
    "kernel, the varlen SDPA of opacus_rc.packed_attention.register_packed_sdpa(), "
    "or transformers >= 5)"
)


def check_mask_structure(mask: torch.Tensor, record_ids: torch.Tensor) -> None:
    """Refuse a 4D mask that lets a real query attend another record's token or padding.

    ``O(R T^2)`` comparisons, no forward: the check the DP criterion's ``record_ids=`` runs at
    every packed batch (:class:`opacus_rc.packed_loss.PackedAttentionGuard`).

    Args:
        mask: ``(R or 1, H or 1, T, T)`` attention mask, boolean (True: attend) or additive
            float (a value above ``finfo.min / 2``: attend).
        record_ids: ``(R, T)`` record of each token, -1 at padding.

    Raises:
        ValueError: If the mask's shape does not fit ``record_ids``.
        BatchIndependenceError: If a real token may attend another record's token or padding.
    """
    rid = _check_record_ids(record_ids)
    R, T = rid.shape
    if mask.dim() != 4 or mask.shape[-2:] != (T, T) or mask.shape[0] not in (1, R):
        raise ValueError(
            f"a 4D attention_mask of shape {tuple(mask.shape)} for packed rows of shape "
            f"({R}, {T}): (R, 1 or heads, T, T) expected"
        )
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    allowed = allowed.to(rid.device).expand(R, -1, -1, -1)
    q = rid.view(R, 1, T, 1)
    k = rid.view(R, 1, 1, T)
    crossing = allowed & (q >= 0) & (q != k)
    if bool(crossing.any()):
        r, _, qi, ki = (int(v) for v in crossing.nonzero()[0])
        other = int(rid[r, ki])
        whom = "padding" if other < 0 else f"record {other}"
        raise BatchIndependenceError(
            f"the packed batch's attention crosses records: in row {r}, token {qi} of record "
            f"{int(rid[r, qi])} attends token {ki} of {whom} ({int(crossing.sum())} such "
            "query-key pairs). A record's gradient would then depend on the other records of "
            "its row, and clipping it per record would not bound its contribution. " + _FIX
        )


#: The flash / varlen keyword inputs over the whole batch's records, left out of a segment's
#: forward alone (its position ids give it one sequence).
_VARLEN_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"})


def _cut(value: Any, row: int, start: int, end: int, R: int, T: int) -> Any:
    """One segment of a model input: ``(R, T, ...)`` tensors cut to ``[row, start:end]``, a
    4D ``(R, H, T, T)`` mask to its block; any other value unchanged."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return value
    if value.dim() == 4 and value.shape[-2:] == (T, T) and value.shape[0] in (1, R):
        r = row if value.shape[0] == R else 0
        return value[r : r + 1, :, start:end, start:end]
    if value.shape[:2] == (R, T):
        return value[row : row + 1, start:end]
    if value.shape[0] == 1 and value.shape[1] == T:  # broadcast position ids (1, T)
        return value[:, start:end]
    return value


def _at_most_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 if it is float64: Hugging Face's eager attention takes its softmax in
    float32 whatever the model's dtype, so a float64 model's logits carry float32 rounding."""
    return t.float() if t.dtype == torch.float64 else t


def check_records_independent(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    record_ids: torch.Tensor | None = None,
    max_segments: int | None = None,
    hooks: Any = None,
) -> RecordsCheck:
    """Check that each record of a packed batch gives the same logits alone as inside its row.

    First, a 4D ``attention_mask`` in ``batch`` is read: a real token allowed to attend another
    record's token (or padding) is refused at once. Then the model runs on the whole batch
    and on each record segment alone (its tokens at positions ``0..l-1``, its block of a 4D
    mask, its slice of every other ``(R, T, ...)`` input), inside
    :func:`~opacus_rc.batch_independence.independence_forward` (no gradient, hooks off,
    dropout 0, buffers and random states restored, TF32 off), and the segment's logits inside
    the pack must equal its logits alone.

    **Tolerance.** :func:`~opacus_rc.batch_independence.allclose_rounding`: equal when
    ``max |inside - alone| <= sqrt(eps) * max(1, max |alone|)``. Inside the pack, a masked key
    gets the additive ``finfo.min``, whose ``exp`` after subtracting the row maximum underflows
    to exactly 0, so the record's attention sums the same terms as alone; what differs is the
    blocking and order of the length-``T`` products and sums, each off by at most ``n u``
    relative (``u = eps / 2``, ``n`` terms): for ``n <= 4096`` and float32 that is below
    ``2^12 * 2^-24 = 2.4e-4 < sqrt(eps) = 3.5e-4``. float64 logits are compared in float32
    (``eps = 2^-23``): Hugging Face's eager attention takes its softmax in float32 whatever the
    model's dtype (measured: ``2e-8`` between a float64 Llama's record inside and alone, above
    float64's ``sqrt(eps) = 1.5e-8``, far below float32's). A record that sees another record or
    restarts no position moves its logits by ``O(1)`` of their scale, far above the tolerance.

    Args:
        model: The model (a Hugging Face causal LM or any module taking ``batch`` as keyword
            inputs and returning logits ``(R, T, V)`` first).
        batch: The model's keyword inputs (``input_ids``, ``position_ids``, ``attention_mask``
            4D, 2D or absent, ...); ``labels``, ``record_ids`` and ``record_units`` are not passed
            to the model.
        record_ids: ``(R, T)`` record of each token, -1 at padding; default
            ``batch["record_ids"]``.
        max_segments: Check at most this many record segments (those not at the start of
            their row first: they are the ones that could see another record); default all.
        hooks: The grad-sample hooks object, disabled during the forwards (or None).

    Returns:
        A :class:`RecordsCheck`.

    Raises:
        BatchIndependenceError: If the 4D mask lets a record attend another record or padding,
            or a segment's logits alone differ from its logits inside the pack beyond rounding;
            the message names the fix.
        ValueError: If ``record_ids`` is missing or its shape does not match ``input_ids``.
    """
    kwargs = {k: v for k, v in batch.items() if k not in _NOT_MODEL_INPUTS}
    if record_ids is None:
        record_ids = batch.get("record_ids")
    if record_ids is None:
        raise ValueError(
            "check_records_independent needs record_ids (R, T): pass record_ids= or put "
            "them in batch['record_ids']"
        )
    rid = _check_record_ids(record_ids)
    R, T = rid.shape
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor) and tuple(ids.shape[:2]) != (R, T):
        raise ValueError(f"record_ids of shape {(R, T)} for input_ids of shape {tuple(ids.shape)}")
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        check_mask_structure(mask, rid)
    segments = record_segments(rid)
    order = sorted(range(len(segments)), key=lambda j: (segments[j][2] == 0, j))
    if max_segments is not None:
        order = order[: max(0, int(max_segments))]
    chosen = [segments[j] for j in sorted(order)]
    worst, worst_tol = 0.0, 0.0
    with independence_forward(model, hooks):
        full = first_tensor(model(**kwargs), batch_size=R)
        if full is None:
            raise ValueError(
                f"check_records_independent found no model output with {R} rows to compare"
            )
        for record, row, start, end in chosen:
            one = {
                k: _cut(v, row, start, end, R, T)
                for k, v in kwargs.items()
                if k not in _VARLEN_KEYS  # alone, a segment is one sequence
            }
            if isinstance(one.get("position_ids"), torch.Tensor):
                # Alone, a record's positions are 0..l-1, whatever the pack gave it.
                one["position_ids"] = torch.arange(
                    end - start, device=one["position_ids"].device
                ).unsqueeze(0)
            alone = first_tensor(model(**one), batch_size=1)
            inside = full[row, start:end]
            equal, diff, tol = (
                (False, math.inf, 0.0)
                if alone is None or alone.shape[1] != end - start
                else allclose_rounding(_at_most_float32(inside), _at_most_float32(alone[0]))
            )
            if not equal:
                raise BatchIndependenceError(
                    f"record {record} (row {row}, tokens {start}:{end}) gives other logits "
                    f"alone than inside its packed row (max |difference| {diff:.3g}, rounding "
                    f"tolerance {tol:.3g}): its computation depends on the other records of the "
                    "row (attention across records, positions that do not restart at 0 at each "
                    "record, or a module that mixes positions), so clipping per record would "
                    "not bound its contribution. " + _FIX
                )
            if diff >= worst:
                worst, worst_tol = diff, tol
    return RecordsCheck(segments=chosen, max_difference=worst, tolerance=worst_tol)


class PackingCollator:
    """Pack a list of examples into rows (:func:`pack_records`) and return model inputs.

    Each example is a mapping with ``"input_ids"`` (a token-id sequence), optionally
    ``"labels"`` (as long) and ``"unit"`` (an int: the privacy unit of the record), or a bare
    token-id sequence. The batch returned holds ``input_ids``, ``labels``, ``position_ids``,
    ``attention_mask`` (the 4D :func:`block_diagonal_attention_mask`, left out when
    ``padding_free``), and ``record_ids`` ``(R, T)`` and ``record_units`` ``(N,)``, which the DP
    criterion takes and the model must not receive (pop them before the forward).

    Poisson sampling stays over records: the collator packs whatever records a logical batch
    sampled, so the divisor and the accounting are those of the records.

    Args:
        max_length: Most tokens in a row.
        pad_token_id: The padding id.
        padding_free: Leave the 4D mask out (the model keeps records apart from the
            restarting ``position_ids``; check with :func:`check_records_independent`).
        mask_dtype: The 4D mask's dtype: the model's floating dtype, or ``torch.bool``.
        ignore_index: The label of tokens without a target.

    Raises:
        ValueError: From :func:`pack_records`, or for an example without ``input_ids``.
    """

    def __init__(
        self,
        *,
        max_length: int,
        pad_token_id: int,
        padding_free: bool = False,
        mask_dtype: torch.dtype = torch.float32,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.padding_free = bool(padding_free)
        self.mask_dtype = mask_dtype
        self.ignore_index = ignore_index

    def __call__(self, examples: Sequence[Any]) -> dict[str, torch.Tensor]:
        """Pack ``examples`` (see the class docstring) into one batch."""
        records, labels, units = [], [], []
        for i, ex in enumerate(examples):
            if isinstance(ex, Mapping):
                if "input_ids" not in ex:
                    raise ValueError(f"example {i} has no 'input_ids' (keys {sorted(ex)})")
                records.append(ex["input_ids"])
                labels.append(ex.get("labels", ex["input_ids"]))
                units.append(ex.get("unit", i))
            else:
                records.append(ex)
                labels.append(ex)
                units.append(i)
        packed = pack_records(
            records,
            max_length=self.max_length,
            pad_token_id=self.pad_token_id,
            labels=labels,
            units=units,
            ignore_index=self.ignore_index,
        )
        out = packed.model_inputs(padding_free=self.padding_free, dtype=self.mask_dtype)
        out["record_ids"] = packed.record_ids
        out["record_units"] = packed.record_units
        return out

    def evaluation_collator(self) -> PackedModelInputs:
        """This collator without the criterion's keys: batches a model (and the Trainer's
        ``compute_loss``, e.g. in ``evaluate()``) takes as they are (``input_ids``,
        ``labels``, ``position_ids`` and, unless padding-free, the 4D mask)."""
        return PackedModelInputs(self)


class PackedModelInputs:
    """A :class:`PackingCollator`'s batches without ``record_ids`` and ``record_units``
    (:meth:`PackingCollator.evaluation_collator`).

    Args:
        packing: The packing collator.
    """

    def __init__(self, packing: PackingCollator) -> None:
        self.packing = packing

    def __call__(self, examples: Sequence[Any]) -> dict[str, torch.Tensor]:
        """The packed batch of ``examples``, model inputs and labels only."""
        out = self.packing(examples)
        out.pop("record_ids")
        out.pop("record_units")
        return out
