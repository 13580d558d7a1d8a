"""Tiny random Hugging Face models for the tests, built from configs (no files, no downloads).

One builder per architecture, with the sizes every test shares (hidden size 16, two heads, one
key/value head, 32 positions, no KV cache, dropout off), so that a test states only what it
varies (vocabulary, layers, tying, padding id). Each builder seeds ``torch`` with ``seed`` and
then builds the model, so the same arguments give the same weights in every test. Extra
keyword arguments go to the model's config unchanged.

It imports ``transformers``: a test module skips first (``pytest.importorskip``), then loads it by
path (pytest runs in importlib mode), as the tests load their other helpers::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tiny_hf_models as hf  # noqa: E402
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

__all__ = ["bert_classifier", "gpt2", "llama", "qwen2"]


def llama(
    *,
    vocab: int,
    tie: bool,
    layers: int = 1,
    intermediate_size: int = 24,
    seed: int = 0,
    **config: Any,
) -> nn.Module:
    """A ``LlamaForCausalLM`` with ``d = 16``, two query heads and one key/value head."""
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        use_cache=False,
        tie_word_embeddings=tie,
        **config,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def qwen2(*, vocab: int, seed: int = 0, **config: Any) -> nn.Module:
    """A one-block ``Qwen2ForCausalLM`` with the sizes of :func:`llama`, untied."""
    cfg = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        use_cache=False,
        tie_word_embeddings=False,
        **config,
    )
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(cfg)


def gpt2(*, vocab: int, tie: bool, seed: int = 0, **config: Any) -> nn.Module:
    """A one-block ``GPT2LMHeadModel`` with ``d = 16``, two heads and dropout off."""
    cfg = transformers.GPT2Config(
        vocab_size=vocab,
        n_embd=16,
        n_layer=1,
        n_head=2,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        tie_word_embeddings=tie,
        **config,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def bert_classifier(*, vocab: int, seed: int = 0, **config: Any) -> nn.Module:
    """A one-block ``BertForSequenceClassification`` (``d = 32``, two labels), dropout off."""
    cfg = transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
        **config,
    )
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(cfg)
