"""The vendored corpora (tutorials/data/*.jsonl.gz) and their loader, tutorials/rc_data.py."""

from __future__ import annotations

import collections
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"
sys.path.insert(0, str(TUTORIALS))

import rc_data  # noqa: E402

BROWN_COUNTS = {
    "learned": 80,
    "belles_lettres": 75,
    "lore": 48,
    "news": 44,
    "hobbies": 36,
    "government": 30,
    "adventure": 29,
    "fiction": 29,
    "romance": 29,
    "editorial": 27,
    "mystery": 24,
    "religion": 17,
    "reviews": 17,
    "humor": 9,
    "science_fiction": 6,
}


def _regenerate_module():
    spec = importlib.util.spec_from_file_location(
        "rc_regenerate", TUTORIALS / "data" / "regenerate.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_files_match_pinned_sha256() -> None:
    assert rc_data.verify_data() == rc_data.JSONL_SHA256


def test_brown_schema_and_counts() -> None:
    recs = rc_data.load_brown()
    assert len(recs) == 500
    for r in recs:
        assert set(r) == {"id", "category", "label", "text"}
        assert isinstance(r["text"], str) and len(r["text"].split()) > 1500
        assert r["label"] == int(r["category"] in rc_data.IMAGINATIVE)
    ids = [r["id"] for r in recs]
    assert ids == sorted(ids) and len(set(ids)) == 500 and ids[0] == "ca01" and ids[-1] == "cr09"
    assert collections.Counter(r["category"] for r in recs) == BROWN_COUNTS
    assert tuple(sorted(BROWN_COUNTS)) == rc_data.BROWN_CATEGORIES
    labels = collections.Counter(r["label"] for r in recs)
    assert labels == {1: 126, 0: 374}


def test_brown_text_is_detokenised() -> None:
    recs = rc_data.load_brown()
    assert recs[0]["text"].startswith(
        "The Fulton County Grand Jury said Friday an investigation of Atlanta's recent primary "
        'election produced "no evidence" that any irregularities took place.\n\nThe jury'
    )
    text = "\n".join(r["text"] for r in recs)
    for artefact in (" ,", " .", " ;", " ?", " !", " )", "( ", "``", "/nn", "/at "):
        assert artefact not in text, artefact
    assert not re.search(r"(?<!\d)''", text)  # quote marks are '"'; 4' 10'' (inches) stays
    # No part-of-speech tags left (the most frequent ones, with or without a -tl/-hl suffix).
    assert not re.search(r"\w/(at|nn|nns|np|in|jj|vb|vbd|vbn|vbz|cc|pps|rb|dt|cd)(-\w+)?\b", text)


def test_brown_detokenize_rules() -> None:
    detok = _regenerate_module().brown_detokenize
    tagged = (
        "\n\n\t``/`` Hi/uh ,/, ''/'' he/pps said/vbd (/( to/in Mr./np Jr./np ./. )/) ./.\n"
        "It's/pps+bez 1/2/cd ;/. ok/uh ?/.\n\n\n\tShe/pps said/vbd '/' no/rb '/' ./.\n"
    )
    assert detok(tagged) == ('"Hi," he said (to Mr. Jr.). It\'s 1/2; ok?\n\n' + "She said 'no'.")


def test_sotu_schema_and_counts() -> None:
    recs = rc_data.load_sotu()
    assert len(recs) == 233
    for r in recs:
        assert set(r) == {"id", "year", "name", "party", "text"}
        assert isinstance(r["year"], int) and r["id"].startswith(f"{r['year']}_")
        assert len(r["text"]) > 1000
    assert len({r["id"] for r in recs}) == 233
    assert (recs[0]["year"], recs[0]["name"]) == (1790, "George Washington")
    assert recs[-1]["year"] == 2021
    parties = collections.Counter(r["party"] for r in recs)
    assert parties["Republican"] == 92 and parties["Democratic"] == 90


def test_spam_schema_and_counts() -> None:
    recs = rc_data.load_spam()
    assert len(recs) == 6046
    assert set(recs[0]) == {"id", "group", "label", "subject", "text"}
    assert collections.Counter(r["label"] for r in recs) == {0: 4150, 1: 1896}
    assert all(r["label"] == int(r["group"].startswith("spam")) for r in recs)
    train, test = rc_data.load_spam(split="train"), rc_data.load_spam(split="test")
    assert len(train) + len(test) == 6046 and len(test) == 1209


def test_brown_split_is_deterministic_stratified_and_disjoint() -> None:
    train = rc_data.load_brown(split="train")
    test = rc_data.load_brown(split="test")
    assert [r["id"] for r in train] == [r["id"] for r in rc_data.load_brown(split="train")]
    assert (len(train), len(test)) == (400, 100)
    ids_train, ids_test = {r["id"] for r in train}, {r["id"] for r in test}
    assert not ids_train & ids_test and len(ids_train | ids_test) == 500
    assert sum(r["label"] for r in test) == 26 and sum(r["label"] for r in train) == 100
    per_cat = collections.Counter(r["category"] for r in test)
    assert all(per_cat[c] == round(0.2 * n) for c, n in BROWN_COUNTS.items())
    other = rc_data.load_brown(split="test", seed=1)
    assert {r["id"] for r in other} != ids_test and len(other) == 100
    by_label = rc_data.load_brown(split="test", stratify_by="label")
    assert sum(r["label"] for r in by_label) == 25 and len(by_label) == 100
    assert rc_data.majority_baseline([r["label"] for r in test]) == pytest.approx(0.74)
    with pytest.raises(ValueError):
        rc_data.load_brown(split="validation")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    import rc_models

    return rc_models.load_smollm2_tokenizer()


def test_tokenized_lengths(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    recs = rc_data.load_brown()[:6]
    texts, labels = [r["text"] for r in recs], [r["label"] for r in recs]
    full = [len(ids) for ids in tok(texts)["input_ids"]]
    assert all(2048 < n < 4096 for n in full)  # every Brown document is 2.2k-3.9k tokens

    ds = rc_data.TokenizedDataset(texts, labels, tok, max_length=2048)
    assert len(ds) == 6 and ds.input_ids.shape == (6, 2048)
    ids, mask, y = ds[0]
    assert ids.dtype == mask.dtype == y.dtype == torch.int64 and y.shape == ()
    assert bool(mask.all()) and ds.lengths.tolist() == [2048] * 6
    assert ids.tolist() == tok(texts[0])["input_ids"][:2048]  # truncation keeps the head

    long = rc_data.TokenizedDataset(texts[:2], None, tok, max_length=4096)
    assert len(long[0]) == 2 and long.lengths.tolist() == full[:2]
    n = full[0]
    assert long.input_ids[0, n:].eq(tok.pad_token_id).all() and not long.attention_mask[0, n:].any()


def test_brown_datasets_targets(smollm2_tokenizer, monkeypatch) -> None:
    # Tokenise 10 docs instead of 500: shrink the split through the record loader.
    few = rc_data.load_brown()[::50]
    monkeypatch.setattr(rc_data, "read_jsonl", lambda name: [dict(r) for r in few])
    train, test = rc_data.brown_datasets(smollm2_tokenizer, max_length=64, target="category")
    assert len(train) + len(test) == 10 and train.input_ids.shape[1] == 64
    cats = sorted(train.labels.tolist() + test.labels.tolist())
    assert cats == sorted(rc_data.BROWN_CATEGORIES.index(r["category"]) for r in few)


def test_dp_data_loader_batches_and_empty_batches(smollm2_tokenizer) -> None:
    from opacus.data_loader import DPDataLoader

    recs = rc_data.load_brown()[:4]
    ds = rc_data.TokenizedDataset(
        [r["text"] for r in recs], [r["label"] for r in recs], smollm2_tokenizer, max_length=32
    )
    seen_empty = seen_full = first_empty = 0
    # Seed 2 starts with an empty batch (Opacus then builds it from dataset[0]'s shapes);
    # the others meet empty batches after a non-empty one (built from that batch).
    for seed in range(4):
        dl = DPDataLoader(ds, sample_rate=0.3, generator=torch.Generator().manual_seed(seed))
        for i, batch in enumerate(dl):
            ids, mask, y = batch
            b = ids.shape[0]
            assert ids.shape == mask.shape == (b, 32) and y.shape == (b,)
            assert ids.dtype == mask.dtype == y.dtype == torch.int64
            assert rc_data.is_empty_batch(batch) == (b == 0)
            seen_empty += b == 0
            seen_full += b > 0
            first_empty += i == 0 and b == 0
            assert set(rc_data.model_inputs(batch)) == {"input_ids", "attention_mask", "labels"}
    assert seen_empty and seen_full and first_empty
