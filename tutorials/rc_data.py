"""The tutorials' real text data: loading, deterministic splits and fixed-length tokenisation.

The corpora are vendored in ``tutorials/data/`` as gzip-compressed JSONL (one JSON object
per line, keys sorted); ``tutorials/data/README.md`` gives their sources, licences and the
command that regenerates them. Nothing here uses the network.

Schema
------
``brown.jsonl.gz`` -- the Brown corpus, 500 documents of ~2,000 words, in id order:

========== ===== =============================================================
key        type  meaning
========== ===== =============================================================
id         str   Brown file id, ``"ca01"`` ... ``"cr09"``
category   str   one of the 15 genres in :data:`BROWN_CATEGORIES`
label      int   1 = imaginative prose (:data:`IMAGINATIVE`), 0 = informative
text       str   detokenised text; paragraphs separated by ``"\\n\\n"``
========== ===== =============================================================

Counts: 500 documents, 126 with label 1 and 374 with label 0.

``sotu.jsonl.gz`` -- 233 US State of the Union addresses, 1790-2021, in id order:

========== ===== =============================================================
id         str   ``"<year>_<name>_<party initial>"``, e.g. ``"1790_george_washington_n"``
                 (unique; 1953 and 1961 each have two speeches)
year       int   year of the address
name       str   president, e.g. ``"George Washington"``
party      str   e.g. ``"Republican"``, ``"Democratic"``, ``"none"``
text       str   the speech, as published by the source package
========== ===== =============================================================

``spam.jsonl.gz`` -- SpamAssassin public corpus, 6,046 messages (4,150 ham, 1,896 spam):

========== ===== =============================================================
id         str   ``"<group>/<number>.<md5>"``
group      str   ``easy-ham-1``, ``easy-ham-2``, ``hard-ham-1``, ``spam-1``, ``spam-2``
label      int   1 = spam, 0 = ham
subject    str   unfolded ``Subject:`` header (``""`` if absent)
text       str   the body (headers removed; MIME parts left encoded as sent)
========== ===== =============================================================

Splits (:func:`split_records`) are stratified and deterministic: within each stratum the
records are sorted by ``id``, shuffled by ``random.Random(seed)`` and the first
``round(test_fraction * n_stratum)`` go to the test set. The default Brown split
(``seed=0, test_fraction=0.2``, stratified by ``category``) has 400 train documents
(100 imaginative) and 100 test documents (26 imaginative).

Tokenised datasets (:class:`TokenizedDataset`) return **tuples** of tensors
``(input_ids, attention_mask, label)``: ``input_ids`` and ``attention_mask`` are int64
``(max_length,)`` (truncated to the first ``max_length`` tokens, right-padded with the
tokenizer's pad id, mask 0 on padding), ``label`` an int64 scalar. Batches from
``DataLoader``/``DPDataLoader`` are therefore lists ``[ (B, T), (B, T), (B,) ]``;
:func:`model_inputs` turns one into the keyword arguments of a HF model.

Empty batches (Opacus 1.6, checked): ``DPDataLoader`` wraps the collate function in
``CollateFnWithEmpty``. An empty Poisson batch is built with the structure of the first
non-empty batch and batch dimension 0, i.e. ``[(0, T), (0, T), (0,)]`` int64 tensors; if
the *first* batch is empty it uses ``[(0, *shape) for x in dataset[0]]``, which only
works because items are tuples (dict items would yield string keys there and fail,
and ``CollateFnWithEmpty`` cannot rebuild a NamedTuple). HF Llama models **cannot**
forward a batch of 0 (``RuntimeError: cannot reshape tensor of 0 elements``), so a
training loop must test :func:`is_empty_batch` and take a noise-only step itself.
``rand_on_empty=True`` instead returns one *random* 0/1 sample, which runs but feeds a
fake example into the clipped sum.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import functools  # noqa: E402
import gzip  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Literal, TypedDict  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

__all__ = [
    "BROWN_CATEGORIES",
    "IMAGINATIVE",
    "LABEL_NAMES",
    "JSONL_SHA256",
    "BrownRecord",
    "SotuRecord",
    "SpamRecord",
    "data_dir",
    "read_jsonl",
    "verify_data",
    "load_brown",
    "load_sotu",
    "load_spam",
    "long_sotu_records",
    "split_records",
    "TokenizedDataset",
    "brown_datasets",
    "model_inputs",
    "is_empty_batch",
    "majority_baseline",
]

#: The 15 Brown genres, sorted; the index is the 15-way class id.
BROWN_CATEGORIES: tuple[str, ...] = (
    "adventure",
    "belles_lettres",
    "editorial",
    "fiction",
    "government",
    "hobbies",
    "humor",
    "learned",
    "lore",
    "mystery",
    "news",
    "religion",
    "reviews",
    "romance",
    "science_fiction",
)
#: Genres of Brown's "imaginative prose" half (sections K-R), label 1.
IMAGINATIVE: frozenset[str] = frozenset(
    {"fiction", "mystery", "science_fiction", "adventure", "romance", "humor"}
)
#: Names of the Brown 2-way labels, by label value.
LABEL_NAMES: tuple[str, str] = ("informative", "imaginative")

#: sha256 of the *decompressed* JSONL (independent of the zlib that compressed it).
JSONL_SHA256: dict[str, str] = {
    "brown": "50b76223ff0035a1ffdb5fd8a49e4390599cddd22316b2f9b27537f8aeb47fa6",
    "sotu": "5dd4256b3004ed562e0c06bd4aa519d901926b2eef847fc1a6d7b96f5d151dfa",
    "spam": "d4d0b697982ccdd7c677f14655e7ba816ea3a63026c660f94e105791cbc50ae1",
}

Dataset_ = Literal["brown", "sotu", "spam"]


class BrownRecord(TypedDict):
    id: str
    category: str
    label: int
    text: str


class SotuRecord(TypedDict):
    id: str
    year: int
    name: str
    party: str
    text: str


class SpamRecord(TypedDict):
    id: str
    group: str
    label: int
    subject: str
    text: str


# --------------------------------------------------------------------------- files


def data_dir() -> Path:
    """``$OPACUS_RC_DATA_DIR`` if set, else the ``data/`` folder next to this file."""
    env = os.environ.get("OPACUS_RC_DATA_DIR")
    return Path(env).expanduser() if env else Path(__file__).resolve().parent / "data"


@functools.lru_cache(maxsize=8)
def _read_bytes(path: str) -> bytes:
    with gzip.open(path, "rb") as f:
        return f.read()


def _path(name: str) -> Path:
    path = data_dir() / f"{name}.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; regenerate it with `python tutorials/data/regenerate.py`"
        )
    return path


def read_jsonl(name: Dataset_) -> list[dict[str, Any]]:
    """All records of ``<data_dir>/<name>.jsonl.gz``, in file order (fresh dicts)."""
    payload = _read_bytes(str(_path(name)))
    return [json.loads(line) for line in payload.decode("utf-8").splitlines()]


def verify_data(names: Sequence[Dataset_] = ("brown", "sotu", "spam")) -> dict[str, str]:
    """Check each file's decompressed sha256 against :data:`JSONL_SHA256`; return them."""
    out = {}
    for name in names:
        digest = hashlib.sha256(_read_bytes(str(_path(name)))).hexdigest()
        if digest != JSONL_SHA256[name]:
            raise ValueError(f"{name}.jsonl.gz: sha256 {digest}, expected {JSONL_SHA256[name]}")
        out[name] = digest
    return out


