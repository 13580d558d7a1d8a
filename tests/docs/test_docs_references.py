"""The documentation's citations of tests stay true: every ``tests/<file>.py::<function>`` named
in docs/ exists (tests move with code; a stale citation fails here, not silently)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITATION = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def _citations() -> list[tuple[str, str, str | None]]:
    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if "_build" in page.parts or "generated" in page.parts:
            continue
        for path, func in CITATION.findall(page.read_text(encoding="utf-8")):
            found.append((page.relative_to(ROOT).as_posix(), path, func or None))
    return found


def test_docs_cite_tests() -> None:
    """The privacy pages name their checks (a guard against the regex silently matching
    nothing)."""
    pages = {page for page, _, _ in _citations()}
    assert {"docs/privacy/envelope.md", "docs/privacy/prv.md", "docs/denoising.md"} <= pages
    assert len(_citations()) > 100


def test_every_cited_test_exists() -> None:
    missing = []
    for page, path, func in _citations():
        target = ROOT / path
        if not target.is_file():
            missing.append(f"{page}: {path} (no such file)")
        elif func and not re.search(rf"^\s*def {func}\(", target.read_text(encoding="utf-8"), re.M):
            missing.append(f"{page}: {path}::{func} (no such test)")
    assert not missing, "stale test citations in docs/:\n" + "\n".join(missing)
