"""Exact per-sample gradient norms and the clipped gradient sum of ``nn.EmbeddingBag``.

An ``nn.EmbeddingBag`` with ``B`` bags (one bag per sample) returns, for bag ``i`` with the
positions ``t in bag(i)``, ids ``x_t`` and per-sample weights ``w_t`` (1 without
``per_sample_weights``), ``out_i = s_i sum_{t in bag(i), x_t != P} w_t W[x_t]``, with ``P`` the
``padding_idx`` and ``s_i = 1`` for ``mode="sum"``, ``s_i = 1 / #{t in bag(i): x_t != P}`` for
``mode="mean"`` (the padding entries are not counted; an empty bag gives zeros). With ``g_i``
the gradient of ``loss_i`` with respect to ``out_i`` (``d``), the weight gradient of sample
``i`` is the outer product ``grad_W loss_i = a_i g_i^T`` with ``a_i`` the ``V``-vector
``a_{i,v} = s_i sum_{t in bag(i), x_t = v != P} w_t`` (the rows of repeated ids *add up*).
Hence

    ||grad_W loss_i||_F = ||g_i|| * ||a_i||,   ||a_i||^2 = sum_v a_{i,v}^2,

which :func:`compute_embedding_bag_norm_sample` evaluates exactly, in ``O(N log N + B d)``
time for ``N`` ids, with no ``B x V x d`` tensor and no host synchronisation: the (bag, id)
pairs are sorted, equal pairs summed with ``index_add_``, squared, and summed per bag, all in
float64 (``N`` scalars).

Opacus' sampler (``opacus/grad_sample/embedding.py``, ``compute_embeddingbag_gradsampler``)
writes ``gsm[i][index[begin:end]] += backprops[i]``: an indexed ``+=`` with a repeated index
adds once, so a bag ``[7] * 8`` got ``||g_i||`` instead of ``8 ||g_i||`` (the per-sample norm
8x too small, and a released contribution above the clipping norm). It also ignores
``padding_idx`` and ``per_sample_weights`` and fails on 2-D ids without offsets; this module
replaces it for randomized clipping (Opacus' registry is left as it is).

:func:`compute_embedding_bag_clipped_sum` is the book-keeping clipped gradient sum (Bu, Wang,
Zha and Karypis, ICML 2023): ``sum_i c_i a_i g_i^T``, one ``index_add_`` of the rows
``c_i a_t g_i`` at ``x_t``.

**Stored inputs.** The forward call ``bag(input, offsets=None, per_sample_weights=None)`` is
recorded in one canonical form (:func:`embedding_bag_inputs`): ``[ids (N,), offsets (B,)]`` or
``[ids, weights (N,), offsets]``, the offsets being the start of each bag (2-D ids ``(B, L)``
become ``N = B L`` ids with offsets ``0, L, 2L, ...``; with ``include_last_offset=True`` the
last offset is dropped: PyTorch ends the last bag at ``N`` whatever it says). The offsets come
last so that Opacus reads the batch size ``B`` from them.

Supported: ``mode="sum"`` and ``"mean"``, 1-D ids with offsets, 2-D ids without, ``padding_idx``,
``per_sample_weights`` (``"sum"`` only, as in PyTorch) and ``include_last_offset``. Refused
before the first forward pass (:func:`check_embedding_bag`): ``mode="max"`` (the gradient goes to
the arg-max row of every coordinate: not implemented here), ``max_norm``,
``scale_grad_by_freq`` and ``sparse=True`` (as for ``nn.Embedding``, for the same reasons).

The sampler is exact: it ignores the sketch arguments and draws no probe (registered with
``exact=True``: exact layers inside a sketched step are covered by the accountant,
docs/privacy/envelope.md#envelope-definition, Lemma D).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from opacus_rc.grad_sample.clip import apply_clip_factors
from opacus_rc.grad_sample.registry import (
    register_clipped_sum,
    register_forward_input_adapter,
    register_module_check,
    register_sketched_norm_sampler,
)
from opacus_rc.sketching import autocast_off

__all__ = [
    "check_embedding_bag",
    "compute_embedding_bag_clipped_sum",
    "compute_embedding_bag_norm_sample",
    "embedding_bag_inputs",
]


@register_module_check(nn.EmbeddingBag)
def check_embedding_bag(layer: nn.EmbeddingBag) -> None:
    """Refuse ``nn.EmbeddingBag`` options randomized clipping cannot make private.

    * ``max_norm`` (trainable or frozen): the forward renormalises, in place and without noise,
      the rows each batch looks up (see :func:`~opacus_rc.grad_sample.embedding.check_embedding`).
    * ``mode="max"`` (trainable): each output coordinate's gradient goes to the row that holds
      the maximum; its per-sample norm is not implemented here.
    * ``scale_grad_by_freq`` (trainable): a sample's gradient depends on the other samples.
    * ``sparse=True`` (trainable): the noised gradient is dense anyway.

    Args:
        layer: The embedding bag.

    Raises:
        ValueError: Naming the option and what to do.
    """
    if layer.max_norm is not None:
        raise ValueError(
            f"nn.EmbeddingBag(max_norm={layer.max_norm}) renormalises, in place and without "
            "noise, the embedding rows each batch looks up: which rows change depends on the "
            "private data, so the released weights would not be differentially private. "
            "Construct it with max_norm=None (clip the gradients, not the weights)."
        )
    if not layer.weight.requires_grad:
        return
    if layer.mode not in ("sum", "mean"):
        raise ValueError(
            f"nn.EmbeddingBag(mode={layer.mode!r}) is not supported by randomized clipping: "
            "its per-sample gradient (each coordinate's gradient goes to the row holding the "
            "maximum) has no sampler here. Use mode='sum' or mode='mean', or freeze the layer."
        )
    if layer.scale_grad_by_freq:
        raise ValueError(
            "nn.EmbeddingBag(scale_grad_by_freq=True) divides each id's gradient by its count in "
            "the whole batch, so one sample's gradient depends on the other samples and "
            "per-sample clipping does not bound its contribution. Use scale_grad_by_freq=False, "
            "or freeze the layer."
        )
    if layer.sparse:
        raise ValueError(
            "nn.EmbeddingBag(sparse=True) is not supported by randomized clipping: the noise of "
            "DP-SGD is added to every row, so the private gradient is dense anyway. Use "
            "sparse=False (and a dense optimizer), or freeze the layer."
        )


def _integer(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex())


@register_forward_input_adapter(nn.EmbeddingBag)
def embedding_bag_inputs(
    layer: nn.EmbeddingBag, inputs: Sequence[Any], *, batch_first: bool = True
) -> list[torch.Tensor]:
    """The canonical stored form of one ``nn.EmbeddingBag`` call (see the module docstring).

    Args:
        layer: The embedding bag.
        inputs: The call's positional inputs in the order of ``forward``'s signature (keyword
            arguments bound to their positions): ``(input, offsets, per_sample_weights)``, the
            trailing ones possibly missing or None.
        batch_first: The grad-sample module's ``batch_first``; must be True (the output of an
            embedding bag is always ``(B, d)``).

    Returns:
        ``[ids (N,), offsets (B,)]`` or ``[ids (N,), weights (N,), offsets (B,)]``, detached.

    Raises:
        ValueError: ``batch_first=False``, ids that are not an integer tensor of rank 1 or 2,
            1-D ids without offsets, 2-D ids with offsets, or per-sample weights of another
            shape than the ids.
    """
    if not batch_first:
        raise ValueError(
            "nn.EmbeddingBag returns (B, d) whatever the layout of its input, so it needs "
            "batch_first=True (the default) in make_private / the grad-sample module"
        )
    ids, offsets, weights = (*inputs, None, None, None)[:3]
    if not _integer(ids) or ids.dim() not in (1, 2):
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(
            f"nn.EmbeddingBag input must be an integer tensor of rank 1 (with offsets) or 2 "
            f"(one bag per row), got {shape}"
        )
    ids = ids.detach()
    if ids.dim() == 2:
        if offsets is not None:
            raise ValueError(
                "nn.EmbeddingBag: offsets must be None when the input is 2-D (one bag per row)"
            )
        B, L = ids.shape
        offsets = torch.arange(B, device=ids.device, dtype=torch.long) * L
        ids = ids.reshape(B * L)
    else:
        if not _integer(offsets) or offsets.dim() != 1:
            raise ValueError(
                "nn.EmbeddingBag with a 1-D input needs offsets, an integer tensor of rank 1 "
                "(the start of each bag)"
            )
        offsets = offsets.detach().long()
        if layer.include_last_offset:
            offsets = offsets[:-1]  # PyTorch ends the last bag at N anyway
    out = [ids.long()]
    if weights is not None:
        if not isinstance(weights, torch.Tensor) or weights.numel() != ids.numel():
            raise ValueError(
                "nn.EmbeddingBag per_sample_weights must have the shape of the input "
                f"({ids.numel()} ids)"
            )
        out.append(weights.detach().reshape(ids.numel()))
    out.append(offsets)
    return out


def _unpack(
    layer: nn.EmbeddingBag, activations: list[torch.Tensor], G: torch.Tensor, what: str
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(ids, weights or None, offsets)`` from the stored inputs, checked against ``G``.

    Raises:
        ValueError: An unsupported option, or inputs not in the canonical form.
    """
    check_embedding_bag(layer)
    if len(activations) not in (2, 3):
        raise ValueError(
            f"nn.EmbeddingBag {what}: expected the stored inputs [ids, offsets] or [ids, "
            f"weights, offsets] (embedding_bag_inputs), got {len(activations)} tensors"
        )
    ids, offsets = activations[0], activations[-1]
    weights = activations[1] if len(activations) == 3 else None
    B, d = offsets.shape[0], layer.embedding_dim
    if ids.dim() != 1 or G.shape != (B, d):
        raise ValueError(
            f"nn.EmbeddingBag {what}: {B} bags and {tuple(ids.shape)} ids do not match an "
            f"output gradient of shape {tuple(G.shape)} (expected ({B}, {d}))"
        )
    return ids, weights, offsets


