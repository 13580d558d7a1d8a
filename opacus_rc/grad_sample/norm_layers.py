"""Exact per-sample norms and clipped sums of normalisation layers, in closed form.

A normalisation layer ``y = w * xhat + b`` (``xhat`` the input normalised over the last
dimensions, the *normalised shape* ``D``, position by position) has, for sample ``i`` with
output gradient ``G_i`` (``T x D``, ``T`` the positions) and normalised input ``xhat_i``:

* weight: ``grad_w loss_i = sum_t G_i[t] * xhat_i[t]`` (elementwise, shape ``D``);
* bias: ``grad_b loss_i = sum_t G_i[t]``.

The weight's ``xhat`` does not depend on ``w``, so these are the exact per-sample gradients,
one elementwise product and one sum over positions: no ``torch.func`` replay of the module
(which the functorch path runs per sample) and no extra saved activation, since ``xhat`` is
recomputed from the layer input that the hooks already record. The functions cover

* ``torch.nn.LayerNorm`` (``xhat = (x - mean) / sqrt(var + eps)``, biased variance; also
  ``elementwise_affine=False``, which has no parameter, and ``bias=False``);
* ``torch.nn.RMSNorm`` (``xhat = x / sqrt(mean(x^2) + eps)``, ``eps=None`` meaning
  ``torch.finfo(x.dtype).eps``);
* ``transformers``' ``LlamaRMSNorm`` and the RMSNorm classes with its exact forward
  (:data:`TRANSFORMERS_RMS_NORMS`: ``weight * (x_fp32 / sqrt(mean(x_fp32^2) +
  variance_epsilon)).to(x.dtype)``, float32 statistics whatever the input dtype).

**Registered** as *exact* norm samplers
(:func:`~opacus_rc.grad_sample.registry.register_sketched_norm_sampler` with ``exact=True``:
no probe is drawn) with their book-keeping clipped sums
(:func:`~opacus_rc.grad_sample.registry.register_clipped_sum`) for the
:data:`TRANSFORMERS_RMS_NORMS` classes only, which have no Opacus grad sampler and were
replayed by functorch. They are registered without importing ``transformers``: by
:func:`register_loaded_transformers_norms`, for the classes whose module is already imported,
when this module is imported and again when a model is checked before hooks are attached
(:func:`~opacus_rc.grad_sample.registry.check_modules`). Gemma's RMSNorm (``1 + w``) has
another forward and is not among them. ``nn.LayerNorm`` and ``nn.RMSNorm`` keep Opacus' grad
samplers, closed forms too, on the per-sample-gradient path, which also sums the per-sample
gradients of a module used twice in one forward and stashes ``(B, D)`` per-sample gradients
for book-keeping; the exact-sampler path refuses a second use in one forward (as for every
sketched or exact module) and stashes the layer's input and output gradient, except in a
checkpointed step once :data:`~opacus_rc.grad_sample.norms.STASH_GRAD_SAMPLERS` (where
:func:`norm_layer_per_sample_grads` is registered for these classes) serves exact routes.

Arithmetic is in float32 (float64 for float64 inputs), with autocast disabled.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from opacus_rc.grad_sample.clip import apply_clip_factors
from opacus_rc.grad_sample.norms import STASH_GRAD_SAMPLERS
from opacus_rc.grad_sample.registry import (
    CLIPPED_SUM_FUNCTIONS,
    SKETCHED_NORM_SAMPLERS,
    register_clipped_sum,
    register_sketched_norm_sampler,
)
from opacus_rc.sketching import autocast_off

__all__ = [
    "TRANSFORMERS_RMS_NORMS",
    "compute_norm_layer_clipped_sum",
    "compute_norm_layer_norm_sample",
    "norm_layer_per_sample_grads",
    "norm_layer_record_grads",
    "register_loaded_transformers_norms",
]

#: ``(module name, class name)`` of the ``transformers`` RMSNorm classes whose forward is
#: ``LlamaRMSNorm``'s, statement for statement (``variance_epsilon``, float32 statistics, the
#: weight applied after casting back). Registered once their module is imported.
TRANSFORMERS_RMS_NORMS: tuple[tuple[str, str], ...] = (
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
    ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm"),
)


def _normalized_shape(layer: nn.Module) -> tuple[int, ...]:
    shape = getattr(layer, "normalized_shape", None)
    if shape is not None:
        return tuple(shape)
    return tuple(layer.weight.shape)  # transformers' RMSNorm: the last dimension


def _normalized_input(layer: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``xhat`` in ``dtype`` (same shape as ``x``), as the layer's forward computes it."""
    shape = _normalized_shape(layer)
    if isinstance(layer, nn.LayerNorm):
        return F.layer_norm(x.to(dtype), shape, None, None, layer.eps)
    if isinstance(layer, nn.RMSNorm):
        eps = layer.eps if layer.eps is not None else torch.finfo(x.dtype).eps
        return F.rms_norm(x.to(dtype), shape, None, eps)
    # transformers' forward, statement for statement: float32 statistics (also for a float64
    # input), the result cast back to x.dtype.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + layer.variance_epsilon)
    return h.to(x.dtype).to(dtype)


