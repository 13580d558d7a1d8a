"""Every adapter of ``opacus_rc/_compat/`` says what it relies on and which test catches its
change, and that test exists (a citation that went stale fails here)."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

HERE = Path(__file__).parent
CITATION = re.compile(r"``(test_\w+\.py)::(test_\w+)``")
MODULES = ["opacus", "torch", "transformers"]


def _adapters() -> list[tuple[str, str, object]]:
    out = []
    for name in MODULES:
        if name == "transformers":
            pytest.importorskip("transformers")
        module = importlib.import_module(f"opacus_rc._compat.{name}")
        for attr in module.__all__:
            obj = getattr(module, attr)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                if getattr(obj, "__module__", "") != module.__name__:
                    continue  # re-exported (SequenceBias): its import line is the adapter
                out.append((name, attr, obj))
    return out


def test_every_adapter_names_its_internal_and_test() -> None:
    problems = []
    adapters = _adapters()
    assert len(adapters) >= 25  # a guard against an empty sweep
    for module, attr, obj in adapters:
        doc = inspect.getdoc(obj) or ""
        if "Relies on" not in doc:
            problems.append(f"{module}.{attr}: no 'Relies on' in its docstring")
        cited = CITATION.findall(doc)
        if not cited:
            problems.append(f"{module}.{attr}: cites no test (``test_x.py::test_y``)")
        for file, func in cited:
            path = HERE / file
            if not path.is_file() or not re.search(
                rf"^def {func}\(", path.read_text(encoding="utf-8"), re.M
            ):
                problems.append(f"{module}.{attr}: cites {file}::{func}, which does not exist")
    assert not problems, "\n".join(problems)
