"""Offline loading of the tutorials' pretrained models: SmolLM2-135M and all-MiniLM-L6-v2.

The loaders (:func:`load_smollm2`, :func:`load_smollm2_tokenizer`, :func:`load_minilm`, ...)
are the library's, :mod:`opacus_rc.models`, re-exported here; what follows describes them.
This module adds what only the tutorials use (freezing, the frozen LM-head loss, the disk
cache of features) and sets ``HF_HUB_OFFLINE=1`` before transformers is imported.

Nothing here touches the network: ``HF_HUB_OFFLINE=1`` is set before transformers is
imported, and every model is loaded from a local path.

The models, their cache directory and the loaders' conventions (train mode, ``use_cache``,
pad id, head seed, tied embeddings) are described in :mod:`opacus_rc.models`.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

# The loaders are the library's (one definition); re-exported for the tutorials.
from opacus_rc.models import (  # noqa: E402
    SMOLLM2_GGUF,
    ensure_smollm2_cache,
    load_minilm,
    load_minilm_tokenizer,
    load_smollm2,
    load_smollm2_tokenizer,
    minilm_path,
    smollm2_cache_dir,
    smollm2_gguf_path,
)

__all__ = [
    "SMOLLM2_GGUF",
    "smollm2_gguf_path",
    "smollm2_cache_dir",
    "ensure_smollm2_cache",
    "load_smollm2_tokenizer",
    "load_smollm2",
    "minilm_path",
    "load_minilm_tokenizer",
    "load_minilm",
    "freeze_all_but",
    "shared_parameters",
    "FrozenLMHeadLoss",
    "disk_cache_path",
    "disk_cached",
]


# --------------------------------------------------------------------------- helpers


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are the *same* tensor (e.g. tied embeddings)."""
    by_id: dict[int, list[str]] = {}
    for mod_name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            by_id.setdefault(id(p), []).append(f"{mod_name}.{p_name}" if mod_name else p_name)
    return [names for names in by_id.values() if len(names) > 1]


# --------------------------------------------------------------------------- freezing


def _parts(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module], list[nn.Module]]:
    """(layers, modules after the layers, head modules) for Llama- and BERT-style models."""
    base = getattr(model, "model", None)
    if base is not None and hasattr(base, "layers"):  # Llama family
        head = [m for m in (getattr(model, "score", None), getattr(model, "lm_head", None)) if m]
        return list(base.layers), [base.norm], head
    bert = getattr(model, "bert", None) or (model if hasattr(model, "encoder") else None)
    if bert is not None and hasattr(bert, "encoder"):  # BERT family (post-LN: no final norm)
        after = [bert.pooler] if getattr(bert, "pooler", None) is not None else []
        head = [model.classifier] if hasattr(model, "classifier") else []
        return list(bert.encoder.layer), after, head
    raise TypeError(f"freeze_all_but does not know the layout of {type(model).__name__}")


def freeze_all_but(
    model: nn.Module, *, trainable_layers: int, train_head: bool = True
) -> dict[str, int]:
    """Freeze everything except the last ``trainable_layers`` transformer layers,
    the modules after them (Llama: final RMSNorm; BERT: pooler) and the head.

    Embeddings are always frozen. For a causal LM whose ``lm_head`` is tied to the
    (frozen) input embeddings, ``train_head=True`` raises ``ValueError``: load it with
    ``tie_embeddings=False`` or pass ``train_head=False``.

    Returns:
        ``{"trainable": ..., "frozen": ..., "total": ..., "trainable_tensors": ...}``,
        counts of unique parameters (a tied tensor is counted once).
    """
    layers, after, head = _parts(model)
    if not 0 <= trainable_layers <= len(layers):
        raise ValueError(f"trainable_layers must be in [0, {len(layers)}], got {trainable_layers}")
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if (
        train_head
        and emb is not None
        and any(p is emb.weight for m in head for p in m.parameters())
    ):
        raise ValueError(
            "The head shares its weight with the input embeddings (tied), which stay "
            "frozen. Load the model with tie_embeddings=False to train an untied head, "
            "or pass train_head=False."
        )
    for p in model.parameters():
        p.requires_grad_(False)
    chosen = layers[len(layers) - trainable_layers :] + after + (head if train_head else [])
    for m in chosen:
        for p in m.parameters():
            p.requires_grad_(True)
    params = list(model.parameters())  # unique tensors
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    return {
        "trainable": trainable,
        "frozen": total - trainable,
        "total": total,
        "trainable_tensors": sum(1 for p in params if p.requires_grad),
    }


# --------------------------------------------------------------------------- language modelling


class _FrozenHeadCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of ``hidden @ weight.T``, chunked, with the gradient with respect
    to ``hidden`` formed in the forward pass (the "fused linear cross-entropy" trick)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, ignore_index):  # noqa: D102
        n = hidden.shape[0]
        losses = hidden.new_zeros(n)
        need_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        for start in range(0, n, chunk_tokens):
            h = hidden[start : start + chunk_tokens]
            t = targets[start : start + chunk_tokens]
            keep = t != ignore_index
            safe = torch.where(keep, t, torch.zeros_like(t))
            logits = h @ weight.T  # (n_chunk, V)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
            losses[start : start + chunk_tokens] = torch.where(keep, lse - picked, 0.0)
            if need_grad:  # d loss_t / d h_t = W^T (softmax_t - onehot_t), 0 where ignored
                probs = logits.sub_(lse.unsqueeze(1)).exp_()
                probs.scatter_add_(1, safe.unsqueeze(1), -torch.ones_like(lse).unsqueeze(1))
                probs.mul_(keep.unsqueeze(1).to(probs.dtype))
                grad_hidden[start : start + chunk_tokens] = probs @ weight
            del logits
        if need_grad:
            ctx.save_for_backward(grad_hidden)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):  # noqa: D102
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_losses.unsqueeze(1), None, None, None, None


