"""Exact per-sample gradient norms and the clipped gradient sum of ``nn.Embedding``.

For sample ``i`` with token ids ``x_{i,1..T}`` and output gradient rows ``g_{i,t}`` (``d``), the
weight gradient is ``grad_W loss_i = sum_t e_{x_{i,t}} g_{i,t}^T`` (``V x d``): its row ``v`` is
``sum_{t: x_{i,t} = v} g_{i,t}``, and the row of ``padding_idx`` is zero (autograd skips the
padding positions: ``torch.nn.functional.embedding``). Hence, with ``P`` the padding id,

    ||grad_W loss_i||_F^2 = sum_{v in x_i, v != P} || sum_{t: x_{i,t} = v} g_{i,t} ||^2,

the identity behind Opacus' ghost norm of the embedding
(``opacus/grad_sample/embedding_norm_sample.py``, which however counts the padding row, and
uses ``torch.unique``, whose output size is data dependent: a host synchronisation).

:func:`compute_embedding_norm_sample` evaluates it exactly in ``O(B T d)`` time and memory
(plus an ``O(B T log T)`` sort of the ids), never forming a ``B x V x d`` gradient or a
``T x T`` Gram matrix, and without a host synchronisation (every size is fixed by the input
shapes):

1. sort each sample's ids (``torch.sort(ids, dim=1)``); a group of equal ids starts where the
   sorted id changes, so ``cumsum`` of the start flags over the flattened ``(B, T)`` array
   numbers the (sample, id) groups ``0, 1, ...`` (a sample's first position always starts a
   group, so groups never span two samples);
2. ``index_add_`` the gradient rows into a ``(B T, d)`` buffer at their group number (rows
   beyond the number of groups stay zero), padding positions zeroed;
3. the squared norms of the buffer rows, summed over the groups of each sample.

The gradient rows are scaled per sample by a power of two (exact) so that the float32 squares
cannot overflow, accumulated in float32 (float64 for float64 inputs) whatever the input
dtype (bf16/fp16 included), and the norm is rescaled in float64.

:func:`compute_embedding_clipped_sum` is the book-keeping clipped gradient sum (Bu, Wang, Zha
and Karypis, ICML 2023): ``sum_i c_i grad_W loss_i``, one ``index_add_`` of the rows
``c_i g_{i,t}`` into a ``(V, d)`` zero tensor at rows ``x_{i,t}``, padding positions skipped.
With it a trainable embedding keeps the single backward pass.

:func:`check_embedding` refuses, before any hook is attached, the options whose gradient or
forward pass cannot be made private here: ``max_norm`` (the forward renormalises, in place and
unnoised, exactly the rows the private batch selects), ``scale_grad_by_freq`` (a sample's
gradient depends on the other samples' tokens) and ``sparse=True``.

The sampler is exact: it ignores the sketch arguments and draws no probe (registered with
``exact=True``; exact layers inside a sketched step are covered by the accountant,
docs/privacy/envelope.md#envelope-definition, Lemma D).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from opacus_rc.grad_sample.clip import apply_clip_factors
from opacus_rc.grad_sample.registry import (
    register_clipped_sum,
    register_module_check,
    register_sketched_norm_sampler,
)
from opacus_rc.sketching import autocast_off, pow2_scale, sample_absmax

__all__ = ["check_embedding", "compute_embedding_clipped_sum", "compute_embedding_norm_sample"]


@register_module_check(nn.Embedding)
def check_embedding(layer: nn.Embedding) -> None:
    """Refuse ``nn.Embedding`` options randomized clipping cannot make private.

    * ``max_norm`` (trainable or frozen): ``F.embedding`` renormalises, in place and outside
      autograd, the rows the batch looks up whose norm exceeds ``max_norm``; which rows change
      depends on the private batch and is neither clipped nor noised.
    * ``scale_grad_by_freq`` (trainable): the gradient of a token is divided by its frequency
      in the whole batch, so one sample's gradient depends on the others' tokens and its
      sensitivity is not bounded by the clipping norm.
    * ``sparse=True`` (trainable): the noised gradient is dense (noise on every row), and the
      clipped sum is written densely.

    Args:
        layer: The embedding.

    Raises:
        ValueError: Naming the option and what to do.
    """
    if layer.max_norm is not None:
        raise ValueError(
            f"nn.Embedding(max_norm={layer.max_norm}) renormalises, in place and without noise, "
            "the embedding rows each batch looks up: which rows change depends on the private "
            "data, so the released weights would not be differentially private. Construct the "
            "embedding with max_norm=None (clip the gradients, not the weights)."
        )
    if not layer.weight.requires_grad:
        return
    if layer.scale_grad_by_freq:
        raise ValueError(
            "nn.Embedding(scale_grad_by_freq=True) divides each token's gradient by its count in "
            "the whole batch, so one sample's gradient depends on the other samples and per-sample "
            "clipping does not bound its contribution. Use scale_grad_by_freq=False, or freeze "
            "the embedding."
        )
    if layer.sparse:
        raise ValueError(
            "nn.Embedding(sparse=True) is not supported by randomized clipping: the noise of "
            "DP-SGD is added to every row, so the private gradient is dense anyway. Use "
            "sparse=False (and a dense optimizer), or freeze the embedding."
        )


def _padding_index(layer: nn.Embedding) -> int | None:
    """``layer.padding_idx`` normalised as ``F.embedding`` does (negative counts from the end).

    Raises:
        ValueError: If it is outside ``[-V, V)``.
    """
    pad = layer.padding_idx
    if pad is None:
        return None
    V = layer.num_embeddings
    if not -V <= pad < V:
        raise ValueError(f"nn.Embedding padding_idx={pad} is outside [-{V}, {V})")
    return pad + V if pad < 0 else pad


def _ids_and_rows(
    layer: nn.Embedding, activations: list[torch.Tensor], backprops: torch.Tensor, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids as ``(B, T)`` and the output gradient as ``(B, T, d)`` (``T`` = positions per
    sample, flattened), after checking the layer's options and the shapes.

    Raises:
        ValueError: An unsupported option (:func:`check_embedding`), or ids and gradient whose
            shapes disagree.
    """
    check_embedding(layer)
    ids = activations[0]
    G = backprops
    d = layer.embedding_dim
    if ids.dim() < 1 or ids.is_floating_point() or ids.is_complex() or G.shape != (*ids.shape, d):
        raise ValueError(
            f"nn.Embedding {what}: ids of shape {tuple(ids.shape)} (dtype {ids.dtype}) do not "
            f"match an output gradient of shape {tuple(G.shape)} (integer ids, batch first, "
            f"gradient of shape ids.shape + ({d},) expected)"
        )
    B = ids.shape[0]
    T = math.prod(ids.shape[1:])  # 1 for ids of shape (B,); explicit, so that B = 0 reshapes
    return ids.reshape(B, T).long(), G.reshape(B, T, d)


