"""Sketched per-sample gradient norms of ``nn.Linear``
(docs/privacy/estimators.md#estimators-setup).

For sample ``i`` with input ``A_i`` (``T x d``) and output gradient ``G_i`` (``T x p``):

* weight: ``||G_i^T A_i||_F``. Rank-2 inputs (``T = 1``) use the exact rank-one identity
  ``||g_i a_i^T||_F = ||g_i|| ||a_i||``, which is cheaper than any sketch. Rank-3 inputs are
  sketched with the given estimator. Inputs of rank > 3 (``B x ... x d``) are flattened to
  ``(B, T', d)`` first; Opacus' own ghost sampler returns ``{}`` for them, which silently reuses
  stale norms (``opacus.grad_sample.linear.compute_linear_norm_sample``
  handles 2-D and 3-D output gradients only).
* bias: exact, ``||G_i^T 1_T||``.

Frozen parameters (``requires_grad=False``) are skipped and cost nothing: no probe is drawn.

:func:`compute_linear_clipped_sum` is the book-keeping clipped gradient sum of the same layer
(Bu, Wang, Zha and Karypis, ICML 2023): ``sum_i c_i G_i^T A_i`` and ``sum_i c_i G_i^T 1_T``,
computed from the tensors of the first backward pass instead of a second one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from opacus_rc.grad_sample.clip import apply_clip_factors
from opacus_rc.grad_sample.registry import register_clipped_sum, register_sketched_norm_sampler
from opacus_rc.sketching import (
    RANGE_SAFE_ESTIMATORS,
    autocast_off,
    pow2_scale,
    sample_absmax,
)

__all__ = [
    "compute_linear_clipped_sum",
    "compute_linear_sketched_norm_sample",
    "sketched_weight_norm_of_gradients",
]


def _sketched_weight_norm(
    A: torch.Tensor,
    G: torch.Tensor,
    *,
    estimator: Callable[..., torch.Tensor],
    sketch_dim: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """``sqrt`` of the estimator's ``||G_i^T A_i||_F^2``, in range for every float32 norm.

    An estimator of :data:`~opacus_rc.sketching.RANGE_SAFE_ESTIMATORS` (Hutchinson) sums the
    squares of its sketch in float64, which keeps the estimate finite for gradient norms up to
    the float32 range (e.g. 1e30) at no pass over ``A`` and ``G`` beyond its products. Any
    other estimator gets, in float32, the factors of every sample scaled by powers of two
    (exactly: the estimate is bit-identical to the unscaled one wherever that one does not
    overflow) so that each sample's largest entry lies in ``[0.5, 1)``; the estimator scales its
    small operands rather than copying ``A`` and ``G`` (``scale=``), and the norm is rescaled
    afterwards. Neither depends on the probes, so the estimator's law is unchanged, and neither
    takes a data-dependent branch (no host synchronisation).

    Args:
        A: ``(B, T, d)`` activations.
        G: ``(B, T, p)`` backprops.
        estimator: A function from :data:`opacus_rc.sketching.ESTIMATORS`.
        sketch_dim: ``k``.
        generator: Sketch generator.

    Returns:
        ``(B,)`` norm estimates in the estimator's output dtype.
    """
    if torch.float64 in (A.dtype, G.dtype) or A.numel() == 0 or G.numel() == 0:
        sq = estimator(A, G, sketch_dim=sketch_dim, generator=generator)
        return sq.clamp(min=0).sqrt()
    if estimator in RANGE_SAFE_ESTIMATORS:
        sq = estimator(A, G, sketch_dim=sketch_dim, generator=generator, sum_dtype=torch.float64)
        return sq.sqrt().float()
    with autocast_off(G.device):
        amax_a = sample_absmax(A).float()
        amax_g = sample_absmax(G).float()
        scale_a, exp_a = pow2_scale(amax_a)
        scale_g, exp_g = pow2_scale(amax_g)
        sq = estimator(A, G, sketch_dim=sketch_dim, generator=generator, scale=(scale_a, scale_g))
        # Undo the scaling on the (B,) norms; float64 only for the exponent's range (2^e can
        # exceed float32 where the rescaled norm does not).
        norm = torch.ldexp(sq.clamp(min=0).sqrt().double(), (exp_a + exp_g).to(sq.device))
        return norm.to(sq.dtype)


def sketched_weight_norm_of_gradients(
    grads: torch.Tensor,
    *,
    estimator: Callable[..., torch.Tensor],
    sketch_dim: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """``sqrt`` of the estimator's ``||M_i||_F^2`` from per-sample weight gradients ``M_i``.

    The norm :func:`_sketched_weight_norm` gives from the factors ``A_i``, ``G_i`` with
    ``M_i = G_i^T A_i``, with the same probes (``estimator`` is the gradient form of the same
    estimator, :data:`opacus_rc.sketching.GRADIENT_ESTIMATORS`), up to float rounding; kept in
    range the same way: the squares summed in float64 for
    :data:`~opacus_rc.sketching.RANGE_SAFE_ESTIMATORS`, otherwise in float32 each sample
    scaled by a power of two so that its largest entry lies in ``[0.5, 1)`` (exact; the law is
    unchanged) and the norm rescaled afterwards.

    Args:
        grads: ``(B, p, d)`` per-sample weight gradients.
        estimator: A function of :data:`opacus_rc.sketching.GRADIENT_ESTIMATORS` (or a
            ``functools.partial`` of one).
        sketch_dim: ``k``.
        generator: Sketch generator.

    Returns:
        ``(B,)`` norm estimates in the estimator's output dtype.
    """
    if grads.dtype == torch.float64 or grads.numel() == 0:
        sq = estimator(grads, sketch_dim=sketch_dim, generator=generator)
        return sq.clamp(min=0).sqrt()
    if estimator in RANGE_SAFE_ESTIMATORS:
        sq = estimator(grads, sketch_dim=sketch_dim, generator=generator, sum_dtype=torch.float64)
        return sq.sqrt().float()
    with autocast_off(grads.device):
        scale, exponent = pow2_scale(sample_absmax(grads).float())
        sq = estimator(grads, sketch_dim=sketch_dim, generator=generator, scale=scale)
        norm = torch.ldexp(sq.clamp(min=0).sqrt().double(), exponent.to(sq.device))
        return norm.to(sq.dtype)


@register_sketched_norm_sampler(nn.Linear)
def compute_linear_sketched_norm_sample(
    layer: nn.Linear,
    activations: list[torch.Tensor],
    backprops: torch.Tensor,
    *,
    estimator: Callable[..., torch.Tensor],
    sketch_dim: int,
    generator: torch.Generator | None,
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient norms of an ``nn.Linear`` layer, the weight's sketched.

    Args:
        layer: The linear layer (weight ``p x d``).
        activations: ``[A]`` with ``A`` of shape ``(B, d)`` or ``(B, ..., d)``: the layer input,
            batch first.
        backprops: ``G`` of shape ``(B, p)`` or ``(B, ..., p)``: gradient of the layer output
            with respect to the per-sample losses (Opacus multiplies by ``B`` under
            ``loss_reduction="mean"``).
        estimator: Squared-norm estimator, e.g. :func:`opacus_rc.sketching.hutchinson_sqnorm`,
            called as ``estimator(A, G, sketch_dim=..., generator=...)`` on ``(B, T', d)`` and
            ``(B, T', p)`` factors.
        sketch_dim: ``k``, columns of the sketch.
        generator: Source of the probes; fresh probes are drawn on every call.

    Returns:
        ``{parameter: (B,) tensor}`` with the per-sample gradient **norm** of each trainable
        parameter of ``layer`` (float32, or float64 for float64 inputs). Weight norms of rank-2
        inputs and all bias norms are exact.

    Raises:
        ValueError: If the input and gradient shapes disagree.
    """
    A = activations[0]
    G = backprops
    if A.dim() < 2 or A.shape[:-1] != G.shape[:-1]:
        raise ValueError(
            f"nn.Linear norm sampler: input of shape {tuple(A.shape)} does not match output "
            f"gradient of shape {tuple(G.shape)} (batch-first, same leading dimensions expected)"
        )
    out_dtype = torch.float64 if torch.float64 in (A.dtype, G.dtype) else torch.float32
    B = A.shape[0]
    ret: dict[nn.Parameter, torch.Tensor] = {}
    if A.dim() == 2:
        # Exact: ||g a^T||_F = ||g|| ||a|| (docs/privacy/estimators.md#estimators-setup with T = 1),
        # in float64 to avoid overflow.
        with autocast_off(G.device):
            g_norm = torch.linalg.vector_norm(G.double(), dim=1)
            if layer.weight.requires_grad:
                a_norm = torch.linalg.vector_norm(A.double(), dim=1)
                ret[layer.weight] = (g_norm * a_norm).to(out_dtype)
            if layer.bias is not None and layer.bias.requires_grad:
                ret[layer.bias] = g_norm.to(out_dtype)
        return ret

    T = math.prod(A.shape[1:-1])  # explicit, so that B = 0 reshapes too
    A3 = A.reshape(B, T, A.shape[-1])
    G3 = G.reshape(B, T, G.shape[-1])
    if layer.weight.requires_grad:
        ret[layer.weight] = _sketched_weight_norm(
            A3, G3, estimator=estimator, sketch_dim=sketch_dim, generator=generator
        ).to(out_dtype)
    if layer.bias is not None and layer.bias.requires_grad:
        with autocast_off(G.device):
            g_sum = G3.sum(dim=1, dtype=out_dtype)  # (B, p), the exact bias gradient
            ret[layer.bias] = torch.linalg.vector_norm(g_sum.double(), dim=1).to(out_dtype)
    return ret


