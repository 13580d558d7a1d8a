"""No module of ``opacus_rc`` outside ``opacus_rc/_compat/`` touches another package's private
name (see the docstring of :mod:`opacus_rc._compat` for the rule).

The check is static (``ast``), over every ``.py`` file of the package. A *reach* is one of:

1. importing a private module or name of another package: ``import torch._C``,
   ``from opacus.optimizers.optimizer import _generate_noise``, ``from x._y import z``;
2. an underscore attribute of a name bound by an import of another package:
   ``torch._C._current_graph_task_id()``, ``transformers.Trainer._get_train_sampler``;
3. a private attribute another package defines, on any object (``p._forward_counter``,
   ``self._module``, ``super()._prepare_model``), as an attribute, a method definition that
   overrides it, or a string (``getattr(p, "_current_grad_sample")``): the names are listed in
   :data:`FOREIGN_PRIVATE_NAMES`, with their owner;
4. a string naming a private module of another package (``"torch.distributed.fsdp._fully_shard"``
   for ``importlib``).

Run as a script to list the reaches of any checkout:
``python tests/compat/test_boundary.py path/to/opacus_rc`` (exit status 1 if there are any).
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

OWN = "opacus_rc"
#: Where private names of other packages are allowed (relative to the package root).
ADAPTER = "_compat"

#: Private names other packages define that ``opacus_rc`` code is known to touch (or could),
#: with their owner. Extend it when a new one is found (and route the use through the adapter).
FOREIGN_PRIVATE_NAMES: dict[str, str] = {
    # Opacus: attributes it sets on parameters, tensors, modules and optimizers
    "_forward_counter": "opacus",
    "_current_grad_sample": "opacus",
    "_processed": "opacus",
    "_module": "opacus",
    "_adjusted_noise_multiplier": "opacus",
    "_check_skip_next_step": "opacus",
    "_is_last_step_skipped": "opacus",
    "_step_skip_queue": "opacus",
    "_make_empty_batch": "opacus",
    "_get_module_type": "opacus",
    "_ACCOUNTANTS": "opacus",
    "_generate_noise": "opacus",
    "_check_processed_flag": "opacus",
    "_mark_as_processed": "opacus",
    # Opacus: PrivacyEngine's build steps (overridden by a subclass)
    "_prepare_model": "opacus",
    "_prepare_data_loader": "opacus",
    "_prepare_optimizer": "opacus",
    "_prepare_criterion": "opacus",
    # PyTorch
    "_C": "torch",
    "_parameters": "torch",
    "_buffers": "torch",
    "_modules": "torch",
    "_forward_hooks": "torch",
    "_forward_pre_hooks": "torch",
    "_backward_hooks": "torch",
    "_sequence_nr": "torch",
    "_current_graph_task_id": "torch",
    "_top_saved_tensors_default_hooks": "torch",
    "_checkpoint_hook": "torch",
    # transformers.Trainer
    "_clip_grad_norm": "transformers",
    "_get_grad_norm": "transformers",
    "_get_num_items_in_batch": "transformers",
    "_track_num_input_tokens": "transformers",
    "_save_checkpoint": "transformers",
    "_load_optimizer_and_scheduler": "transformers",
    "_get_train_sampler": "transformers",
    "_remove_unused_columns": "transformers",
    "_get_collator_with_removed_columns": "transformers",
    "_prepare_inputs": "transformers",
    "_get_output_dir": "transformers",
    "_train_batch_size": "transformers",
    "_loss_shifts_labels": "transformers",
    # standard library
    "_actions": "argparse",
    "_SubParsersAction": "argparse",
}

_MODULE_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+\.?$")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Reach:
    path: str
    line: int
    col: int
    owner: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.owner}] {self.what}"


def _chain_root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    if isinstance(node, ast.Call):  # torch.foo()._bar: the root of the callee
        return _chain_root(node.func)
    return node.id if isinstance(node, ast.Name) else None


def _foreign_bindings(tree: ast.AST) -> dict[str, str]:
    """Local name -> top-level package, for every import of another package in the file."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top != OWN:
                    bound[alias.asname or top] = top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
            if top not in (OWN, "__future__"):
                for alias in node.names:
                    bound[alias.asname or alias.name] = top
    return bound


