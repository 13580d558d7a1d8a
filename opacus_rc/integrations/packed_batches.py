"""Packed logical batches for a DP trainer: each Poisson batch's sampled records packed into
rows (docs/packing.md#packing-trainer).

With a :class:`~opacus_rc.packing.PackingCollator` as the training collator (``DPTrainer``'s
``data_collator=``, or ``DPSFTTrainer`` with ``packing=True`` / ``padding_free=True``), the
Poisson sampler still draws *records* (every record in a logical batch independently with
probability ``q``: the divisor and the accounting are those of the records), and
:class:`PackedLogicalBatchCollator` packs the records the batch sampled, after sampling, into
rows of at most ``max_length`` tokens: :func:`plan_packed_micro_batches` cuts the records
(longest first) into micro-batches of whole records, each packing into at most
``per_device_train_batch_size`` rows (a record longer than a row is cut across rows of one
micro-batch, and clipped once, as one unit), and each micro-batch is packed by the collator
(first fit in order, :func:`~opacus_rc.packing.pack_records`). Which records share a row
therefore depends only on the records of the logical batch; removing a record changes the
rows of its own logical batch only, and its contribution is bounded by the per-record
clipping, not by the rows. With ``PrivacyArguments.privacy_unit`` the units are sampled, a
sampled unit's records are packed into one micro-batch, and the criterion gets ``units=`` over
the records (:data:`~opacus_rc.integrations.logical_batches.UNITS_KEY`), so that each unit is
clipped once.

:func:`packed_micro_batch_loss` is the private loss of a packed micro-batch: the model runs on
the packed rows (the block-diagonal 4D mask, or no mask with restarting ``position_ids``), and
the criterion gets each token's record (``record_ids``, ``-1`` at padding), so that losses,
norms and clip factors are per record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from opacus_rc.integrations.logical_batches import UNITS_KEY, LogicalBatch, LogicalBatchCollator
from opacus_rc.packing import PackingCollator

__all__ = [
    "PACKED_KEYS",
    "PackedLogicalBatchCollator",
    "is_packed_micro_batch",
    "packed_micro_batch_loss",
    "packing_mask_dtype",
    "packing_rows",
    "plan_packed_micro_batches",
]

#: The keys of a packed micro-batch that are the criterion's, not the model's.
PACKED_KEYS = ("record_ids", "record_units")


def packing_rows(lengths: Sequence[int], *, max_length: int) -> int:
    """The number of rows :func:`~opacus_rc.packing.pack_records` packs records of these lengths
    into (first fit in order; a record longer than ``max_length`` takes ``ceil(l /
    max_length) - 1`` full rows and its rest goes by first fit)."""
    return _FirstFit(max_length).add_all(lengths).rows


class _FirstFit:
    """The row state of :func:`~opacus_rc.packing.pack_records`' first fit (rooms only)."""

    def __init__(self, max_length: int) -> None:
        self.max_length = int(max_length)
        self.room: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.room)

    def copy(self) -> _FirstFit:
        other = _FirstFit(self.max_length)
        other.room = list(self.room)
        return other

    def add(self, length: int) -> None:
        rest = int(length)
        while rest > self.max_length:
            self.room.append(0)
            rest -= self.max_length
        for j, free in enumerate(self.room):
            if free >= rest:
                self.room[j] -= rest
                return
        self.room.append(self.max_length - rest)

    def add_all(self, lengths: Sequence[int]) -> _FirstFit:
        for length in lengths:
            self.add(length)
        return self


