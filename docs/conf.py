"""Sphinx configuration of the opacus_rc documentation.

Build (from the repository root): ``python -m sphinx -W --keep-going -b html docs
docs/_build/html``.
Offline: no intersphinx, notebooks are rendered from their committed outputs (never executed),
MathJax is loaded by the reader's browser from its default script URL.

Two kinds of pages are generated here at build time, into folders that git ignores:

* ``api/generated/*.rst``: one page per public package, listing the names in its ``__all__``.
  Other modules may move between submodules; the public names are the contract, so the pages
  are driven by ``__all__`` only. A name exported by several of the packages is documented once,
  under the most specific package that exports it; the others link to it.
* ``tutorials/generated/``: copies of ``tutorials/*.ipynb`` (and the figures they display).
"""

from __future__ import annotations

import importlib
import inspect
import shutil
import sys
from pathlib import Path

from sphinx.pycode import ModuleAnalyzer

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

import opacus_rc  # noqa: E402

project = "opacus_rc"
author = "the opacus_rc authors"
copyright = "the opacus_rc authors, Apache-2.0"
release = opacus_rc.__version__
version = release

extensions = [
    "myst_nb",  # MyST markdown (myst_parser) and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
root_doc = "index"

# ---------------------------------------------------------------------------------- MyST
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 0  # anchors are the explicit (label)= targets, stable across edits
myst_dmath_double_inline = True
nb_execution_mode = "off"  # the committed notebooks are executed; render their outputs
nb_merge_streams = True

# ---------------------------------------------------------------------------------- autodoc
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_mock_imports: list[str] = []
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True

# ---------------------------------------------------------------------------------- HTML
html_theme = "alabaster"
html_title = f"opacus_rc {release}"
html_theme_options = {"description": "Randomized clipping and spectral denoising for Opacus"}
html_static_path: list[str] = []

# ---------------------------------------------------------------------------------- warnings
# -W turns every warning into an error. Categories silenced, each for a stated reason:
suppress_warnings = [
    # Docstrings cross-reference names with Opacus/torch roles (:class:`DPOptimizer`); without
    # intersphinx (the build is offline) those stay plain text. Unresolved references are not
    # warnings unless nitpicky, so nothing is needed for them; listed here for the record.
]

#: The public packages, in the order of the API reference.
API_PACKAGES = (
    "opacus_rc",
    "opacus_rc.grad_sample",
    "opacus_rc.grad_sample.packed",
    "opacus_rc.optimizers",
    "opacus_rc.accountants",
    "opacus_rc.accountants.analysis",
    "opacus_rc.denoising",
    "opacus_rc.sketching",
    "opacus_rc.mechanism",
    "opacus_rc.data_loader",
    "opacus_rc.units",
    "opacus_rc.packing",
    "opacus_rc.packed_loss",
    "opacus_rc.packed_attention",
    "opacus_rc.lora",
    "opacus_rc.checkpoints",
    "opacus_rc.auditing",
    "opacus_rc.models",
)


def _canonical_homes() -> dict[int, str]:
    """id(object) -> the most specific package of API_PACKAGES whose ``__all__`` has it."""
    homes: dict[int, str] = {}
    for name in sorted(API_PACKAGES, key=lambda n: n.count(".")):
        module = importlib.import_module(name)
        for attr in module.__all__:
            homes[id(getattr(module, attr))] = name  # deeper packages overwrite shallower ones
    return homes


def _data_doc(package: str, attr: str, obj: object) -> str:
    """The ``#:`` comment of a module-level constant, looked up in the module defining it."""
    for modname, module in sorted(sys.modules.items()):
        if not modname.startswith(package) or module is None:
            continue
        if getattr(module, attr, None) is not obj:
            continue
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except Exception:  # a C or namespace module: no source to analyse
            continue
        if ("", attr) in docs:
            return " ".join(line.strip() for line in docs[("", attr)] if line.strip())
    return ""


def _directive(obj: object) -> str:
    if inspect.isclass(obj):
        return "autoexception" if issubclass(obj, BaseException) else "autoclass"
    if callable(obj):
        return "autofunction"
    return "data"


def write_api_pages() -> None:
    out = DOCS / "api" / "generated"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    homes = _canonical_homes()
    for package in API_PACKAGES:
        module = importlib.import_module(package)
        title = f"``{package}``"
        lines = [title, "=" * len(title), "", f".. automodule:: {package}", "   :no-members:", ""]
        own, elsewhere = [], []
        for attr in module.__all__:
            obj = getattr(module, attr)
            (own if homes[id(obj)] == package else elsewhere).append((attr, obj))
        for attr, obj in own:
            kind = _directive(obj)
            if kind == "data":
                lines += [f".. py:data:: {attr}", f"   :module: {package}", ""]
                doc = _data_doc(package, attr, obj)
                if isinstance(obj, (str, int, float, tuple)) and len(repr(obj)) < 200:
                    lines[-1:] = [f"   :value: {obj!r}", ""]
                if doc:
                    lines += [f"   {doc}", ""]
            else:
                lines += [f".. {kind}:: {package}.{attr}", ""]
        if elsewhere:
            lines += ["Also exported here", "------------------", ""]
            for attr, obj in elsewhere:
                lines.append(f"* ``{package}.{attr}``: see :py:obj:`{homes[id(obj)]}.{attr}`")
            lines.append("")
        (out / f"{package}.rst").write_text("\n".join(lines), encoding="utf-8")


def copy_tutorials() -> None:
    src = ROOT / "tutorials"
    out = DOCS / "tutorials" / "generated"
    shutil.rmtree(out, ignore_errors=True)
    (out / "outputs").mkdir(parents=True)
    for nb in sorted(src.glob("*.ipynb")):
        shutil.copy2(nb, out / nb.name)
    for fig in sorted((src / "outputs").glob("*.png")):
        shutil.copy2(fig, out / "outputs" / fig.name)


write_api_pages()
copy_tutorials()