@register_clipped_sum(nn.Linear)
def compute_linear_clipped_sum(
    layer: nn.Linear,
    activations: list[torch.Tensor],
    backprops: torch.Tensor,
    coef: torch.Tensor,
) -> dict[nn.Parameter, torch.Tensor]:
    """Clipped gradient sum of an ``nn.Linear`` layer (book-keeping, Bu et al., ICML 2023).

    With ``A_i`` (``T' x d``) the input and ``G_i`` (``T' x p``) the output gradient of sample
    ``i`` (inputs of rank 2 have ``T' = 1``, inputs of rank > 3 are flattened to
    ``(B, T', d)``, as in :func:`compute_linear_sketched_norm_sample`):

    * weight: ``sum_i c_i G_i^T A_i``, i.e. ``einsum("btp,btd->pd", c[:, None, None] * G, A)``,
      one ``(p x B T') @ (B T' x d)`` matrix product, as in the backward pass;
    * bias: ``sum_i c_i G_i^T 1_T'``.

    This is exactly the gradient a second backward pass of ``sum_i c_i loss_i`` would give the
    layer's parameters. The weight's product runs in the dtype of ``backprops`` (as autograd's
    does, also under autocast), the bias sum in at least float32, with autocast disabled; the
    results have the parameters' dtypes. No random number is drawn.

    Args:
        layer: The linear layer (weight ``p x d``).
        activations: ``[A]`` with ``A`` of shape ``(B, d)`` or ``(B, ..., d)``, batch first.
        backprops: ``G`` of shape ``(B, p)`` or ``(B, ..., p)``: the gradient of the layer
            output with respect to the per-sample losses (already multiplied by ``B`` under
            ``loss_reduction="mean"``).
        coef: ``c``, the clip factors, shape ``(B,)``.

    Returns:
        ``{parameter: tensor of the parameter's shape}`` for each trainable parameter of
        ``layer`` (none for frozen ones).

    Raises:
        ValueError: If the input, gradient and clip-factor shapes disagree.
    """
    A = activations[0]
    G = backprops
    if A.dim() < 2 or A.shape[:-1] != G.shape[:-1] or coef.shape != A.shape[:1]:
        raise ValueError(
            f"nn.Linear clipped sum: input of shape {tuple(A.shape)}, output gradient of shape "
            f"{tuple(G.shape)} and clip factors of shape {tuple(coef.shape)} do not match "
            "(batch first, same leading dimensions, one factor per sample expected)"
        )
    B = A.shape[0]
    T = math.prod(A.shape[1:-1])  # 1 for rank-2 inputs; explicit, so that B = 0 reshapes too
    d, p = A.shape[-1], G.shape[-1]
    ret: dict[nn.Parameter, torch.Tensor] = {}
    with autocast_off(G.device):
        dtype = G.dtype
        if layer.weight.requires_grad:
            A3 = A.reshape(B, T, d).to(dtype)
            G3 = G.reshape(B, T, p)
            # Scale the smaller factor by c: same product, fewer multiplications.
            if p <= d:
                G3 = apply_clip_factors(coef, G3, dtype=dtype)
            else:
                A3 = apply_clip_factors(coef, A3, dtype=dtype)
            weight = G3.reshape(B * T, p).t() @ A3.reshape(B * T, d)
            ret[layer.weight] = weight.to(layer.weight.dtype)
        if layer.bias is not None and layer.bias.requires_grad:
            # (B, p): the per-sample bias gradients, accumulated in at least float32.
            acc = torch.promote_types(dtype, torch.float32)
            g_sum = G.reshape(B, T, p).sum(dim=1, dtype=acc)
            bias = apply_clip_factors(coef, g_sum, dtype=acc, reduce=True)
            ret[layer.bias] = bias.to(layer.bias.dtype)
    return ret