def plan_packed_micro_batches(
    lengths: Sequence[int],
    *,
    max_length: int,
    max_rows: int,
    groups: Sequence[int] | None = None,
) -> list[tuple[int, int]]:
    """Cut records, in order, into micro-batches that each pack into at most ``max_rows`` rows.

    Greedy: a record (or a group of records, e.g. a privacy unit's, kept together) joins the
    current micro-batch if the micro-batch then still packs into ``max_rows`` rows (the first
    fit of :func:`~opacus_rc.packing.pack_records`, which the collator then runs), else starts
    the next one.

    Args:
        lengths: ``N`` record lengths in tokens (each >= 1).
        max_length: The row length.
        max_rows: The most rows of a micro-batch (``per_device_train_batch_size``).
        groups: Optional ``(N,)`` group of each record, a group's records contiguous: a group
            is never cut between micro-batches. Default: each record its own group.

    Returns:
        ``[(start, end), ...]``, contiguous and covering ``range(N)`` (empty for ``N = 0``).

    Raises:
        ValueError: If a record (or group) alone needs more than ``max_rows`` rows: it could
            not be clipped in one micro-batch; raise ``per_device_train_batch_size`` or lower
            ``max_length``'s cut (records longer than ``max_rows * max_length`` tokens).
    """
    n = len(lengths)
    if groups is not None and len(groups) != n:
        raise ValueError(f"{len(groups)} groups for {n} records")
    spans: list[tuple[int, int]] = []  # the groups, as record ranges
    start = 0
    for i in range(1, n + 1):
        if i == n or (groups is not None and groups[i] != groups[start]) or groups is None:
            spans.append((start, i))
            start = i
    out: list[tuple[int, int]] = []
    state = _FirstFit(max_length)
    lo = 0
    for g_lo, g_hi in spans:
        trial = state.copy().add_all(lengths[g_lo:g_hi])
        if trial.rows <= max_rows:
            state = trial
            continue
        alone = _FirstFit(max_length).add_all(lengths[g_lo:g_hi])
        if alone.rows > max_rows:
            what = "record" if g_hi - g_lo == 1 else f"unit of {g_hi - g_lo} records"
            raise ValueError(
                f"a {what} of {sum(int(x) for x in lengths[g_lo:g_hi])} tokens packs into "
                f"{alone.rows} rows of max_length={max_length}, more than "
                f"per_device_train_batch_size={max_rows} rows: its segments are clipped "
                "together, in one micro-batch. Raise per_device_train_batch_size to at least "
                f"{alone.rows}, or truncate the records"
            )
        if g_lo > lo:
            out.append((lo, g_lo))
        lo, state = g_lo, alone
    if n > lo:
        out.append((lo, n))
    return out


def _record_of(example: Any, i: int) -> Any:
    """The token ids of an example, checked: a pre-padded example is refused."""
    if isinstance(example, Mapping):
        if "input_ids" not in example:
            raise ValueError(f"example {i} has no 'input_ids' (keys {sorted(example)})")
        mask = example.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise ValueError(
                f"example {i} has padding (zeros in its attention_mask): a packing collator "
                "packs each record's own tokens; tokenize without padding (padding=False)"
            )
        return example["input_ids"]
    return example


class PackedLogicalBatchCollator(LogicalBatchCollator):
    """Collate a Poisson batch of records into packed micro-batches (module docstring).

    The examples (mappings with ``input_ids`` and optionally ``labels``, unpadded) are sorted
    longest first (stable), cut by :func:`plan_packed_micro_batches` into micro-batches of at
    most ``max_physical_batch_size`` packed rows, and each is packed by ``packing`` (first fit
    decreasing: full rows, and records of similar lengths in a micro-batch, which keeps the
    per-record norms' ``records x longest record`` layout small). The
    :class:`~opacus_rc.integrations.logical_batches.LogicalBatch`'s ``sizes`` count records.

    Args:
        packing: The :class:`~opacus_rc.packing.PackingCollator` (its ``max_length``, pad id,
            mask form).
        max_physical_batch_size: The most packed rows of a micro-batch
            (``per_device_train_batch_size``).

    Raises:
        ValueError: At call time: an example without ``input_ids`` or with padding, or a
            record longer than ``max_physical_batch_size`` rows
            (:func:`plan_packed_micro_batches`).
    """

    def __init__(
        self, *, packing: PackingCollator, max_physical_batch_size: int, units: bool = False
    ) -> None:
        super().__init__(collate_fn=packing, max_physical_batch_size=max_physical_batch_size)
        self.packing = packing
        self.units = bool(units)

    def __call__(self, examples: list[Any]) -> LogicalBatch:
        if self.units:
            return self._collate_units(examples)
        # Longest first: first fit decreasing packs rows fuller, and each micro-batch then
        # holds records of similar lengths (the per-record norms cost O(records x longest)).
        lengths = [len(_record_of(ex, i)) for i, ex in enumerate(examples)]
        order = sorted(range(len(examples)), key=lambda i: -lengths[i])
        examples = [examples[i] for i in order]
        return self.collate_chunks(examples, self.chunks(examples))

    def _collate_units(self, items: list[Any]) -> LogicalBatch:
        """Items ``(example, unit)``, a unit's contiguous (the unit sampler's order): whole
        units per micro-batch (longest unit first), each micro-batch with its ``(N,)`` unit of
        each record under :data:`~opacus_rc.integrations.logical_batches.UNITS_KEY`."""
        groups: list[list[Any]] = []
        for example, unit in items:
            if not groups or groups[-1][0][1] != unit:
                groups.append([])
            groups[-1].append((example, unit))
        size = [sum(len(_record_of(ex, i)) for i, (ex, _) in enumerate(g)) for g in groups]
        order = sorted(range(len(groups)), key=lambda j: -size[j])
        flat = [item for j in order for item in groups[j]]
        examples = [ex for ex, _ in flat]
        bounds = plan_packed_micro_batches(
            [len(_record_of(ex, i)) for i, ex in enumerate(examples)],
            max_length=self.packing.max_length,
            max_rows=self.max_physical_batch_size,
            groups=[unit for _, unit in flat],
        )
        batch = self.collate_chunks(examples, bounds)
        for micro, (lo, hi) in zip(batch.micro_batches, bounds):
            label: dict[Any, int] = {}
            micro[UNITS_KEY] = torch.tensor(
                [label.setdefault(unit, len(label)) for _, unit in flat[lo:hi]], dtype=torch.long
            )
        return batch

    def chunks(self, examples: list[Any]) -> list[tuple[int, int]]:
        lengths = [len(_record_of(ex, i)) for i, ex in enumerate(examples)]
        return plan_packed_micro_batches(
            lengths,
            max_length=self.packing.max_length,
            max_rows=self.max_physical_batch_size,
        )

    def collate_chunks(self, examples: list[Any], bounds: list[tuple[int, int]]) -> LogicalBatch:
        micro = [self.packing(examples[lo:hi]) for lo, hi in bounds]
        return LogicalBatch(
            micro_batches=micro,
            sizes=[hi - lo for lo, hi in bounds],
            micro_examples=[examples[lo:hi] for lo, hi in bounds],
        )