def scan_source(source: str, path: str = "<string>") -> list[Reach]:
    """The reaches into other packages' private names in one module's source."""
    tree = ast.parse(source)
    bound = _foreign_bindings(tree)
    found: dict[tuple[int, int], Reach] = {}

    def add(node: ast.AST, owner: str, what: str) -> None:
        key = (node.lineno, node.col_offset)
        found.setdefault(key, Reach(path, node.lineno, node.col_offset, owner, what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] != OWN and any(_private(p) for p in parts):
                    add(node, parts[0], f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] in (OWN, "__future__"):
                continue
            if any(_private(p) for p in parts):
                add(node, parts[0], f"from {node.module} import ...")
            for alias in node.names:
                if _private(alias.name):
                    add(node, parts[0], f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = _chain_root(node)
            if node.attr in FOREIGN_PRIVATE_NAMES:
                add(node, FOREIGN_PRIVATE_NAMES[node.attr], ast.unparse(node))
            elif root in bound:
                add(node, bound[root], ast.unparse(node))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name in FOREIGN_PRIVATE_NAMES:
                add(node, FOREIGN_PRIVATE_NAMES[node.name], f"def {node.name} (override)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            head = text.split(".")[0]
            if head in FOREIGN_PRIVATE_NAMES:
                add(node, FOREIGN_PRIVATE_NAMES[head], repr(text))
            elif (
                _MODULE_PATH.match(text)
                and head in _KNOWN_PACKAGES
                and any(_private(p) for p in text.rstrip(".").split("."))
            ):
                add(node, head, repr(text))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) > 1
        ):
            obj, name = node.args[0], node.args[1]
            if (
                isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and _private(name.value)
                and name.value.split(".")[0] not in FOREIGN_PRIVATE_NAMES  # rule 3 has it
                and _chain_root(obj) in bound
            ):
                add(node, bound[_chain_root(obj)], ast.unparse(node))
    return sorted(found.values(), key=lambda r: (r.line, r.col))


_KNOWN_PACKAGES = {
    "torch",
    "opacus",
    "transformers",
    "peft",
    "prv_accountant",
    "trl",
    "accelerate",
    "datasets",
    "scipy",
    "numpy",
}


def scan_package(root: Path) -> list[Reach]:
    """Every reach in the ``.py`` files under ``root`` (a package directory), outside its
    ``_compat`` adapter."""
    out: list[Reach] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == ADAPTER:
            continue
        out.extend(scan_source(path.read_text(encoding="utf-8"), str(root.name / rel)))
    return out


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_no_foreign_private_name_outside_the_adapter() -> None:
    import opacus_rc

    reaches = scan_package(Path(opacus_rc.__file__).parent)
    assert not reaches, (
        f"{len(reaches)} use(s) of another package's private name outside opacus_rc/_compat/ "
        "(add an adapter function there, with a contract test, and call it):\n"
        + "\n".join(map(str, reaches))
    )


def test_the_launcher_reaches_no_private_name() -> None:
    """The console script's launcher, ``opacus_rc_cli.py``, is outside the package (so that
    ``opacus-rc --help`` imports no torch) and so cannot use the adapter without importing the
    package: it must need no private name at all (it found a sub-parser through argparse's
    ``_actions`` and ``_SubParsersAction`` before the engine merge)."""
    path = Path(__file__).parents[2] / "opacus_rc_cli.py"
    reaches = scan_source(path.read_text(encoding="utf-8"), path.name)
    assert not reaches, "\n".join(map(str, reaches))


_VIOLATIONS = """
import torch._C
import torch.utils.checkpoint as ckpt
from torch import nn
from opacus.optimizers.optimizer import _generate_noise
from torch.distributed.fsdp._fully_shard import FSDPModule
import transformers
import importlib

def f(p, module, optimizer):
    torch._C._current_graph_task_id()
    p._forward_counter -= 1
    module._parameters["w"] = None
    getattr(optimizer, "_adjusted_noise_multiplier", None)
    nn._reduction
    ckpt._checkpoint_hook
    transformers.Trainer._some_new_private
    getattr(transformers, "_hidden")
    importlib.import_module("torch.distributed._tensor")

class Engine:
    def _prepare_model(self, m):
        return super()._prepare_model(m)
"""

_CLEAN = '''
"""Docstring naming ``p._forward_counter`` and torch._C is fine."""
import torch
from opacus_rc.accountants.analysis._checks import check_delta
from ._local import thing

class Mine:
    _own = 1

    def _helper(self):
        self._own += 1
        return torch.zeros(1).__class__, self.__dict__, "_not_a_known_name"
'''


def test_scanner_finds_each_kind_of_reach() -> None:
    reaches = scan_source(_VIOLATIONS)
    lines = Counter(r.line for r in reaches)
    expected = {2, 5, 6, 11, 12, 13, 14, 15, 16, 17, 18, 19, 22, 23}  # source line numbers
    assert set(lines) == expected, sorted(map(str, reaches))
    owners = {r.line: r.owner for r in reaches}
    assert owners[5] == "opacus" and owners[12] == "opacus" and owners[17] == "transformers"
    assert owners[11] == "torch" and owners[23] == "opacus"
    assert sum(lines.values()) == len(expected)  # one reach per expression


def test_scanner_ignores_own_private_names() -> None:
    assert scan_source(_CLEAN) == []


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).parents[2] / OWN
    reaches = scan_package(root)
    for r in reaches:
        print(r)
    by_owner = Counter(r.owner for r in reaches)
    print(f"{len(reaches)} reach(es):", dict(sorted(by_owner.items())))
    return 1 if reaches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
