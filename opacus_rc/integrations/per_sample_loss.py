"""The per-example loss of a DP trainer: cross-entropy reduced per example, through the DP
criterion (:func:`per_sample_cross_entropy`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["per_sample_cross_entropy", "per_token_targets"]


def per_sample_cross_entropy(
    criterion: Any,
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    shift: bool,
    shift_labels: torch.Tensor | None = None,
    units: torch.Tensor | None = None,
) -> Any:
    """Per-example cross-entropy through the DP criterion returned by ``make_private``.

    For a causal LM (``shift=True``), position ``t`` predicts label ``t + 1`` (as
    ``transformers``' ``ForCausalLMLoss``; pre-shifted ``shift_labels`` are used as they are),
    and each example's loss is the mean over its positions whose target is not
    ``criterion.criterion.ignore_index`` (``-100``): ``loss_i = sum_t l_it / max(1, n_i)``
    with ``n_i`` its labelled positions, so padding adds no term (a DP trainer also drops the
    prediction of a record's first token from left padding and gives each row its positions
    from the attention mask, so that a record's loss is its loss alone). Token-level labels without
    shift (token classification) are reduced the same way; labels of shape ``(B,)`` give one
    loss per example. Logits are computed with in float32 at least (as ``ForCausalLMLoss``).

    Args:
        criterion: The :class:`~opacus_rc.optimizers.DPLossRandomizedClipping` of the engine,
            wrapping an ``nn.CrossEntropyLoss``.
        logits: ``(B, T, V)`` (token labels) or ``(B, C)`` (one label per example).
        labels: ``(B, T)`` or ``(B,)`` integer labels, ``-100`` where ignored.
        shift: Whether targets are the next tokens (causal LM).
        shift_labels: ``(B, T)`` already-shifted targets, or None.
        units: ``(B,)`` long tensor, the privacy unit ``0..U-1`` of each example, or None
            (each example its own unit): passed to the criterion as ``units=``, which then
            returns per-unit losses ``(U,)`` and clips per unit.

    Returns:
        The DP loss (``backward()`` runs the private backward) of per-example losses ``(B,)``
        (per-unit ``(U,)`` with ``units``).

    Raises:
        ValueError: If the shapes of logits and labels do not match either case.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if labels.dim() == 1:
        if logits.dim() != 2 or logits.shape[0] != labels.shape[0]:
            raise ValueError(
                f"labels of shape {tuple(labels.shape)} need logits (B, C), got "
                f"{tuple(logits.shape)}"
            )
        return criterion(logits, labels, units=units)
    logits, targets = per_token_targets(logits, labels, shift=shift, shift_labels=shift_labels)
    if logits.dim() != 3 or logits.shape[:2] != targets.shape:
        raise ValueError(
            f"per-token labels of shape {tuple(targets.shape)} need logits (B, T, V) with the "
            f"same (B, T), got {tuple(logits.shape)}"
        )
    b, t = targets.shape
    return criterion(logits.reshape(b * t, -1), targets.reshape(-1), shape=(b, t), units=units)


def per_token_targets(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    shift: bool,
    shift_labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits and the targets they predict, position by position.

    Args:
        logits: ``(B, T, V)``.
        labels: ``(B, T)``.
        shift: A causal LM: position ``t`` predicts label ``t + 1``.
        shift_labels: Pre-shifted ``(B, T)`` targets, used as they are.

    Returns:
        ``(logits, targets)``: ``(logits, shift_labels)``; with ``shift``,
        ``(logits[:, :-1], labels[:, 1:])``; else ``(logits, labels)``.
    """
    if shift_labels is not None:
        return logits, shift_labels
    if shift:
        return logits[:, :-1], labels[:, 1:]
    return logits, labels
