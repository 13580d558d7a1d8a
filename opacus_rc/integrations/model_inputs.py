"""What the model of a DP trainer is given for one collated micro-batch, shared by the training
step (:mod:`opacus_rc.integrations.logical_batch_step`) and the first batch's check of batch
independence (:mod:`opacus_rc.integrations.batch_check`), which must give the model exactly
what the step gives it: the model's keyword arguments with each row's position ids, the labels
with no target predicted from padding, and the refusal of an encoder-decoder batch without
decoder inputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from opacus_rc.batch_independence import position_ids_from_attention_mask
from opacus_rc.integrations.logical_batches import UNITS_KEY

__all__ = ["check_decoder_inputs", "model_inputs", "unpadded_next_token_labels"]


def model_inputs(
    inputs: Mapping[str, Any], *, expand_positions: bool
) -> tuple[dict[str, Any], Any, Any, Any]:
    """What the model of a DP trainer is given for one collated micro-batch.

    Args:
        inputs: One collated micro-batch (``labels``, ``shift_labels`` and, with
            ``privacy_unit``, :data:`~opacus_rc.integrations.logical_batches.UNITS_KEY` are
            taken out).
        expand_positions: Whether the model takes ``position_ids``: then, when the batch has
            none, each row's are passed ``(B, T)``: from the ``attention_mask`` ``(B, T)``
            where there is one (0 at the row's first real token, whatever the padding side:
            :func:`~opacus_rc.batch_independence.position_ids_from_attention_mask`), else
            ``0..T-1``.

    Returns:
        ``(model keyword arguments, labels, shift_labels, units)`` (None where absent).
    """
    inputs = dict(inputs)
    units = inputs.pop(UNITS_KEY, None)  # (B,) units 0..U-1, with privacy_unit
    labels = inputs.pop("labels", None)
    given_shift_labels = inputs.pop("shift_labels", None)
    if expand_positions and "position_ids" not in inputs and "input_ids" in inputs:
        # Batch-broadcast position ids ([1, T], the model's default) would give a trainable
        # position embedding one norm for the whole batch (Opacus issue 841); one row per
        # example. From the mask: with 0..T-1 for every row, a left-padded record's positions
        # would depend on the longest record of its batch, and so would its gradient (a
        # learned position embedding: removing one record moved the update by 1.69 C).
        b, t = inputs["input_ids"].shape[:2]
        mask = inputs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and tuple(mask.shape) == (b, t):
            inputs["position_ids"] = position_ids_from_attention_mask(mask)
        else:
            positions = torch.arange(t, device=inputs["input_ids"].device)
            inputs["position_ids"] = positions.unsqueeze(0).expand(b, -1)
    return inputs, labels, given_shift_labels, units


def check_decoder_inputs(model: nn.Module, inputs: Mapping[str, Any]) -> None:
    """Refuse an encoder-decoder batch without decoder inputs (a clear error, not the model's).

    A DP trainer takes ``labels`` out of the batch and computes each example's loss itself, so
    an encoder-decoder model (``config.is_encoder_decoder``, e.g. T5, BART) cannot build its
    decoder inputs from them, as it does when given ``labels``.

    Raises:
        ValueError: If the model is an encoder-decoder and ``inputs`` has neither
            ``decoder_input_ids`` nor ``decoder_inputs_embeds``.
    """
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False):
        return
    if "decoder_input_ids" in inputs or "decoder_inputs_embeds" in inputs:
        return
    raise ValueError(
        f"{type(model).__name__} is an encoder-decoder model and the batch has no "
        "decoder_input_ids: a DP trainer computes each example's loss from 'labels' itself and "
        "does not pass them to the model, which would otherwise build its decoder inputs from "
        "them. Collate decoder_input_ids too: DataCollatorForSeq2Seq(tokenizer, model=model) "
        "does (from the labels, with model.prepare_decoder_input_ids_from_labels)"
    )


def unpadded_next_token_labels(labels: torch.Tensor, attention_mask: Any) -> torch.Tensor:
    """Causal-LM labels with no token predicted from padding.

    Position ``t`` predicts label ``t + 1``; under left padding the last padding position
    would predict a record's first real token, a term the record collated alone does not have
    (it has no position before its first token). Such labels are set to ``-100`` (ignored), so
    that each record's loss in the batch is its loss alone. With right padding nothing changes
    (the labels after a record's last token are already ignored).

    Args:
        labels: ``(B, T)`` labels (``-100`` where ignored).
        attention_mask: ``(B, T)`` mask (nonzero at real tokens), or None.

    Returns:
        ``labels``, or a copy with the labels after padding positions set to ``-100``.
    """
    if (
        not isinstance(attention_mask, torch.Tensor)
        or labels.dim() != 2
        or attention_mask.shape != labels.shape
    ):
        return labels
    after_padding = torch.zeros_like(labels, dtype=torch.bool)
    after_padding[:, 1:] = attention_mask[:, :-1] == 0
    if not bool(after_padding.any()):
        return labels
    return labels.masked_fill(after_padding, -100)