def is_packed_micro_batch(inputs: Any) -> bool:
    """Whether a collated micro-batch is packed (it carries ``record_ids``)."""
    return isinstance(inputs, Mapping) and "record_ids" in inputs


def packed_micro_batch_loss(
    model: nn.Module,
    inputs: Mapping[str, Any],
    *,
    criterion: Any,
) -> Any:
    """The DP loss of one packed micro-batch: each record's mean next-token loss.

    The model gets ``input_ids``, ``position_ids`` (restarting at each record) and the 4D
    block-diagonal ``attention_mask`` (none on the padding-free path); the criterion gets the
    per-token losses of ``logits[:, :-1]`` against ``labels[:, 1:]`` with ``shape=(R, T - 1)``
    and the token-to-record map ``record_ids`` ``(R, T)`` (a loss belongs to the record of the
    token that predicts it; :func:`~opacus_rc.packing.pack_records` puts the ignore index at
    every segment's first token, so no counted target lies in another record), so that it
    returns ``(N,)`` per-record losses, each the mean over the record's labelled targets (as
    an unpacked record's loss), and clips per record.

    Args:
        model: The model.
        inputs: A packed micro-batch (:class:`~opacus_rc.packing.PackingCollator`'s output).
        criterion: The engine's DP criterion.

    Returns:
        The DP loss of ``(N,)`` per-record losses.

    Raises:
        ValueError: No ``labels`` or ``record_ids`` in the batch.
    """
    inputs = dict(inputs)
    record_ids = inputs.pop("record_ids", None)
    inputs.pop("record_units", None)
    units = inputs.pop(UNITS_KEY, None)  # (N,) unit of each record, with privacy_unit
    labels = inputs.pop("labels", None)
    if labels is None or record_ids is None:
        raise ValueError(
            "a packed micro-batch needs 'labels' and 'record_ids' (PackingCollator's output)"
        )
    outputs = model(**inputs)
    logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    r, t = labels.shape[0], labels.shape[1] - 1
    return criterion(
        logits[:, :-1].reshape(r * t, -1),
        labels[:, 1:].reshape(-1),
        shape=(r, t),
        record_ids=record_ids,
        units=units,
    )


def packing_mask_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of a packed batch's 4D mask for ``model``: ``torch.bool`` for SDPA (which takes
    a boolean mask whatever the autocast dtype of its inputs), else the model's floating dtype
    (eager attention *adds* the mask to its scores)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        return torch.bool
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return dtype
