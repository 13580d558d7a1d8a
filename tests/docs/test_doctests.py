"""The examples in the package's docstrings run, as part of the README's test command.

``python -m pytest`` (what ``.ci/run`` runs) collects ``tests/``; this file runs :mod:`doctest` on
every module of ``opacus_rc`` whose source has an example (a line starting with ``>>>``), so a
docstring example that stops matching the code fails CI like any other test. Modules are found
from the source text and imported one by one, so a module without examples (e.g. the optional
``transformers``/``trl`` integrations) is never imported here.

Examples marked ``# doctest: +SKIP`` (those that need a model or a training loop) are parsed but
not run; the count check below still sees them, so a malformed example cannot hide.
"""

from __future__ import annotations

import doctest
import importlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "opacus_rc"
PROMPT = re.compile(r"^\s*>>> ", re.M)


def _modules_with_examples() -> dict[str, int]:
    """Module name -> number of ``>>>`` lines in its source."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        count = len(PROMPT.findall(path.read_text(encoding="utf-8")))
        if count:
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = count
    return found


MODULES = _modules_with_examples()


def test_the_package_has_docstring_examples() -> None:
    """A guard against a scan that finds nothing (moved package, changed prompt pattern)."""
    assert len(MODULES) >= 5
    assert sum(MODULES.values()) >= 19


@pytest.mark.parametrize("name", sorted(MODULES))
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    tests = [t for t in doctest.DocTestFinder().find(module, name) if t.examples]
    # every example in the source is one the finder sees (none lost in an object it skips)
    assert sum(len(t.examples) for t in tests) == MODULES[name]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    for test in tests:
        runner.run(test, out=report.write)
    failed, _ = runner.summarize(verbose=False)
    assert failed == 0, f"docstring examples of {name} failed:\n{report.getvalue()}"