@register_sketched_norm_sampler(nn.Embedding, exact=True)
def compute_embedding_norm_sample(
    layer: nn.Embedding,
    activations: list[torch.Tensor],
    backprops: torch.Tensor,
    *,
    estimator: Callable[..., torch.Tensor] | None = None,
    sketch_dim: int | None = None,
    generator: torch.Generator | None = None,
) -> dict[nn.Parameter, torch.Tensor]:
    """Exact per-sample gradient norms of an ``nn.Embedding`` weight (see the module docstring).

    ``n_i = sqrt(sum_{v in x_i, v != padding_idx} ||sum_{t: x_{i,t} = v} g_{i,t}||^2)``, in
    ``O(B T d)`` time and memory, with no host synchronisation. The sketch arguments are
    accepted for the sampler signature and ignored (no probe is drawn).

    Args:
        layer: The embedding (weight ``V x d``).
        activations: ``[x]`` with ``x`` the integer ids, of shape ``(B,)`` or ``(B, ...)``,
            batch first.
        backprops: ``G`` of shape ``x.shape + (d,)``: the gradient of the layer output with
            respect to the per-sample losses (Opacus multiplies by ``B`` under
            ``loss_reduction="mean"``), any floating dtype.
        estimator: Ignored (exact).
        sketch_dim: Ignored (exact).
        generator: Ignored (exact).

    Returns:
        ``{layer.weight: (B,) tensor}`` of per-sample gradient **norms** (float32, or float64
        for a float64 ``G``); ``{}`` if the weight is frozen.

    Raises:
        ValueError: If the ids and gradient shapes disagree, ``padding_idx`` is out of range,
            or the layer uses ``max_norm``, ``scale_grad_by_freq`` or ``sparse=True``
            (:func:`check_embedding`).
    """
    del estimator, sketch_dim, generator  # exact: nothing is sketched
    if not layer.weight.requires_grad:
        return {}
    ids, G = _ids_and_rows(layer, activations, backprops, "norm sampler")
    pad = _padding_index(layer)
    B, T, d = G.shape
    out_dtype = torch.float64 if G.dtype == torch.float64 else torch.float32
    if G.numel() == 0:  # B = 0, no position, or d = 0: every gradient is zero
        return {layer.weight: torch.zeros(B, device=G.device, dtype=out_dtype)}
    acc = torch.promote_types(G.dtype, torch.float32)
    with autocast_off(G.device):
        # Per-sample power-of-two scale: max |entry| in [0.5, 1) (or below, for tiny gradients),
        # so a group sum is <= T in absolute value and its float32 square cannot overflow, nor a
        # nonzero square underflow. Exact, no host sync.
        amax = sample_absmax(G).to(acc)
        scale, exponent = pow2_scale(amax)
        rows = G.to(acc) * scale.view(B, 1, 1)
        if pad is not None:  # autograd gives the padding row nothing (also for NaN/inf rows)
            rows.masked_fill_((ids == pad).unsqueeze(-1), 0)
        # (1) group the equal ids of each sample.
        sorted_ids, order = torch.sort(ids, dim=1)
        starts = torch.ones_like(sorted_ids, dtype=torch.bool)
        starts[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
        starts = starts.reshape(B * T)
        group_sorted = torch.cumsum(starts, dim=0) - 1  # group number, in sorted order
        flat_order = (order + torch.arange(B, device=ids.device).view(B, 1) * T).reshape(B * T)
        group = torch.empty_like(group_sorted).scatter_(0, flat_order, group_sorted)
        # (2) the row of grad_W loss_i that each group gives.
        sums = torch.zeros(B * T, d, device=G.device, dtype=acc)
        sums.index_add_(0, group, rows.reshape(B * T, d))
        del rows
        # (3) squared row norms, counted once per group (at its first sorted position).
        row_sq = torch.linalg.vector_norm(sums, dim=1).square()
        per_position = torch.where(starts, row_sq[group_sorted], torch.zeros_like(row_sq))
        sq = per_position.view(B, T).sum(dim=1, dtype=torch.float64)
        norm = torch.ldexp(sq.sqrt(), exponent.to(sq.device))
    return {layer.weight: norm.to(out_dtype)}


@register_clipped_sum(nn.Embedding)
def compute_embedding_clipped_sum(
    layer: nn.Embedding,
    activations: list[torch.Tensor],
    backprops: torch.Tensor,
    coef: torch.Tensor,
) -> dict[nn.Parameter, torch.Tensor]:
    """Clipped gradient sum of an ``nn.Embedding`` weight (book-keeping, Bu et al., ICML 2023).

    ``sum_i c_i grad_W loss_i``: one ``index_add_`` of the rows ``c_i g_{i,t}`` into a
    ``(V, d)`` zero tensor at rows ``x_{i,t}``, the padding positions skipped (the padding row
    stays zero, as in autograd). This is the gradient a second backward pass of
    ``sum_i c_i loss_i`` would give the weight. Accumulated in float32 (float64 for float64
    inputs) with autocast disabled; the result has the weight's dtype. No random number is
    drawn and no host synchronisation happens.

    Args:
        layer: The embedding (weight ``V x d``).
        activations: ``[x]``, integer ids of shape ``(B,)`` or ``(B, ...)``, batch first.
        backprops: ``G`` of shape ``x.shape + (d,)``, already rescaled to per-sample losses.
        coef: ``c``, the clip factors, shape ``(B,)``.

    Returns:
        ``{layer.weight: (V, d) tensor}``; ``{}`` if the weight is frozen.

    Raises:
        ValueError: If the ids, gradient and clip-factor shapes disagree, ``padding_idx`` is
            out of range, or the layer uses an unsupported option (:func:`check_embedding`).
    """
    if not layer.weight.requires_grad:
        return {}
    ids, G = _ids_and_rows(layer, activations, backprops, "clipped sum")
    if coef.shape != ids.shape[:1]:
        raise ValueError(
            f"nn.Embedding clipped sum: clip factors of shape {tuple(coef.shape)} for a batch "
            f"of {ids.shape[0]} samples (one factor per sample expected)"
        )
    pad = _padding_index(layer)
    B, T, d = G.shape
    acc = torch.promote_types(G.dtype, torch.float32)
    with autocast_off(G.device):
        rows = apply_clip_factors(coef, G, dtype=acc)
        if pad is not None:
            rows.masked_fill_((ids == pad).unsqueeze(-1), 0)
        weight = torch.zeros(layer.num_embeddings, d, device=G.device, dtype=acc)
        weight.index_add_(0, ids.reshape(B * T), rows.reshape(B * T, d))
    return {layer.weight: weight.to(layer.weight.dtype)}