# --------------------------------------------------------------------------- splits


def split_records(
    records: Sequence[dict[str, Any]],
    *,
    seed: int = 0,
    test_fraction: float = 0.2,
    stratify_by: str | None = "label",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Deterministic stratified train/test split (see the module docstring).

    Both parts come back sorted by ``id``. ``stratify_by=None`` uses one stratum.
    """
    if not 0.0 <= test_fraction <= 1.0:
        raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
    strata: dict[Any, list[dict[str, Any]]] = {}
    for r in records:
        strata.setdefault(r[stratify_by] if stratify_by else None, []).append(r)
    rng = random.Random(seed)
    train, test = [], []
    for key in sorted(strata, key=repr):
        group = sorted(strata[key], key=lambda r: r["id"])
        rng.shuffle(group)
        n_test = round(test_fraction * len(group))
        test.extend(group[:n_test])
        train.extend(group[n_test:])
    return sorted(train, key=lambda r: r["id"]), sorted(test, key=lambda r: r["id"])


def _select(records, split, seed, test_fraction, stratify_by):
    if split is None:
        return records
    train, test = split_records(
        records, seed=seed, test_fraction=test_fraction, stratify_by=stratify_by
    )
    if split == "train":
        return train
    if split == "test":
        return test
    raise ValueError(f"split must be None, 'train' or 'test', got {split!r}")


# --------------------------------------------------------------------------- corpora


def load_brown(
    *,
    split: Literal["train", "test"] | None = None,
    seed: int = 0,
    test_fraction: float = 0.2,
    stratify_by: str = "category",
) -> list[BrownRecord]:
    """Brown corpus records (all 500, or one part of the stratified split)."""
    return _select(read_jsonl("brown"), split, seed, test_fraction, stratify_by)


def load_sotu() -> list[SotuRecord]:
    """All 233 State of the Union records, in id (= chronological) order."""
    return read_jsonl("sotu")


def long_sotu_records(
    tokenizer: Callable[..., Any],
    *,
    min_tokens: int,
    split: Literal["train", "test"] | None = None,
    seed: int = 0,
    test_fraction: float = 0.2,
) -> list[SotuRecord]:
    """State of the Union records of at least ``min_tokens`` tokens (counted with ``tokenizer``,
    without special tokens), all or one part of a deterministic unstratified split.

    The split is :func:`split_records` (``stratify_by=None``) applied to the long records only,
    so the parts are the same for every tokenizer that keeps the same records. With the SmolLM2
    tokenizer and ``min_tokens=4096``, 188 of the 233 speeches qualify (150 train, 38 test at
    the default split); their lengths run from 4,221 to 40,504 tokens.
    """
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    records = load_sotu()
    lengths = _sotu_token_lengths(tokenizer)
    long = [r for r, n in zip(records, lengths) if n >= min_tokens]
    return _select(long, split, seed, test_fraction, None)


@functools.lru_cache(maxsize=2)
def _sotu_token_lengths(tokenizer: Callable[..., Any]) -> tuple[int, ...]:
    """Token count of every speech, in file order (tokenising all 2.1 M tokens takes seconds)."""
    texts = [r["text"] for r in load_sotu()]
    return tuple(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])


def load_spam(
    *,
    split: Literal["train", "test"] | None = None,
    seed: int = 0,
    test_fraction: float = 0.2,
    stratify_by: str = "group",
) -> list[SpamRecord]:
    """SpamAssassin records (all 6,046, or one part of the split stratified by group)."""
    return _select(read_jsonl("spam"), split, seed, test_fraction, stratify_by)


def majority_baseline(labels: Sequence[int]) -> float:
    """Accuracy of always predicting the most frequent label of ``labels``."""
    if not labels:
        raise ValueError("no labels")
    counts: dict[int, int] = {}
    for y in labels:
        counts[int(y)] = counts.get(int(y), 0) + 1
    return max(counts.values()) / len(labels)


# --------------------------------------------------------------------------- tensors


class TokenizedDataset(Dataset):
    """Texts tokenised once, up front, to a fixed length.

    Items are tuples ``(input_ids, attention_mask, label)`` of int64 tensors with shapes
    ``(max_length,)``, ``(max_length,)`` and ``()``; ``(input_ids, attention_mask)`` if
    ``labels`` is None (language modelling). Texts longer than ``max_length`` tokens
    keep their first ``max_length`` tokens; shorter ones are right-padded with
    ``tokenizer.pad_token_id`` and masked. Special tokens are added as the tokenizer
    does by default (none for SmolLM2; ``[CLS] ... [SEP]`` for BERT).

    Attributes:
        input_ids, attention_mask: ``(N, max_length)`` int64.
        labels: ``(N,)`` int64, or None.
        lengths: ``(N,)`` int64, real (unpadded, truncated) lengths.
    """

    def __init__(
        self,
        texts: Sequence[str],
        labels: Sequence[int] | None,
        tokenizer: Callable[..., Any],
        *,
        max_length: int,
        batch_size: int = 64,
    ) -> None:
        if labels is not None and len(labels) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(labels)} labels")
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token first")
        ids, masks = [], []
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(
                list(texts[i : i + batch_size]),
                max_length=max_length,
                truncation=True,
                padding="max_length",
                return_tensors="pt",
            )
            ids.append(enc["input_ids"].to(torch.int64))
            masks.append(enc["attention_mask"].to(torch.int64))
        empty = torch.zeros(0, max_length, dtype=torch.int64)
        self.input_ids = torch.cat(ids) if ids else empty
        self.attention_mask = torch.cat(masks) if masks else empty.clone()
        self.labels = None if labels is None else torch.as_tensor(list(labels), dtype=torch.int64)
        self.lengths = self.attention_mask.sum(dim=1)
        self.max_length = max_length

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        if self.labels is None:
            return self.input_ids[i], self.attention_mask[i]
        return self.input_ids[i], self.attention_mask[i], self.labels[i]


def brown_datasets(
    tokenizer: Callable[..., Any],
    *,
    max_length: int = 2048,
    target: Literal["label", "category"] = "label",
    seed: int = 0,
    test_fraction: float = 0.2,
) -> tuple[TokenizedDataset, TokenizedDataset]:
    """Tokenised Brown ``(train, test)`` datasets.

    ``target="label"``: the 2-way imaginative/informative label; ``"category"``: the
    15-way genre index into :data:`BROWN_CATEGORIES`.
    """
    out = []
    for split in ("train", "test"):
        recs = load_brown(split=split, seed=seed, test_fraction=test_fraction)
        if target == "label":
            ys = [r["label"] for r in recs]
        elif target == "category":
            ys = [BROWN_CATEGORIES.index(r["category"]) for r in recs]
        else:
            raise ValueError(f"target must be 'label' or 'category', got {target!r}")
        out.append(
            TokenizedDataset([r["text"] for r in recs], ys, tokenizer, max_length=max_length)
        )
    return out[0], out[1]


def is_empty_batch(batch: Sequence[torch.Tensor]) -> bool:
    """True for the zero-size batches ``DPDataLoader`` yields under Poisson sampling."""
    return len(batch) == 0 or batch[0].shape[0] == 0


def model_inputs(batch: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``[input_ids, attention_mask(, labels)]`` -> keyword arguments of a HF model."""
    keys = ("input_ids", "attention_mask", "labels")
    return dict(zip(keys, batch))
