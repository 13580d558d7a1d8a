"""Offline loading of the tutorials' pretrained models (tutorials/rc_models.py).

The first run dequantizes SmolLM2's GGUF into the cache (~30-60 s); later runs load the cache.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tutorials"))

import rc_models  # noqa: E402

# 30 layers; per layer q,o 576x576, k,v 576x192, MLP 3 x 576x1536, two RMSNorms.
LAYER_PARAMS = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
BODY_PARAMS = 49152 * 576 + 30 * LAYER_PARAMS + 576  # embeddings, layers, final norm


@pytest.fixture(scope="module")
def tok():
    return rc_models.load_smollm2_tokenizer()


@pytest.fixture(scope="module")
def clf():
    return rc_models.load_smollm2(task="classification", num_labels=2)


@pytest.fixture(scope="module")
def lm():
    return rc_models.load_smollm2(task="causal_lm", train=False)


def test_offline_and_paths(monkeypatch, tmp_path) -> None:
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert rc_models.smollm2_gguf_path().stat().st_size == 98_362_432
    monkeypatch.setenv("OPACUS_RC_SMOLLM2_DIR", str(tmp_path / "x"))
    assert rc_models.smollm2_cache_dir() == tmp_path / "x"
    assert rc_models.smollm2_cache_dir(tmp_path / "y") == tmp_path / "y"
    monkeypatch.delenv("OPACUS_RC_SMOLLM2_DIR")
    monkeypatch.setenv("OPACUS_RC_CACHE", str(tmp_path))
    assert rc_models.smollm2_cache_dir() == tmp_path / "smollm2-135m-fp32"


def test_tokenizer(tok) -> None:
    assert len(tok) == 49152
    assert tok.pad_token == tok.eos_token == "<|im_end|>" and tok.pad_token_id == 2
    # Pinned from the GGUF's own tokenizer (transformers' gguf_file= loader); no BOS added.
    assert tok("The Fulton County Grand Jury")["input_ids"] == [
        504,
        426,
        481,
        258,
        4392,
        8503,
        530,
        1293,
    ]


def test_classification_model(clf, tok) -> None:
    cfg = clf.config
    assert type(clf).__name__ == "LlamaForSequenceClassification"
    assert clf.training and cfg.use_cache is False and cfg.pad_token_id == tok.pad_token_id
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.max_position_embeddings) == (30, 576, 8192)
    assert clf.score.weight.shape == (2, 576) and clf.score.bias is None
    assert not hasattr(clf, "lm_head") and rc_models.shared_parameters(clf) == []
    assert sum(p.numel() for p in clf.parameters()) == BODY_PARAMS + 2 * 576
    # The head comes from a private generator: same seed, same head.
    assert 0.01 < clf.score.weight.std().item() < 0.03
    assert torch.equal(rc_models.load_smollm2(seed=0).score.weight, clf.score.weight)
    assert not torch.equal(rc_models.load_smollm2(seed=1).score.weight, clf.score.weight)

    x = tok(
        ["A short story.", "A government report on tariffs."], padding=True, return_tensors="pt"
    )
    out = clf(**x, labels=torch.tensor([1, 0]))
    assert out.logits.shape == (2, 2) and torch.isfinite(out.loss)


def test_freeze_all_but(clf) -> None:
    counts = rc_models.freeze_all_but(clf, trainable_layers=2)
    assert counts["trainable"] == 2 * LAYER_PARAMS + 576 + 2 * 576 == 7_081_920
    assert counts["total"] == BODY_PARAMS + 2 * 576 == counts["trainable"] + counts["frozen"]
    names = {n for n, p in clf.named_parameters() if p.requires_grad}
    assert all(
        n.startswith(("model.layers.28.", "model.layers.29.", "model.norm.", "score."))
        for n in names
    )
    assert not clf.model.embed_tokens.weight.requires_grad
    assert rc_models.freeze_all_but(clf, trainable_layers=0)["trainable"] == 576 + 2 * 576
    with pytest.raises(ValueError):
        rc_models.freeze_all_but(clf, trainable_layers=31)


def test_causal_lm_is_pretrained(lm, tok) -> None:
    # A random model scores ~ln(49152) = 10.8 nats per token and would not name Paris.
    x = tok(
        "The capital of France is Paris, and the capital of Germany is Berlin.", return_tensors="pt"
    )
    with torch.no_grad():
        loss = lm(**x, labels=x["input_ids"]).loss.item()
        nxt = lm(**tok("The capital of France is", return_tensors="pt")).logits[0, -1]
    assert loss < 3.0, f"perplexity {math.exp(loss):.1f}"
    assert tok.decode(nxt.argmax()) == " Paris"


def test_causal_lm_tied_embeddings(lm) -> None:
    assert rc_models.shared_parameters(lm) == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert not lm.training
    with pytest.raises(ValueError, match="tied"):
        rc_models.freeze_all_but(lm, trainable_layers=1)
    counts = rc_models.freeze_all_but(lm, trainable_layers=1, train_head=False)
    assert counts["trainable"] == LAYER_PARAMS + 576 and counts["total"] == BODY_PARAMS

    untied = rc_models.load_smollm2(task="causal_lm", tie_embeddings=False)
    assert rc_models.shared_parameters(untied) == [] and untied.config.tie_word_embeddings is False
    assert torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    counts = rc_models.freeze_all_but(untied, trainable_layers=1)
    assert counts["trainable"] == LAYER_PARAMS + 576 + 49152 * 576


def test_minilm() -> None:
    tok = rc_models.load_minilm_tokenizer()
    model = rc_models.load_minilm(num_labels=2)
    assert type(model).__name__ == "BertForSequenceClassification" and model.training
    assert model.config.max_position_embeddings == 512 and model.config.hidden_dropout_prob == 0.0
    assert model.classifier.weight.shape == (2, 384)
    counts = rc_models.freeze_all_but(model, trainable_layers=2)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(
        n.startswith(
            ("bert.encoder.layer.4.", "bert.encoder.layer.5.", "bert.pooler.", "classifier.")
        )
        for n in names
    )
    assert counts["trainable"] == 2 * 1_774_464 + 384 * 384 + 384 + 2 * 384 + 2
    x = tok(["A short story."], return_tensors="pt")
    assert model(**x).logits.shape == (1, 2)
