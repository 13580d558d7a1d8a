"""Models and real token batches for the benchmarks that run a transformer (items 2 and 3).

* ``"smollm2"``: the packaged pretrained SmolLM2-135M as ``LlamaForSequenceClassification``
  (``tutorials/rc_models.py``: ``load_smollm2(task="classification")``), tokenized with its
  own BPE tokenizer.
* ``"tiny-llama"``: a randomly initialised 3-layer Llama classifier built from a config, for
  ``--quick`` runs (no files, no dequantization); byte-level token ids.

Text is the vendored Brown corpus (``tutorials/data/brown.jsonl.gz``): each sample is one
document, continued by the next documents when it is shorter than ``T`` tokens.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.common import REPO_ROOT

BROWN = REPO_ROOT / "tutorials" / "data" / "brown.jsonl.gz"


def tiny_llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    kwargs = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "num_labels": 2,
        "pad_token_id": 0,
        "use_cache": False,
    }
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def load_model(cfg: dict[str, Any]) -> nn.Module:
    """The classifier named by ``cfg["model"]``, in train mode, float32."""
    name = cfg["model"]
    attn = cfg.get("attn_implementation", "sdpa")
    if name == "smollm2":
        from tutorials.rc_models import load_smollm2

        return load_smollm2(
            task="classification",
            num_labels=cfg.get("num_labels", 2),
            seed=cfg.get("seed", 0),
            attn_implementation=attn,
        )
    if name == "tiny-llama":
        from transformers import LlamaForSequenceClassification

        torch.manual_seed(cfg.get("seed", 0))
        config = tiny_llama_config(num_labels=cfg.get("num_labels", 2))
        config._attn_implementation = attn
        return LlamaForSequenceClassification(config).train()
    raise ValueError(f"unknown model {name!r}; use 'smollm2' or 'tiny-llama'")


def encoder(cfg: dict[str, Any], model: nn.Module) -> Callable[[str], list[int]]:
    """Text to token ids for ``cfg["model"]``."""
    if cfg["model"] == "smollm2":
        from tutorials.rc_models import load_smollm2_tokenizer

        tok = load_smollm2_tokenizer()
        return lambda text: tok(text, add_special_tokens=False)["input_ids"]
    vocab = model.config.vocab_size
    # Byte-level ids, shifted past the pad id 0.
    return lambda text: [1 + b % (vocab - 1) for b in text.encode("utf-8")]


def brown_records() -> list[dict[str, Any]]:
    with gzip.open(BROWN, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def brown_batch(
    encode: Callable[[str], list[int]], *, batch_size: int, seq_len: int, seed: int, num_labels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` Brown documents of exactly ``seq_len`` tokens and their labels.

    Documents are drawn in a seeded order; a document shorter than ``seq_len`` tokens is
    continued with the following ones (no padding, so the last position is a real token).

    Returns:
        ``(input_ids, labels)`` of shapes ``(B, T)`` and ``(B,)`` (labels mod ``num_labels``).
    """
    records = brown_records()
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    ids, labels = [], []
    pos = 0
    for _ in range(batch_size):
        first = records[order[pos % len(order)]]
        tokens: list[int] = []
        while len(tokens) < seq_len:
            tokens += encode(records[order[pos % len(order)]]["text"] + "\n\n")
            pos += 1
        ids.append(tokens[:seq_len])
        labels.append(int(first["label"]) % num_labels)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def freeze_all_but_last(model: nn.Module, trainable_layers: int) -> dict[str, int]:
    """The tutorials' setting: last ``trainable_layers`` blocks, final norm and head trainable.

    Uses ``tutorials.rc_models.freeze_all_but`` (embeddings always frozen).
    """
    from tutorials.rc_models import freeze_all_but

    return freeze_all_but(model, trainable_layers=trainable_layers)


# ----------------------------------------------------------------------------------------------
# The SmolLM2-135M architecture as a causal LM, randomly initialised (issues 12 and 13)
# ----------------------------------------------------------------------------------------------

SMOLLM2_ARCH = {  # SmolLM2-135M's shapes (the packaged model's config)
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}


def causal_lm_config(arch: str = "smollm2", **overrides: Any) -> Any:
    """A ``LlamaConfig`` for a causal LM: ``"smollm2"`` (SmolLM2-135M's shapes, tied
    embeddings) or ``"tiny-llama"`` (:func:`tiny_llama_config`, tied too), with ``overrides``.
    """
    from transformers import LlamaConfig

    if arch == "smollm2":
        kwargs = dict(SMOLLM2_ARCH, max_position_embeddings=8192, use_cache=False)
        kwargs.update(overrides)
        return LlamaConfig(**kwargs)
    if arch == "tiny-llama":
        return tiny_llama_config(**{"tie_word_embeddings": True, **overrides})
    raise ValueError(f"unknown architecture {arch!r}; use 'smollm2' or 'tiny-llama'")


def build_causal_lm(
    config: Any, *, device: torch.device | str = "cpu", seed: int = 0, attn: str = "sdpa"
) -> nn.Module:
    """``LlamaForCausalLM(config)``, randomly initialised on ``device`` (``"meta"``: shapes
    only, no memory), in train mode, float32, with every block and the final norm trainable
    and the (tied) input embedding and LM head frozen (``freeze_all_but(train_head=False)``).
    """
    from transformers import LlamaForCausalLM

    from tutorials.rc_models import freeze_all_but

    config._attn_implementation = attn
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.train()
    freeze_all_but(model, trainable_layers=config.num_hidden_layers, train_head=False)
    return model


def random_tokens(
    *, batch_size: int, seq_len: int, vocab_size: int, seed: int, device: torch.device | str
) -> torch.Tensor:
    """``(B, T)`` token ids drawn uniformly from ``[1, vocab_size)`` (0 is the pad id); on
    ``meta`` only the shape is made."""
    if torch.device(device).type == "meta":
        return torch.empty(batch_size, seq_len, dtype=torch.long, device="meta")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (batch_size, seq_len), generator=gen)
    return ids.to(device)