class FrozenLMHeadLoss(nn.Module):
    """Next-token cross-entropy through a *frozen* LM head, without a ``(N, V)`` logits tensor.

    ``forward(hidden, targets)`` equals
    ``nn.CrossEntropyLoss(reduction=..., ignore_index=...)(hidden @ weight.T, targets)``
    but computes the logits ``chunk_tokens`` tokens at a time: at SmolLM2's vocabulary
    (V = 49,152) the logits of one 4,096-token sequence are 805 MB in float32, and autograd
    would keep them, their softmax and their gradient alive at once. Here each chunk's softmax
    is turned into the per-token gradient with respect to ``hidden``, ``W^T (softmax - onehot)``,
    straight away, so the forward pass costs the two head products (``hidden @ W.T`` and
    ``probs @ W``) that a plain forward and backward cost, and the backward pass only scales the
    stored ``(N, d)`` gradient by the incoming per-token weights. No recomputation (unlike
    ``torch.utils.checkpoint``, which would run the head three times). The standard "cut /
    fused linear cross-entropy" (Liger Kernel, Apple's cut-cross-entropy) for GPUs; these
    are Triton kernels, hence this CPU version.

    The gradient with respect to ``weight`` is not computed: the head must be frozen. SmolLM2
    ties its head to the input embeddings; training a tied head needs per-sample norms of the
    *summed* gradient of the shared matrix, which the library does not support yet.

    It has the ``reduction`` and ``ignore_index`` attributes that Opacus'
    ``DPLossFastGradientClipping`` (and ``opacus_rc``'s DP loss) read: with
    ``criterion(hidden.flatten(0, 1), targets.flatten(), shape=(B, T))`` the DP wrapper sets
    ``reduction="none"`` and averages each sequence's ``T`` token losses into one per-sample
    loss (the privacy unit is the sequence).

    Args:
        weight: ``(V, d)`` head matrix (``lm_head.weight``); must not require a gradient.
        chunk_tokens: Tokens per chunk (memory ``chunk_tokens * V`` floats).
        reduction: ``"mean"`` (over non-ignored tokens), ``"sum"`` or ``"none"``.
        ignore_index: Target value whose tokens get loss 0 and no gradient.

    Shapes:
        ``hidden``: ``(N, d)`` float; ``targets``: ``(N,)`` int64. Output: ``(N,)`` for
        ``reduction="none"``, else a scalar, in nats.

    Raises:
        ValueError: if ``weight`` requires a gradient, or on an unknown ``reduction``.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        chunk_tokens: int = 1024,
        reduction: str = "mean",
        ignore_index: int = -100,
    ) -> None:
        super().__init__()
        if weight.requires_grad:
            raise ValueError(
                "FrozenLMHeadLoss computes no gradient for the head matrix; freeze it "
                "(weight.requires_grad_(False)) or use nn.CrossEntropyLoss on the logits"
            )
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.weight = weight  # a reference, not a registered parameter: the model owns it
        self.chunk_tokens = chunk_tokens
        self.reduction = reduction
        self.ignore_index = ignore_index

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {self.reduction!r}")
        if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
            raise ValueError(
                f"expected hidden (N, d) and targets (N,), got {tuple(hidden.shape)} and "
                f"{tuple(targets.shape)}; flatten the batch and time dimensions first"
            )
        losses = _FrozenHeadCrossEntropy.apply(
            hidden, self.weight.to(hidden.dtype), targets, self.chunk_tokens, self.ignore_index
        )
        if self.reduction == "none":
            return losses
        if self.reduction == "sum":
            return losses.sum()
        return losses.sum() / (targets != self.ignore_index).sum().clamp(min=1)


def disk_cache_path(name: str, key: bytes) -> Path:
    """Where :func:`disk_cached` keeps the value for ``(name, key)``:
    ``<cache root>/tutorial_features/<name>-<first 16 hex digits of sha256(key)>.pt``, the cache
    root being the parent of :func:`smollm2_cache_dir` (``~/.cache/opacus_rc`` by default)."""
    import hashlib

    digest = hashlib.sha256(key).hexdigest()[:16]
    return smollm2_cache_dir().parent / "tutorial_features" / f"{name}-{digest}.pt"


def disk_cached(name: str, key: bytes, compute, *, enabled: bool = True):
    """``compute()``'s value (anything ``torch.save`` takes), saved at
    :func:`disk_cache_path` and reloaded while ``key`` -- everything the value depends on, as
    bytes -- is unchanged. ``enabled=False`` always computes and writes nothing (smoke runs).
    The file is written under a temporary name and renamed, so an interrupted run leaves no
    partial entry."""
    path = disk_cache_path(name, key)
    if enabled and path.is_file():
        return torch.load(path)
    value = compute()
    if enabled:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(value, tmp)
        tmp.rename(path)
    return value
