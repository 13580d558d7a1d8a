"""Issue 31: how many distinct functions of a package one private training step passes through.

A maintainer holds a step in their head when it passes through few functions in few files. This
script counts them the way issue 31 states its target: one step of a small sequence model (an
``nn.Embedding``, an ``nn.LayerNorm`` and two ``nn.Linear`` layers) made private with
``opacus_rc.PrivacyEngine(clipping="randomized")`` (book-keeping on, the default; accountant
``"rc"``), traced with :func:`sys.setprofile` from the criterion's ``backward()`` to the end of
``optimizer.step()`` (which runs the accountant's step hook). The forward pass and
``zero_grad`` are not traced. A function is a code object (file, first line, name) whose file lies
inside the package; the second step is traced, so one-time work (lazy imports, the first-batch
batch-independence check) is not counted.

For comparison the same step is traced in Opacus (``grad_sample_mode="ghost"`` and ``"hooks"``,
counting Opacus' own files).

Examples::

    python -m benchmarks.step_functions            # the table
    python -m benchmarks.step_functions --list     # every function counted, by file
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, EMB, CLASSES, SEQ, N, BATCH = 32, 16, 2, 8, 64, 16


class StepModel(nn.Module):
    """Embedding, LayerNorm and two linear layers over a sequence, mean-pooled.

    Input ``(B, T)`` token ids; output ``(B, CLASSES)`` logits.
    """

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMB)
        self.norm = nn.LayerNorm(EMB)
        self.proj = nn.Linear(EMB, EMB)
        self.head = nn.Linear(EMB, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(x))
        h = torch.relu(self.proj(h)) + h
        return self.head(h.mean(1))


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (N, SEQ), generator=g)
    y = torch.randint(0, CLASSES, (N,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def _make(method: str) -> tuple[nn.Module, Any, Any, DataLoader]:
    torch.manual_seed(0)
    model = StepModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    common = {
        "module": model,
        "optimizer": optimizer,
        "criterion": nn.CrossEntropyLoss(),
        "data_loader": _data(),
        "noise_multiplier": 1.0,
        "max_grad_norm": 1.0,
        "poisson_sampling": True,
    }
    if method == "opacus_rc":
        import opacus_rc

        engine = opacus_rc.PrivacyEngine(accountant="rc")
        return engine.make_private(**common, clipping="randomized", sketch_dim=4)
    import opacus

    engine = opacus.PrivacyEngine(accountant="prv")
    if method == "opacus-ghost":
        return engine.make_private(**common, grad_sample_mode="ghost")
    model, optimizer, loader = engine.make_private(**{**common, "criterion": None})
    return model, optimizer, nn.CrossEntropyLoss(), loader


def _package_root(method: str) -> Path:
    if method == "opacus_rc":
        import opacus_rc

        return Path(opacus_rc.__file__).resolve().parent
    import opacus

    return Path(opacus.__file__).resolve().parent


def trace_step(method: str) -> Counter[tuple[str, int, str]]:
    """Trace one private step and count the calls of each function of the method's package.

    Args:
        method: ``"opacus_rc"``, ``"opacus-ghost"`` or ``"opacus-hooks"``.

    Returns:
        A counter from ``(file relative to the package root, first line, function name)`` to the
        number of calls in the traced step.
    """
    root = _package_root(method)
    model, optimizer, criterion, loader = _make(method)
    batches = iter(loader)
    calls: Counter[tuple[str, int, str]] = Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        try:
            rel = Path(code.co_filename).resolve().relative_to(root)
        except ValueError:
            return
        calls[(str(rel), code.co_firstlineno, code.co_qualname)] += 1

    def one_step(traced: bool) -> None:
        x, y = next(batches)
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        if traced:
            sys.setprofile(profile)
        try:
            loss.backward()
            optimizer.step()
        finally:
            sys.setprofile(None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one_step(False)
        one_step(True)
    return calls


def summarise(calls: Counter[tuple[str, int, str]]) -> tuple[int, int]:
    """Distinct functions and distinct files in a trace from :func:`trace_step`."""
    return len(calls), len({f for f, _, _ in calls})


def main(argv: list[str] | None = None, *, out: Callable[[str], None] = print) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="list every function counted")
    parser.add_argument(
        "--methods", nargs="+", default=["opacus_rc", "opacus-ghost", "opacus-hooks"]
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out("| method | functions | files | calls |")
    out("|---|---|---|---|")
    traces = {}
    for method in args.methods:
        calls = traces[method] = trace_step(method)
        functions, files = summarise(calls)
        out(f"| {method} | {functions} | {files} | {sum(calls.values())} |")
    if args.list:
        for method, calls in traces.items():
            out(f"\n## {method}")
            by_file: dict[str, list[str]] = {}
            for (f, line, name), n in sorted(calls.items()):
                by_file.setdefault(f, []).append(f"{name}:{line} x{n}")
            for f, names in by_file.items():
                out(f"{f} ({len(names)}): " + ", ".join(names))


if __name__ == "__main__":
    main()
