"""A DP trainer's check of batch independence, at its first logical batches.

:func:`check_logical_batch` checks micro-batches until it has checked one of at least two
examples and, where the batches have an ``attention_mask``, one with padding: a first
micro-batch without padding (examples of equal length, or one example) says nothing about
padding, and a later micro-batch of the same step may be padded (left padding then moved a
release by 1.26 C through a BERT classifier's [CLS] slot, unseen by a check of the first
micro-batch alone). :func:`check_micro_batch` takes a few examples of one micro-batch (the
shortest, the first and the last), collates each alone with the trainer's own data collator,
and checks

1. that every example's row in the collated micro-batch is its own: every tensor the
   collator returns for it alone equals its row in the batch, compared at the real tokens
   (``attention_mask != 0``) where both have a mask (a collator that copies, shuffles or merges
   rows is caught here, which counting rows does not);
2. that its output (the model's logits at its real tokens) and, with the trainer's own
   ``compute_private_loss``, its per-example loss (the mean cross-entropy over its labelled
   positions, as :func:`~opacus_rc.integrations.per_sample_loss.per_sample_cross_entropy`)
   computed alone equal the same inside the micro-batch, up to rounding
   (:func:`~opacus_rc.batch_independence.allclose_rounding`).

The forwards run in :func:`~opacus_rc.batch_independence.independence_forward` (no gradient,
hooks disabled, dropout off in train mode, buffers and random states restored), with the inputs
the training step gives the model (:func:`~opacus_rc.integrations.model_inputs.model_inputs`,
position ids from the attention mask). A mismatch raises
:class:`~opacus_rc.batch_independence.BatchIndependenceError` before the logical batch's first
backward: nothing is noised or accounted. While the check waits for a padded micro-batch, each
logical batch costs one scan of its micro-batches' masks.
``PrivacyArguments.check_batch_independence=False`` turns it off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opacus_rc._compat.transformers import prepare_inputs
from opacus_rc.batch_independence import (
    allclose_rounding,
    batch_independence_error,
    check_rows,
    first_tensor,
    independence_forward,
    per_record_inputs,
)
from opacus_rc.integrations.logical_batches import UNITS_KEY, LogicalBatch
from opacus_rc.integrations.model_inputs import (
    check_decoder_inputs,
    model_inputs,
    unpadded_next_token_labels,
)
from opacus_rc.integrations.packed_batches import is_packed_micro_batch
from opacus_rc.integrations.per_sample_loss import per_token_targets
from opacus_rc.packing import check_records_independent

__all__ = [
    "BatchCheckState",
    "check_logical_batch",
    "check_micro_batch",
    "check_packed_micro_batch",
]


@dataclass
class BatchCheckState:
    """What the trainer's check has seen so far (one per run).

    Attributes:
        checked_batch: A micro-batch of at least two examples was checked.
        checked_padding: A micro-batch with padding (``attention_mask`` zeros) was checked.
        masked: The checked micro-batches had an ``attention_mask``.
    """

    checked_batch: bool = False
    checked_padding: bool = False
    masked: bool = False

    @property
    def done(self) -> bool:
        """Whether the check has seen what it needs (and stops)."""
        return self.checked_batch and (self.checked_padding or not self.masked)


def check_logical_batch(
    trainer: Any, model: nn.Module, batch: LogicalBatch, state: BatchCheckState
) -> None:
    """Check the micro-batches of ``batch`` that can still teach the check something.

    A micro-batch is checked if no micro-batch of at least two examples was checked yet, or
    if it has padding and no padded one was checked yet; ``state`` is updated.

    Raises:
        BatchIndependenceError: From :func:`check_micro_batch`.
    """
    collate = getattr(trainer, "_train_collate", None)
    if not batch.micro_batches or not batch.micro_examples or collate is None:
        return
    for micro, examples in zip(batch.micro_batches, batch.micro_examples):
        if state.done:
            return
        if not isinstance(micro, Mapping) or not examples:
            continue
        if is_packed_micro_batch(micro):
            # Records packed into rows: each checked record's logits alone equal its logits
            # inside its row (a record after another one in a row is what can see it).
            if not state.checked_batch:
                state.checked_batch = check_packed_micro_batch(trainer, model, micro)
            continue
        mask = micro.get("attention_mask")
        mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        padded = mask is not None and len(examples) > 1 and bool((mask == 0).any())
        if state.checked_batch and not padded:
            continue
        check_micro_batch(trainer, model, micro, examples)
        state.checked_batch = state.checked_batch or len(examples) > 1
        state.checked_padding = state.checked_padding or padded
        state.masked = state.masked or mask is not None


def check_micro_batch(
    trainer: Any, model: nn.Module, micro: Mapping[str, Any], examples: list[Any]
) -> list[int]:
    """Check one collated micro-batch against its examples (module docstring).

    Args:
        trainer: The DP trainer, made private (its collator ``_train_collate``, its flags).
        model: The model (DDP wrapper already run past).
        micro: The collated micro-batch (before ``prepare_inputs``).
        examples: Its examples, uncollated, in row order.

    Returns:
        The rows that were computed alone.

    Raises:
        BatchIndependenceError: A row is not its example's own, or an example's output or
            loss alone differs from the same inside the batch.
    """
    collate = trainer._train_collate
    micro = prepare_inputs(trainer, micro)
    if not isinstance(micro, Mapping):
        return []
    micro = {k: v for k, v in micro.items() if k != UNITS_KEY}
    size = len(examples)
    mask = micro.get("attention_mask")
    mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    rows = check_rows(size, mask)
    alone_batches = {}
    for i in range(size):  # every row (collating is cheap); the forwards for a few
        alone = prepare_inputs(trainer, collate([examples[i]]))
        _check_row_is_own(micro, alone, i)
        if i in rows:
            alone_batches[i] = alone
    positions = trainer._positions
    default_loss = _is_default_loss(trainer)
    private = trainer._require_private()
    with independence_forward(model, private.module):
        full = _forward(model, micro, positions, trainer, default_loss, size)
        for i in rows:
            with per_record_inputs(model):
                alone = _forward(model, alone_batches[i], positions, trainer, default_loss, 1)
            _compare(full, alone, micro, alone_batches[i], i, size)
    return rows


def check_packed_micro_batch(
    trainer: Any, model: nn.Module, micro: Mapping[str, Any], *, max_segments: int = 4
) -> bool:
    """Check a packed micro-batch with :func:`~opacus_rc.packing.check_records_independent`
    (a 4D mask that crosses records refused before anything runs; up to ``max_segments``
    record segments, those after another record in their row first, run alone).

    Returns:
        Whether a segment after another record in its row was checked (then the check is
        done: that is the case a packed batch can get wrong).

    Raises:
        BatchIndependenceError: From :func:`~opacus_rc.packing.check_records_independent`.
    """
    micro = {k: v for k, v in prepare_inputs(trainer, micro).items() if k != UNITS_KEY}
    private = trainer._require_private()
    result = check_records_independent(
        model, micro, max_segments=max_segments, hooks=private.module
    )
    return any(start > 0 for _, _, start, _ in result.segments)


def _is_default_loss(trainer: Any) -> bool:
    return trainer._default_private_loss


def _forward(
    model: nn.Module,
    inputs: Mapping[str, Any],
    positions: bool,
    trainer: Any,
    loss: bool,
    size: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The model's first tensor output and (with the default loss) per-example losses."""
    kwargs, labels, shift_labels, _ = model_inputs(inputs, expand_positions=positions)
    if labels is not None and trainer._shift_labels and shift_labels is None:
        labels = unpadded_next_token_labels(labels, kwargs.get("attention_mask"))
    check_decoder_inputs(model, kwargs)
    out = first_tensor(model(**kwargs), batch_size=size)
    losses = None
    if loss and out is not None and labels is not None:
        losses = _per_example_losses(
            out,
            labels,
            shift_labels,
            shift=trainer._shift_labels,
            label_smoothing=float(trainer.args.label_smoothing_factor),
        )
    return out, losses