def _coefficients(
    layer: nn.EmbeddingBag,
    ids: torch.Tensor,
    weights: torch.Tensor | None,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each id's bag ``b_t`` and coefficient ``s_{b_t} w_t`` (0 at padding), float64, ``(N,)``."""
    N, B = ids.shape[0], offsets.shape[0]
    positions = torch.arange(N, device=ids.device)
    bag = (torch.searchsorted(offsets, positions, right=True) - 1).clamp(min=0)
    coef = (
        torch.ones(N, device=ids.device, dtype=torch.float64)
        if weights is None
        else weights.to(torch.float64)
    )
    pad = layer.padding_idx  # nn.EmbeddingBag normalises a negative padding_idx
    if pad is not None:
        coef = coef.masked_fill(ids == pad, 0.0)
    if layer.mode == "mean":
        counted = torch.ones_like(coef) if pad is None else (ids != pad).to(torch.float64)
        count = torch.zeros(B, device=ids.device, dtype=torch.float64).index_add_(0, bag, counted)
        coef = coef / count.clamp(min=1.0)[bag]
    return bag, coef


@register_sketched_norm_sampler(nn.EmbeddingBag, exact=True)
def compute_embedding_bag_norm_sample(
    layer: nn.EmbeddingBag,
    activations: list[torch.Tensor],
    backprops: torch.Tensor,
    *,
    estimator: Callable[..., torch.Tensor] | None = None,
    sketch_dim: int | None = None,
    generator: torch.Generator | None = None,
) -> dict[nn.Parameter, torch.Tensor]:
    """Exact per-sample gradient norms of an ``nn.EmbeddingBag`` weight (module docstring).

    ``n_i = ||g_i|| sqrt(sum_v a_{i,v}^2)`` with ``a_{i,v}`` the summed coefficients of id
    ``v`` in bag ``i``. The sketch arguments are accepted for the sampler signature and
    ignored (no probe is drawn).

    Args:
        layer: The embedding bag (weight ``V x d``).
        activations: The stored inputs (:func:`embedding_bag_inputs`): ``[ids (N,), offsets
            (B,)]`` or ``[ids, weights (N,), offsets]``.
        backprops: ``G``, ``(B, d)``: the gradient of the output with respect to the
            per-sample losses, any floating dtype.
        estimator: Ignored (exact).
        sketch_dim: Ignored (exact).
        generator: Ignored (exact).

    Returns:
        ``{layer.weight: (B,) tensor}`` of per-sample gradient **norms** (float32, or float64
        for a float64 ``G``); ``{}`` if the weight is frozen.

    Raises:
        ValueError: Inputs not in the canonical form or an unsupported option
            (:func:`check_embedding_bag`).
    """
    del estimator, sketch_dim, generator  # exact: nothing is sketched
    if not layer.weight.requires_grad:
        return {}
    G = backprops
    ids, weights, offsets = _unpack(layer, activations, G, "norm sampler")
    B, N, V = offsets.shape[0], ids.shape[0], layer.num_embeddings
    out_dtype = torch.float64 if G.dtype == torch.float64 else torch.float32
    with autocast_off(G.device):
        g_norm = torch.linalg.vector_norm(G, dim=1, dtype=torch.float64)  # (B,)
        if N == 0:
            return {layer.weight: torch.zeros(B, device=G.device, dtype=out_dtype)}
        bag, coef = _coefficients(layer, ids, weights, offsets)
        # Sum the coefficients of equal (bag, id) pairs: sort the keys, number the groups.
        key, order = torch.sort(bag * V + ids)
        starts = torch.ones_like(key, dtype=torch.bool)
        starts[1:] = key[1:] != key[:-1]
        group = torch.cumsum(starts, dim=0) - 1
        sums = torch.zeros(N, device=ids.device, dtype=torch.float64)
        sums.index_add_(0, group, coef[order])
        per_pair = torch.where(starts, sums[group].square(), torch.zeros_like(sums))
        a_sq = torch.zeros(B, device=ids.device, dtype=torch.float64)
        a_sq.index_add_(0, bag[order], per_pair)
        norm = g_norm * a_sq.to(g_norm.device).sqrt()
    return {layer.weight: norm.to(out_dtype)}


@register_clipped_sum(nn.EmbeddingBag)
def compute_embedding_bag_clipped_sum(
    layer: nn.EmbeddingBag,
    activations: list[torch.Tensor],
    backprops: torch.Tensor,
    coef: torch.Tensor,
) -> dict[nn.Parameter, torch.Tensor]:
    """Clipped gradient sum of an ``nn.EmbeddingBag`` weight (book-keeping, Bu et al. 2023).

    ``sum_i c_i a_i g_i^T``: one ``index_add_`` of the rows ``c_{b_t} s_{b_t} w_t g_{b_t}`` into
    a ``(V, d)`` zero tensor at rows ``x_t`` (the padding row stays zero, as in autograd),
    accumulated in float32 (float64 for float64 inputs) with autocast off; the result has the
    weight's dtype. No random number is drawn and no host synchronisation happens.

    Args:
        layer: The embedding bag (weight ``V x d``).
        activations: The stored inputs (:func:`embedding_bag_inputs`).
        backprops: ``G``, ``(B, d)``, already rescaled to per-sample losses.
        coef: ``c``, the clip factors, ``(B,)``.

    Returns:
        ``{layer.weight: (V, d) tensor}``; ``{}`` if the weight is frozen.

    Raises:
        ValueError: Inputs not in the canonical form, clip factors of the wrong shape, or an
            unsupported option (:func:`check_embedding_bag`).
    """
    if not layer.weight.requires_grad:
        return {}
    G = backprops
    ids, weights, offsets = _unpack(layer, activations, G, "clipped sum")
    B, d = G.shape
    if coef.shape != (B,):
        raise ValueError(
            f"nn.EmbeddingBag clipped sum: clip factors of shape {tuple(coef.shape)} for {B} "
            "bags (one factor per sample expected)"
        )
    acc = torch.promote_types(G.dtype, torch.float32)
    with autocast_off(G.device):
        weight = torch.zeros(layer.num_embeddings, d, device=G.device, dtype=acc)
        if ids.shape[0]:
            bag, per_id = _coefficients(layer, ids, weights, offsets)
            scale = apply_clip_factors(coef, per_id, dtype=torch.float64, sample_of=bag)
            scale = scale.to(acc)
            rows = G.to(acc)[bag.to(G.device)] * scale.to(G.device).unsqueeze(1)
            weight.index_add_(0, ids.to(G.device), rows)
    return {layer.weight: weight.to(layer.weight.dtype)}
