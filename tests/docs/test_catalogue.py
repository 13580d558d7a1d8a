"""The catalogue of cases (tests/reliability/CATALOGUE.md) stays the index of the tests: every
``path::name`` and ``ALIAS::name`` in its tables names a function defined in that file (tests
move by package; a stale row fails here, not silently).

Paths are relative to ``tests/`` (or start with ``tests/``, ``opacus_rc/`` or
``benchmarks/``). An alias is defined as ``ALIAS = `path``` in the text above a table: in
the file's first block for every section, or in the table's own ``##`` section.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CATALOGUE = ROOT / "tests" / "reliability" / "CATALOGUE.md"
ALIAS_DEFINITION = re.compile(r"`?\b([A-Z][A-Z0-9]*)`? =\s+`((?:tests/)?[\w/]+\.py)`")
ALIAS_CITATION = re.compile(r"(?<![\w/.])([A-Z][A-Z0-9]*)::(\w+)")
PATH_CITATION = re.compile(r"(?<![\w/])((?:tests/|opacus_rc/|benchmarks/)?[\w/]+\.py)::(\w+)")


def _file(path: str) -> Path:
    if path.startswith(("opacus_rc/", "benchmarks/")):
        return ROOT / path
    return ROOT / "tests" / path.removeprefix("tests/")


def _aliases(text: str) -> dict[str, str]:
    return dict(ALIAS_DEFINITION.findall(" ".join(text.split())))


def _citations() -> list[tuple[str, str, str]]:
    """(section heading, file path, function name) for every citation in a table row."""
    sections = re.split(r"\n(?=## )", CATALOGUE.read_text(encoding="utf-8"))
    everywhere = _aliases(sections[0])
    found = []
    for section in sections:
        heading = section.splitlines()[0]
        aliases = {**everywhere, **_aliases(section)}
        for row in (line for line in section.splitlines() if line.startswith("|")):
            for alias, name in ALIAS_CITATION.findall(row):
                found.append((heading, aliases.get(alias, f"<undefined alias {alias}>"), name))
            found.extend((heading, path, name) for path, name in PATH_CITATION.findall(row))
    return found


def test_the_catalogue_cites_tests() -> None:
    """A guard against the patterns silently matching nothing."""
    citations = _citations()
    assert len(citations) > 300
    assert any(path == "grad_sample/test_checks.py" for _, path, _ in citations)


def test_every_catalogued_test_exists() -> None:
    missing = []
    for heading, path, name in _citations():
        target = _file(path)
        if not target.is_file():
            missing.append(f"{heading}: {path}::{name} (no such file)")
        elif not re.search(
            rf"^\s*(?:async )?def {name}\(|^class {name}\b", target.read_text("utf-8"), re.M
        ):
            missing.append(f"{heading}: {path}::{name} (no such test)")
    assert not missing, "stale rows in tests/reliability/CATALOGUE.md:\n" + "\n".join(missing)