def _per_example_losses(
    logits: torch.Tensor,
    labels: torch.Tensor,
    shift_labels: torch.Tensor | None,
    *,
    shift: bool,
    label_smoothing: float,
) -> torch.Tensor | None:
    """``(B,)`` mean cross-entropy over each example's labelled positions (``-100`` left out)."""
    logits = logits.float()
    if labels.dim() == 1:
        return F.cross_entropy(logits, labels, reduction="none", label_smoothing=label_smoothing)
    logits, targets = per_token_targets(logits, labels, shift=shift, shift_labels=shift_labels)
    if logits.dim() != 3 or logits.shape[:2] != targets.shape:
        return None
    b, t = targets.shape
    per_token = F.cross_entropy(
        logits.reshape(b * t, -1),
        targets.reshape(-1),
        ignore_index=-100,
        reduction="none",
        label_smoothing=label_smoothing,
    ).view(b, t)
    counts = (targets != -100).sum(-1).clamp(min=1)
    return per_token.sum(-1) / counts


def _real(value: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``value`` (one row, ``(T, ...)``) at its real tokens, where ``mask`` ``(T,)`` fits."""
    if mask is not None and value.dim() >= 1 and value.shape[0] == mask.shape[0]:
        return value[mask != 0]
    return value


def _row_mask(batch: Mapping[str, Any], i: int) -> torch.Tensor | None:
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] > i:
        return mask[i]
    return None


def _check_row_is_own(micro: Mapping[str, Any], alone: Any, i: int) -> None:
    """Every tensor of the example collated alone equals its row ``i`` in the batch."""
    if not isinstance(alone, Mapping):
        return
    size = next(
        (v.shape[0] for v in micro.values() if isinstance(v, torch.Tensor) and v.dim() > 0), 0
    )
    mask_b, mask_a = _row_mask(micro, i), _row_mask(alone, 0)
    for key, value in alone.items():
        row = micro.get(key)
        if key == "position_ids":
            continue  # a collator's positions: compared through the outputs below
        if not (
            isinstance(value, torch.Tensor)
            and isinstance(row, torch.Tensor)
            and value.dim() > 0
            and value.shape[0] == 1
            and row.dim() == value.dim()
            and row.shape[0] == size
        ):
            continue
        a, b = _real(value[0], mask_a), _real(row[i], mask_b)
        if _same(a, b):
            continue
        n = a.shape[0] if a.dim() else 0
        # No mask: the example's values padded on either side.
        if (
            a.dim()
            and b.dim()
            and a.shape[1:] == b.shape[1:]
            and n < b.shape[0]
            and (_same(a, b[:n]) or _same(a, b[b.shape[0] - n :]))
        ):
            continue
        raise batch_independence_error(
            f"row {i} of the first collated micro-batch is not its example's own: its "
            f"{key!r} differs from the same example collated alone by the trainer's data "
            "collator (a collator that copies, replaces, shuffles or merges rows, or one that "
            "draws random masks, such as masked-language-model masking)"
        )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return allclose_rounding(b, a)[0]


def _compare(
    full: tuple[torch.Tensor | None, torch.Tensor | None],
    alone: tuple[torch.Tensor | None, torch.Tensor | None],
    micro: Mapping[str, Any],
    alone_inputs: Mapping[str, Any],
    i: int,
    size: int,
) -> None:
    (out_b, loss_b), (out_a, loss_a) = full, alone
    if loss_b is not None and loss_a is not None and loss_a.numel() == 1:
        equal, diff, tol = allclose_rounding(loss_b[i], loss_a[0])
        if not equal:
            raise batch_independence_error(
                f"example {i} of the checked micro-batch has the per-example loss "
                f"{float(loss_b[i]):.6g} inside its batch of {size} and {float(loss_a[0]):.6g} "
                f"collated alone (|difference| {diff:.3g}, rounding tolerance {tol:.3g})"
            )
    if out_b is None or out_a is None or out_b.dim() == 0 or out_a.shape[0] != 1:
        return
    b = _real(out_b[i], _row_mask(micro, i))
    a = _real(out_a[0], _row_mask(alone_inputs, 0))
    equal, diff, tol = allclose_rounding(b, a)
    if not equal:
        raise batch_independence_error(
            f"example {i} of the checked micro-batch gives other outputs inside its batch of "
            f"{size} than collated alone (max |difference| {diff:.3g}, rounding tolerance "
            f"{tol:.3g}, compared at its real tokens)"
        )