def _check(layer: nn.Module, x: torch.Tensor, G: torch.Tensor, what: str) -> tuple[int, int, int]:
    """``(B, T, D)``: batch, positions and normalised size of matching ``x`` and ``G``."""
    shape = _normalized_shape(layer)
    n = len(shape)
    if x.shape != G.shape or x.dim() < n + 1 or tuple(x.shape[x.dim() - n :]) != shape:
        raise ValueError(
            f"{type(layer).__name__} {what}: input of shape {tuple(x.shape)} and output "
            f"gradient of shape {tuple(G.shape)} must be equal and end with the normalized "
            f"shape {shape}, batch first"
        )
    B = x.shape[0]
    D = math.prod(shape)
    T = math.prod(x.shape[1 : x.dim() - n])  # explicit, so that B = 0 reshapes too
    return B, T, D


def _trainable(p: nn.Parameter | None) -> bool:
    return p is not None and p.requires_grad


def norm_layer_per_sample_grads(
    layer: nn.Module, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Exact per-sample gradients of a normalisation layer's trainable parameters.

    Args:
        layer: An ``nn.LayerNorm``, ``nn.RMSNorm`` or a :data:`TRANSFORMERS_RMS_NORMS` class.
        activations: ``[x]``, the layer input, ``(B, ..., *normalized_shape)``.
        backprops: ``G``, the gradient of the layer output with respect to the per-sample
            losses, ``x``'s shape.

    Returns:
        ``{parameter: (B, *parameter.shape)}`` in float32 (float64 for float64 inputs) for each
        trainable parameter (none for frozen ones or ``elementwise_affine=False``).

    Raises:
        ValueError: If the input and gradient shapes disagree or do not end with the layer's
            normalized shape.
    """
    x, G = activations[0], backprops
    B, T, D = _check(layer, x, G, "per-sample gradient")
    shape = _normalized_shape(layer)
    acc = torch.float64 if torch.float64 in (x.dtype, G.dtype) else torch.float32
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    ret: dict[nn.Parameter, torch.Tensor] = {}
    with autocast_off(G.device):
        G3 = G.reshape(B, T, D).to(acc)
        if _trainable(weight):
            xhat = _normalized_input(layer, x, acc).reshape(B, T, D)
            ret[weight] = (G3 * xhat).sum(dim=1).reshape(B, *shape)
        if _trainable(bias):
            ret[bias] = G3.sum(dim=1).reshape(B, *shape)
    return ret


def norm_layer_record_grads(
    layer: nn.Module,
    x: torch.Tensor,
    backprops: torch.Tensor,
    *,
    record_ids: torch.Tensor,
    num_records: int,
) -> dict[nn.Parameter, torch.Tensor]:
    """Exact per-record gradients of a normalisation layer in packed rows (``record_ids=``).

    Record ``r``'s gradients are :func:`norm_layer_per_sample_grads`' sums taken over its
    tokens wherever they lie: ``sum_{t in r} G[t] * xhat[t]`` (weight) and ``sum_{t in r}
    G[t]`` (bias), one elementwise product over the ``R T`` token rows and one ``index_add``
    over the token-to-record map (padding, record -1, left out). ``O(R T D)``: no row padded
    to the longest record.

    Args:
        layer: An ``nn.LayerNorm``, ``nn.RMSNorm`` or a :data:`TRANSFORMERS_RMS_NORMS` class.
        x: The layer input, ``(R, T, *normalized_shape)``.
        backprops: ``G``, ``x``'s shape, the gradient of the per-record losses.
        record_ids: ``(R, T)`` integer, the record ``0..N-1`` of each token, -1 at padding.
        num_records: ``N``.

    Returns:
        ``{parameter: (N, *parameter.shape)}`` in float32 (float64 for float64 inputs) for
        each trainable parameter.

    Raises:
        ValueError: If the shapes disagree (as :func:`norm_layer_per_sample_grads`) or
            ``record_ids`` is not ``x``'s ``(R, T)``.
    """
    R, T, D = _check(layer, x, backprops, "per-record gradient")
    if x.dim() < 2 or tuple(record_ids.shape) != tuple(x.shape[:2]) or x.shape[1] != T:
        raise ValueError(
            f"{type(layer).__name__} per-record gradient: record_ids of shape "
            f"{tuple(record_ids.shape)} for an input of shape {tuple(x.shape)} ((R, T) first, "
            "then the normalized shape, expected)"
        )
    shape = _normalized_shape(layer)
    acc = torch.float64 if torch.float64 in (x.dtype, backprops.dtype) else torch.float32
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    rid = record_ids.to(backprops.device).reshape(R * T).long()
    where = rid.clamp(min=0)
    ret: dict[nn.Parameter, torch.Tensor] = {}
    with autocast_off(backprops.device):
        G2 = backprops.reshape(R * T, D).to(acc).masked_fill((rid < 0).unsqueeze(1), 0)
        if _trainable(weight):
            xhat = _normalized_input(layer, x, acc).reshape(R * T, D)
            out = G2.new_zeros(num_records, D).index_add_(0, where, G2 * xhat)
            ret[weight] = out.reshape(num_records, *shape)
        if _trainable(bias):
            out = G2.new_zeros(num_records, D).index_add_(0, where, G2)
            ret[bias] = out.reshape(num_records, *shape)
    return ret


def compute_norm_layer_norm_sample(
    layer: nn.Module,
    activations: list[torch.Tensor],
    backprops: torch.Tensor,
    *,
    estimator: Callable[..., torch.Tensor],
    sketch_dim: int,
    generator: torch.Generator | None,
) -> dict[nn.Parameter, torch.Tensor]:
    """Exact per-sample gradient norms of a normalisation layer (no sketch, no probe).

    Args:
        layer: As :func:`norm_layer_per_sample_grads`.
        activations: ``[x]``, ``(B, ..., *normalized_shape)``.
        backprops: ``G``, ``x``'s shape.
        estimator: Ignored (exact).
        sketch_dim: Ignored.
        generator: Ignored: nothing is drawn.

    Returns:
        ``{parameter: (B,)}``: the per-sample gradient norm of each trainable parameter,
        float32 (float64 for float64 inputs).

    Raises:
        ValueError: As :func:`norm_layer_per_sample_grads`.
    """
    del estimator, sketch_dim, generator  # exact: nothing is sketched
    grads = norm_layer_per_sample_grads(layer, activations, backprops)
    with autocast_off(backprops.device):
        return {
            p: torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1) for p, g in grads.items()
        }


def compute_norm_layer_clipped_sum(
    layer: nn.Module,
    activations: list[torch.Tensor],
    backprops: torch.Tensor,
    coef: torch.Tensor,
) -> dict[nn.Parameter, torch.Tensor]:
    """Clipped gradient sum ``sum_i c_i grad loss_i`` of a normalisation layer (book-keeping).

    The per-sample gradients of :func:`norm_layer_per_sample_grads` contracted with ``c``
    over the batch by :func:`~opacus_rc.grad_sample.clip.apply_clip_factors` (the one place
    clip factors are applied; one ``(1 x B) @ (B x D)`` product), in the promoted dtype of
    ``c`` and the per-sample gradients. No random number is drawn.

    Args:
        layer: As :func:`norm_layer_per_sample_grads`.
        activations: ``[x]``, ``(B, ..., *normalized_shape)``.
        backprops: ``G``, ``x``'s shape.
        coef: ``c``, the clip factors, ``(B,)``.

    Returns:
        ``{parameter: tensor of the parameter's shape and dtype}`` for each trainable parameter.

    Raises:
        ValueError: If ``coef`` is not ``(B,)``, or as :func:`norm_layer_per_sample_grads`.
    """
    if coef.shape != activations[0].shape[:1]:
        raise ValueError(
            f"{type(layer).__name__} clipped sum: clip factors of shape {tuple(coef.shape)} "
            f"for an input of shape {tuple(activations[0].shape)} (one factor per sample)"
        )
    grads = norm_layer_per_sample_grads(layer, activations, backprops)
    ret: dict[nn.Parameter, torch.Tensor] = {}
    for p, g in grads.items():
        total = apply_clip_factors(coef, g, reduce=True)
        ret[p] = total.reshape(p.shape).to(p.dtype)
    return ret


def _register(*types: type[nn.Module]) -> None:
    register_sketched_norm_sampler(*types, exact=True)(compute_norm_layer_norm_sample)
    register_clipped_sum(*types)(compute_norm_layer_clipped_sum)
    for t in types:  # the (B, D) per-sample gradients, a smaller stash than (x, G) per token
        if t not in STASH_GRAD_SAMPLERS:
            STASH_GRAD_SAMPLERS[t] = norm_layer_per_sample_grads


def register_loaded_transformers_norms() -> list[type[nn.Module]]:
    """Register the closed forms for the :data:`TRANSFORMERS_RMS_NORMS` classes whose module
    is already imported (``transformers`` itself is never imported here).

    Idempotent; a class that already has a sampler or clipped sum (e.g. registered by the
    user) is left as it is.

    Returns:
        The classes registered by this call.
    """
    added = []
    for module_name, class_name in TRANSFORMERS_RMS_NORMS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            continue
        if cls in SKETCHED_NORM_SAMPLERS or cls in CLIPPED_SUM_FUNCTIONS:
            continue
        _register(cls)
        added.append(cls)
    return added


register_loaded_transformers_norms()
