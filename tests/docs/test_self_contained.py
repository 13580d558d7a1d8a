"""The repository explains itself: no tracked file points to a document outside the repository,
and every code-to-docs or docs-to-code anchor resolves.

Three kinds of reference are checked, over ``git ls-files`` (the files a clone has):

* **External documents** (:func:`test_no_reference_to_a_file_outside_the_repository`): the names
  of the project's out-of-tree design notes (built below from their stems, so this file does not
  match itself), the ``shared`` folder beside the clone that held them, and absolute paths of
  the machine the work was done on. A reader of a clone can open none of them.
* **Docs anchors** (:func:`test_every_docs_anchor_resolves`): each ``docs/<page>.md#<label>`` in
  any tracked file names an existing page that defines the MyST target ``(<label>)=`` (the site
  sets ``myst_heading_anchors = 0``, so the explicit targets are the only anchors).
* **Code locations named in the docs** (:func:`test_every_code_location_in_the_docs_resolves`):
  in ``docs/**/*.md``, ``README.md`` and ``CONTRIBUTING.md``, each ``path.py:NN`` names an
  existing file with at least NN lines, and each ``path.py::Name`` or ``path.py::Class.method``
  names a function or class defined in that file (read with :mod:`ast`, never imported).
"""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: The stems of the design notes that live outside the repository; ``<STEM>.md`` must not appear.
_EXTERNAL_STEMS = ("DESIGN", "THEORY", "OPACUS", "STYLE", "PEERS", "DATA")
EXTERNAL = re.compile(
    r"\b(?:" + "|".join(_EXTERNAL_STEMS) + r")\.md\b"  # the notes, by name
    r"|\b(?:"
    + "|".join(_EXTERNAL_STEMS[:-1])
    + r")\s+(?:§|sections?\s|[A-G](?:\.\d)?\b)"  # by section
    r"|\b[Tt]heory\s+notes\b"  # the notes on the theory, by description
    r"|\.\./+shared\b"  # the folder next to the clone that holds them
    r"|(?<![\w.~-])/wor[k]/"  # an absolute path of the development machine
)
ANCHOR = re.compile(r"\b(docs/[\w/.-]+\.md)#([\w-]+)")
LINE_REF = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.py):(\d+)\b")
NAME_REF = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.py)::([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")
TARGET = re.compile(r"^\(([\w-]+)\)=\s*$", re.M)


@cache
def _tracked_texts() -> dict[str, str]:
    """Path -> text of every tracked file that decodes as UTF-8 (binary files are skipped)."""
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.split(b"\0")
    texts = {}
    for name in filter(None, names):
        path = ROOT / name.decode()
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        try:
            texts[name.decode()] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    return texts


def _doc_pages() -> dict[str, str]:
    """The pages whose code locations are checked: the site's sources, README, CONTRIBUTING."""
    return {
        path: text
        for path, text in _tracked_texts().items()
        if (path.startswith("docs/") and path.endswith(".md"))
        or path in {"README.md", "CONTRIBUTING.md"}
    }


def _hits(pattern: re.Pattern[str], texts: dict[str, str]) -> list[tuple[str, int, re.Match]]:
    found = []
    for path, text in sorted(texts.items()):
        for match in pattern.finditer(text):
            found.append((path, text.count("\n", 0, match.start()) + 1, match))
    return found


def test_the_scan_sees_the_repository() -> None:
    """A guard against a scan that silently reads nothing (no git, wrong root)."""
    texts = _tracked_texts()
    assert {"README.md", "CONTRIBUTING.md", "docs/architecture.md", "setup.cfg"} <= set(texts)
    assert any(path.endswith(".ipynb") for path in texts)  # notebooks are scanned too
    assert len(_hits(ANCHOR, texts)) > 50


def test_the_patterns_match_what_they_should() -> None:
    """Each pattern on a positive and a negative example, so a broken regex fails here."""
    # the examples are assembled at run time so that this file does not match its own scan
    theory, design, data = (f"{stem}.md" for stem in ("THEORY", "DESIGN", "DATA"))
    for bad in (
        f"see {theory} A.2",
        "THEO" + "RY C.7",
        "DESI" + "GN section 3",
        f"`{design}` section 3",
        f"../{'shared'}/{data}",
        "/" + "work/x",
    ):
        assert EXTERNAL.search(bad), bad
    for good in (
        "docs/privacy/estimators.md",
        "METADATA.md",
        "rework/x",
        "a/work/b",
        "OPACUS_PRV (C.6)",
    ):
        assert not EXTERNAL.search(good), good
    assert ANCHOR.search("(docs/privacy/prv.md#prv-tables)").groups() == (
        "docs/privacy/prv.md",
        "prv-tables",
    )
    assert LINE_REF.search("at opacus_rc/accountants/rc.py:55,").groups() == (
        "opacus_rc/accountants/rc.py",
        "55",
    )
    assert NAME_REF.search("`opacus_rc/a/b.py::Cls.meth`").groups() == (
        "opacus_rc/a/b.py",
        "Cls.meth",
    )


def test_no_reference_to_a_file_outside_the_repository() -> None:
    hits = _hits(EXTERNAL, _tracked_texts())
    assert not hits, (
        f"{len(hits)} references to files outside the repository (say what the reader needs in "
        "docs/ and point there, or cite the paper):\n"
        + "\n".join(f"{path}:{line}: {m.group(0)!r}" for path, line, m in hits)
    )


def test_every_docs_anchor_resolves() -> None:
    texts = _tracked_texts()
    broken = []
    for path, line, match in _hits(ANCHOR, texts):
        page, label = match.groups()
        if page not in texts:
            broken.append(f"{path}:{line}: {page} (no such page)")
        elif label not in TARGET.findall(texts[page]):
            broken.append(f"{path}:{line}: {page}#{label} (no target '({label})=' on that page)")
    assert not broken, "broken docs anchors:\n" + "\n".join(broken)


@cache
def _defined_names(path: str) -> frozenset[str]:
    """``name`` and ``Class.name`` for every function and class defined in a Python file."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(f"{node.name}.{item.name}")
    return frozenset(names)


def test_every_code_location_in_the_docs_resolves() -> None:
    texts = _tracked_texts()
    pages = _doc_pages()
    broken = []
    for path, line, match in _hits(LINE_REF, pages):
        target, number = match.group(1), int(match.group(2))
        if target not in texts:
            broken.append(f"{path}:{line}: {target} (no such tracked file)")
        elif not 1 <= number <= texts[target].count("\n") + 1:
            broken.append(f"{path}:{line}: {target}:{number} (the file is shorter)")
    for path, line, match in _hits(NAME_REF, pages):
        target, name = match.groups()
        if target not in texts:
            broken.append(f"{path}:{line}: {target} (no such tracked file)")
        elif name not in _defined_names(target):
            broken.append(f"{path}:{line}: {target}::{name} (not defined in that file)")
    assert not broken, "stale code locations in the docs:\n" + "\n".join(broken)


def test_the_architecture_page_names_code_by_function() -> None:
    """The architecture page is the map a new contributor starts from: it names code by function
    (which the previous test resolves), not by line numbers, which go stale with every edit."""
    text = _tracked_texts()["docs/architecture.md"]
    assert len(NAME_REF.findall(text)) >= 20
    assert not LINE_REF.findall(text)
