"""The clip factor: made by :func:`clip_factors`, applied by :func:`apply_clip_factors`.

The clip factors ``c_i = min(1, C / (n_hat_i + 1e-6))`` are computed by one function,
:func:`clip_factors` (called when a step issues them,
:meth:`~opacus_rc.grad_sample.private_step.PrivateStep.issue_clip_factors`, for a unit cut across
physical batches when its last part is in,
:func:`~opacus_rc.units.split.write_split_clipped_sums`, and by the canary audit,
:func:`~opacus_rc.auditing.run_canary_audit`), and applied by one, :func:`apply_clip_factors`: the
two-pass loss weights its per-sample losses (``sum_i c_i loss_i``,
:class:`~opacus_rc.optimizers.DPLossRandomizedClipping`), and book-keeping weights each layer's
per-sample tensors (the output gradients of ``nn.Linear`` and ``nn.Embedding``, the per-id
scales of ``nn.EmbeddingBag``, the stashed per-sample gradients of every other layer), in one
process and under FSDP2 alike. Every one of those multiplications is a call of
:func:`apply_clip_factors`, so what a clip factor multiplies, in which dtype and with autocast
in which state, is decided here.
"""

from __future__ import annotations

import torch

from opacus_rc.sketching import autocast_off

__all__ = ["CLIP_EPSILON", "apply_clip_factors", "clip_factors"]

#: Added to the norm before dividing, as Opacus does (``max_grad_norm / (norm + 1e-6)`` in
#: ``opacus.optimizers.DPOptimizer.clip_and_accumulate``): a zero norm gets a finite factor, 1.
CLIP_EPSILON = 1e-6


def clip_factors(norms: torch.Tensor, *, max_grad_norm: float) -> torch.Tensor:
    """The clip factors ``c_i = min(1, C / (n_hat_i + 1e-6))`` of per-sample norms.

    Opacus' formula (``DPOptimizer.clip_and_accumulate``); with it ``c_i n_hat_i <= C`` for
    every sample, so the clipped contribution of the norm the step measured is at most ``C``.

    Example:
        >>> clip_factors(torch.tensor([0.5, 2.0, 0.0], dtype=torch.float64), max_grad_norm=1.0)
        tensor([1.0000, 0.5000, 1.0000], dtype=torch.float64)

    Args:
        norms: ``n_hat``, shape ``(B,)``, the per-sample gradient norms (not squared), finite
            and >= 0.
        max_grad_norm: ``C`` > 0.

    Returns:
        ``(B,)`` factors in ``(0, 1]``, in the dtype of ``norms``.
    """
    return (max_grad_norm / (norms + CLIP_EPSILON)).clamp(max=1.0)


def apply_clip_factors(
    clip_factors: torch.Tensor,
    per_sample: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    sample_of: torch.Tensor | None = None,
    reduce: bool = False,
    consume: bool = False,
) -> torch.Tensor:
    """Multiply each sample's slice of ``per_sample`` by its clip factor (optionally summed).

    With ``c`` the clip factors and ``x`` the per-sample tensor (rows of ``x`` belong to samples
    ``s(j)``, by default ``s(j) = j``):

    * ``reduce=False``: ``y_j = c_{s(j)} x_j``, shape of ``x``;
    * ``reduce=True``: ``sum_i c_i x_i`` (a contraction over the batch dimension, one matrix
      product ``(1 x B) @ (B x prod(shape))``), shape ``x.shape[1:]``.

    Computed in ``dtype`` (``c`` and ``x`` are converted to it first), with autocast disabled on
    ``x``'s device (autocast would run the contraction in a lower precision); the result has
    ``dtype``. No random number is drawn and no host synchronisation happens. The result is
    autograd-differentiable in ``x`` (the two-pass loss backpropagates through it).

    Args:
        clip_factors: ``c``, shape ``(B,)``: float32, or float64 when a norm was float64
            (:meth:`~opacus_rc.grad_sample.private_step.PrivateStep.issue_clip_factors`); moved to
            ``x``'s device.
        per_sample: ``x``, shape ``(B, *shape)`` (``(N, *shape)`` with ``sample_of``).
        dtype: Dtype of the product. ``None``: ``torch.promote_types(c.dtype, x.dtype)``, the
            dtype of ``c * x`` (the two-pass loss); book-keeping passes the dtype its layer
            accumulates in (that of autograd's own backward, or at least float32).
        sample_of: ``(N,)`` integer index: row ``j`` of ``x`` belongs to sample
            ``sample_of[j]`` (``nn.EmbeddingBag``'s ids, ``reduce=False`` only).
        reduce: Sum over the batch dimension instead of scaling each row.
        consume: The caller does not use ``x`` afterwards: with ``reduce=True`` and ``B = 1``
            the one row is scaled in place and returned (a view of ``x``, no copy), provided
            ``dtype`` is ``x``'s.

    Returns:
        ``(B, *shape)`` (``reduce=False``) or ``shape`` (``reduce=True``), dtype ``dtype``.

    Raises:
        ValueError: If ``clip_factors`` is not one-dimensional, or its length is not the
            batch size of ``per_sample`` (without ``sample_of``), or ``sample_of`` is used
            with ``reduce=True`` or does not index the rows of ``per_sample``.
    """
    if clip_factors.dim() != 1:
        raise ValueError(
            f"clip factors must have shape (B,), got {tuple(clip_factors.shape)}: one factor "
            "per sample"
        )
    if sample_of is None:
        if per_sample.dim() < 1 or per_sample.shape[0] != clip_factors.shape[0]:
            raise ValueError(
                f"{clip_factors.shape[0]} clip factors for a per-sample tensor of shape "
                f"{tuple(per_sample.shape)}: its first dimension must be the batch, one factor "
                "per sample"
            )
    elif reduce or sample_of.shape != per_sample.shape[:1]:
        raise ValueError(
            f"sample_of of shape {tuple(sample_of.shape)} must give the sample of each of the "
            f"{per_sample.shape[0] if per_sample.dim() else 0} rows of the per-sample tensor, "
            "and is only supported with reduce=False"
        )
    if dtype is None:
        dtype = torch.promote_types(clip_factors.dtype, per_sample.dtype)
    with autocast_off(per_sample.device):
        c = clip_factors.to(device=per_sample.device, dtype=dtype)
        if sample_of is not None:
            c = c[sample_of]
        if reduce:
            if consume and per_sample.shape[0] == 1 and per_sample.dtype == dtype:
                return per_sample[0].mul_(c[0])
            return torch.tensordot(c, per_sample.to(dtype), dims=1)
        x = per_sample.to(dtype)
        return x * c.view(-1, *([1] * (x.dim() - 1)))
