"""The generative tutorial (tutorials/generative_long_documents.py) and the helpers it added.

* ``rc_models.FrozenLMHeadLoss`` against ``nn.CrossEntropyLoss`` on explicit logits, in float64
  (values and gradients, every reduction, ignored targets, chunk boundaries);
* ``rc_data.long_sotu_records``: the long-speech filter and its split;
* ``rc_models.disk_cached``: computes once, reloads, writes nothing when disabled;
* the tutorial itself in its smoke setting (``OPACUS_RC_SMOKE=1``: the real packaged SmolLM2 and
  the vendored speeches at 128 tokens, all three methods), in a subprocess, with the results
  it writes checked field by field; the notebook is the executed pairing of the script and its
  figure cell holds the image.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"
SCRIPT = TUTORIALS / "generative_long_documents.py"
NOTEBOOK = SCRIPT.with_suffix(".ipynb")
sys.path.insert(0, str(TUTORIALS))

import rc_data  # noqa: E402
import rc_models  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smoke import run_smoke  # noqa: E402

# --------------------------------------------------------------------------- FrozenLMHeadLoss


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_frozen_lm_head_loss_equals_cross_entropy_on_logits(reduction: str) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, d, n = 301, 16, 37  # 37 tokens in chunks of 8: the last chunk is partial
    weight = torch.randn(vocab, d, generator=gen, dtype=torch.float64)
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[[3, 8, 36]] = -100  # ignored, one of them the first token of a chunk
    targets[5] = vocab - 1
    loss = rc_models.FrozenLMHeadLoss(weight, chunk_tokens=8, reduction=reduction)
    got = loss(hidden, targets)
    expected = nn.CrossEntropyLoss(reduction=reduction)(hidden @ weight.T, targets)
    # float64 throughout: the two differ only by summation order, ~1e-15 relative.
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    upstream = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    (g_got,) = torch.autograd.grad(got, hidden, upstream)
    (g_expected,) = torch.autograd.grad(expected, hidden, upstream)
    torch.testing.assert_close(g_got, g_expected, rtol=1e-12, atol=1e-12)
    assert g_got[[3, 8, 36]].abs().max() == 0  # ignored tokens get no gradient


def test_frozen_lm_head_loss_without_grad_and_refusals() -> None:
    weight = torch.randn(50, 4)
    hidden, targets = torch.randn(9, 4), torch.randint(0, 50, (9,))
    with torch.no_grad():
        got = rc_models.FrozenLMHeadLoss(weight, chunk_tokens=4)(hidden, targets)
    torch.testing.assert_close(got, nn.functional.cross_entropy(hidden @ weight.T, targets))
    with pytest.raises(ValueError, match="freeze it"):
        rc_models.FrozenLMHeadLoss(nn.Parameter(weight))
    with pytest.raises(ValueError, match="flatten"):
        rc_models.FrozenLMHeadLoss(weight)(hidden.view(3, 3, 4), targets.view(3, 3))
    with pytest.raises(ValueError, match="reduction"):
        rc_models.FrozenLMHeadLoss(weight, reduction="batchmean")(hidden, targets)


def test_frozen_lm_head_loss_per_sequence_under_the_dp_criterion() -> None:
    """Opacus' DP loss wrapper (used by ghost and randomized clipping) turns the per-token
    losses into one mean loss per sequence when given ``shape=(B, T)``."""
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    class Stub:
        loss_reduction = "mean"

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 8, generator=gen)
    hidden = torch.randn(3, 5, 8, generator=gen)
    targets = torch.randint(0, 40, (3, 5), generator=gen)
    targets[1, 2] = -100
    wrapped = DPLossFastGradientClipping(
        Stub(), Stub(), rc_models.FrozenLMHeadLoss(weight), loss_reduction="mean"
    )
    out = wrapped(hidden.flatten(0, 1), targets.flatten(), shape=(3, 5))
    expected = torch.stack(
        [nn.functional.cross_entropy(hidden[i] @ weight.T, targets[i]) for i in range(3)]
    )
    torch.testing.assert_close(out.loss_per_sample, expected)


# --------------------------------------------------------------------------- data and cache


def test_long_sotu_records_filter_and_split() -> None:
    tokenizer = rc_models.load_smollm2_tokenizer()
    everything = rc_data.long_sotu_records(tokenizer, min_tokens=4096)
    train = rc_data.long_sotu_records(tokenizer, min_tokens=4096, split="train")
    test = rc_data.long_sotu_records(tokenizer, min_tokens=4096, split="test")
    assert (len(everything), len(train), len(test)) == (188, 150, 38)
    assert {r["id"] for r in train} | {r["id"] for r in test} == {r["id"] for r in everything}
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    assert rc_data.long_sotu_records(tokenizer, min_tokens=4096, split="test") == test
    # The boundary, tokenised independently: the 3 shortest kept speeches (in characters) have
    # at least 4,096 tokens, the 3 longest dropped ones fewer.
    kept = {r["id"] for r in everything}
    by_chars = sorted(rc_data.load_sotu(), key=lambda r: len(r["text"]))
    shortest_kept = [r for r in by_chars if r["id"] in kept][:3]
    longest_dropped = [r for r in by_chars if r["id"] not in kept][-3:]
    count = lambda r: len(tokenizer(r["text"])["input_ids"])  # noqa: E731
    assert all(count(r) >= 4096 for r in shortest_kept)
    assert all(count(r) < 4096 for r in longest_dropped)
    assert len(rc_data.long_sotu_records(tokenizer, min_tokens=1)) == 233
    with pytest.raises(ValueError, match="min_tokens"):
        rc_data.long_sotu_records(tokenizer, min_tokens=0)


def test_disk_cached(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OPACUS_RC_SMOLLM2_DIR", str(tmp_path / "model"))
    calls = []

    def compute() -> torch.Tensor:
        calls.append(1)
        return torch.arange(4.0)

    a = rc_models.disk_cached("t", b"key", compute)
    b = rc_models.disk_cached("t", b"key", compute)
    torch.testing.assert_close(a, b)
    assert len(calls) == 1 and len(list((tmp_path / "tutorial_features").iterdir())) == 1
    rc_models.disk_cached("t", b"other key", compute, enabled=False)
    assert len(calls) == 2 and len(list((tmp_path / "tutorial_features").iterdir())) == 1


# --------------------------------------------------------------------------- the tutorial


@pytest.mark.slow
def test_smoke_run(tmp_path: Path) -> None:
    proc = run_smoke(SCRIPT, outputs=tmp_path)
    assert "cached prefix + top" in proc.stdout  # the split's exactness check ran (it asserts)
    runs = {m: json.loads((tmp_path / f"generative_{m}.json").read_text()) for m in
            ("randomized", "ghost", "none")}  # fmt: skip
    before = runs["none"]["perplexity_before"]
    for method, r in runs.items():
        assert r["method"] == method and r["smoke"] is True
        # A pretrained model on real English: far below the vocabulary size (49,152).
        assert 1.0 < r["perplexity_before"] == before < 200.0
        assert math.isfinite(r["perplexity_after"]) and r["perplexity_after"] > 1.0
        assert len(r["per_document_after"]) == r["settings"]["test_docs"] == 2
        assert r["steps"] == len(r["batch_sizes"]) == len(r["train_losses"]) > 0
        assert r["wall_time_s"] > 0 and r["peak_rss_gib"] >= r["rss_at_start_gib"] > 0
    # All three runs see the same Poisson batches.
    assert runs["randomized"]["batch_sizes"] == runs["ghost"]["batch_sizes"]
    assert runs["randomized"]["batch_sizes"] == runs["none"]["batch_sizes"]
    for method in ("randomized", "ghost"):
        r = runs[method]
        assert 0 < r["epsilon"] <= 8.0 and r["delta"] == 1e-5 and r["noise_multiplier"] > 0
    # The sketch costs noise: more than exact clipping for the same epsilon.
    assert runs["randomized"]["noise_multiplier"] > runs["ghost"]["noise_multiplier"]
    assert runs["none"]["epsilon"] is None and runs["none"]["noise_multiplier"] == 0.0
    assert (tmp_path / "generative_perplexity.png").stat().st_size > 10_000
    assert "| randomized clipping (k=32) |" in (tmp_path / "generative_results.md").read_text()


def test_notebook_is_paired_executed_and_shows_its_figure() -> None:
    jupytext = pytest.importorskip("jupytext")
    script = jupytext.read(SCRIPT)
    notebook = jupytext.read(NOTEBOOK)

    def cells(nb, kind):
        return [c.source.strip() for c in nb.cells if c.cell_type == kind]

    assert cells(notebook, "code") == cells(script, "code"), (
        "generative_long_documents.ipynb is out of date: re-execute it (tutorials/README.md)"
    )
    assert cells(notebook, "markdown") == cells(script, "markdown")
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "unexecuted cells"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, "the notebook was saved with an error output"
    figure = [c for c in code if "savefig" in c.source]
    assert len(figure) == 1
    assert any("image/png" in o.get("data", {}) for o in figure[0].outputs), "figure not embedded"
    # The executed notebook is the full run, not the smoke setting.
    assert not any(
        "'max_length': 128" in o.get("text", "") for c in code for o in c.get("outputs", [])
    )
