"""No import circle in ``opacus_rc``: the module import graph, read with :mod:`ast`, is acyclic.

A module ``a`` depends on ``b`` when ``a`` imports ``b`` anywhere (at module level, under
``TYPE_CHECKING``, or inside a function: a deferred import is still a circle, only hidden
until it runs). ``from p import x`` depends on the module ``p.x`` when ``x`` is a submodule of
``p``, else on ``p`` (its ``__init__``). Relative imports are resolved against the importing
module's package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import opacus_rc

PACKAGE = "opacus_rc"
ROOT = Path(opacus_rc.__file__).resolve().parent

#: Known circles, ``frozenset(modules that import one another): reason`` (none since the Trainer
#: path's batch-shaping helpers moved to integrations/model_inputs.py); any other circle (or
#: this one growing) fails the test, and so does an entry whose circle is gone.
KNOWN_CYCLES: dict[frozenset[str], str] = {}


#: Known circles between the package's subpackages (``opacus_rc.<name>``, a module counting as
#: its subpackage), ``frozenset(subpackages): reason``. The module graph has no circle, but
#: importing any module of a subpackage runs the subpackage's ``__init__`` first, so a circle
#: between subpackages works only in the order ``opacus_rc/__init__.py`` imports them.
KNOWN_PACKAGE_CYCLES: dict[frozenset[str], str] = {}


def module_files() -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules that module ``name`` (file ``path``) imports anywhere."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    out.add(sub)
                elif target in modules:
                    out.add(target)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``."""
    files = module_files()
    names = set(files)
    return {name: imports_of(name, path, names) for name, path in files.items()}


def circular_groups(graph: dict[str, set[str]]) -> list[set[str]]:
    """The graph's strongly connected components of more than one module (Tarjan): each is a
    set of modules that all import one another, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def circle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle ``start -> ... -> start`` inside ``component`` (breadth first)."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{component} is not strongly connected")


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the package's subpackages and top-level modules (``opacus_rc.x``)."""

    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {top(m): set() for m in graph}
    for a, targets in graph.items():
        out[top(a)].update(top(b) for b in targets if top(b) != top(a))
    return out


def test_the_graph_is_read_from_every_module() -> None:
    graph = import_graph()
    assert "opacus_rc.units" in graph and "opacus_rc.units.layout" in graph
    assert "opacus_rc.grad_sample.private_step" in graph
    # a module-level import, a relative-free from-import of a submodule, a package's __init__
    assert "opacus_rc.units.layout" in graph["opacus_rc.grad_sample.private_step"]
    assert "opacus_rc.grad_sample" in graph["opacus_rc"]


def test_cycles_finds_a_circle_through_a_deferred_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("from .a import f\n")
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    graph = {
        m: imports_of(m, pkg / ("__init__.py" if m == "pkg" else m[4:] + ".py"), modules)
        for m in modules
    }
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.a"}
    assert circular_groups(graph) == [{"pkg.a", "pkg.b"}]
    assert circle_through(graph, {"pkg.a", "pkg.b"}) == ["pkg.a", "pkg.b", "pkg.a"]


def test_no_import_circle_in_the_package() -> None:
    graph = import_graph()
    found = circular_groups(graph)
    unknown = [c for c in found if frozenset(c) not in KNOWN_CYCLES]
    assert not unknown, "import circles: " + "; ".join(
        f"{sorted(c)} (e.g. {' -> '.join(circle_through(graph, c))})" for c in unknown
    )
    stale = [sorted(k) for k in KNOWN_CYCLES if k not in {frozenset(c) for c in found}]
    assert not stale, f"known circles that are gone (remove them from KNOWN_CYCLES): {stale}"


def test_no_import_circle_between_subpackages_but_the_known_one() -> None:
    graph = package_graph(import_graph())
    found = {frozenset(c) for c in circular_groups(graph)}
    assert found == set(KNOWN_PACKAGE_CYCLES), (
        f"circles between subpackages: {[sorted(c) for c in found]}; known: "
        f"{[sorted(c) for c in KNOWN_PACKAGE_CYCLES]}"
    )


@pytest.mark.slow
def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    # The package imports its public names lazily (opacus_rc/__init__.py), so no module can
    # rely on another having been imported first: the grad_sample <-> units circle above once
    # broke `import opacus_rc.integrations.transformers` in a fresh process (units.split was
    # half-initialised when grad_sample.private_step imported it), while every in-process
    # test passed. Each module is imported first, alone, in its own interpreter.
    import pkgutil
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import opacus_rc

    modules = sorted(m.name for m in pkgutil.walk_packages(opacus_rc.__path__, "opacus_rc."))
    assert len(modules) > 50

    def first_import(name: str) -> tuple[str, int, str]:
        run = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", f"import {name}"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        return name, run.returncode, run.stderr[-400:]

    with ThreadPoolExecutor(2) as pool:
        failed = [r for r in pool.map(first_import, modules) if r[1] != 0]
    assert not failed, failed
