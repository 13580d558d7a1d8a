"""Contract tests of :mod:`opacus_rc._compat.torch` on the installed PyTorch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from opacus_rc._compat import torch as compat


def test_in_backward() -> None:
    seen: list[bool] = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(compat.in_backward()))
    assert compat.in_backward() is False
    y.sum().backward()
    assert seen == [True]
    assert compat.in_backward() is False


def test_checkpoint_pack_hook_detected() -> None:
    """True in the original forward of a non-reentrant region only: not outside, not in the
    recomputation inside the backward (which is in_backward), not under other hooks."""
    seen: list[tuple[bool, bool]] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        seen.append((compat.non_reentrant_checkpoint_pack_hook_active(), compat.in_backward()))
        return (x * 3).sin()

    x = torch.ones(2, requires_grad=True)
    assert compat.non_reentrant_checkpoint_pack_hook_active() is False
    out = torch_checkpoint.checkpoint(body, x, use_reentrant=False)
    out.sum().backward()
    assert seen == [(True, False), (False, True)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert compat.non_reentrant_checkpoint_pack_hook_active() is False


def test_sequence_numbers_increase() -> None:
    x = torch.ones(2, requires_grad=True)
    a = x * 2
    b = a + 1
    c = b.exp()
    nrs = [compat.autograd_sequence_nr(t.grad_fn) for t in (a, b, c)]
    assert nrs == sorted(nrs) and len(set(nrs)) == 3


def test_registered_parameters_is_live() -> None:
    lin = nn.Linear(2, 3)
    reg = compat.registered_parameters(lin)
    assert set(reg) == {"weight", "bias"} and reg["weight"] is lin.weight
    new = nn.Parameter(torch.zeros(3, 2))
    reg["weight"] = new
    assert lin.weight is new
    assert any(p is new for p in lin.parameters())
    assert compat.registered_parameters(nn.Sequential(lin)) == {}  # own parameters only


def test_registered_submodule() -> None:
    lin = nn.Linear(2, 2)
    seq = nn.Sequential(lin)
    assert compat.registered_submodule(seq, "0") is lin
    assert compat.registered_submodule(seq, "1") is None
    bare = nn.Module.__new__(nn.Module)  # before nn.Module.__init__: no _modules yet
    assert compat.registered_submodule(bare, "0") is None


def test_tensor_version() -> None:
    """An autograd accumulation into an existing ``.grad`` is in place and moves its version
    counter (what the optimizer's check of a changed gradient relies on)."""
    from opacus_rc._compat.torch import tensor_version

    w = torch.ones(3, requires_grad=True)
    (2 * w).sum().backward()
    grad = w.grad
    before = tensor_version(grad)
    (3 * w).sum().backward()
    assert w.grad is grad and tensor_version(grad) > before
    assert torch.equal(grad, torch.full((3,), 5.0))
    assert tensor_version(None) == -1


def test_fsdp_unsharded_parameters(tmp_path: Path) -> None:
    """``fsdp_unsharded_parameters`` maps each leaf FSDP2 created at its all-gather to the
    registered sharded parameter, so that the parameter-use check refuses a use outside the
    owning module's forward under FSDP2 (2 processes, gloo: the ``use_outside`` scenario of
    ``tests/distributed/fsdp_llama_worker.py`` asserts the map inside each rank)."""
    pytest.importorskip("transformers")
    worker = Path(__file__).resolve().parents[1] / "distributed" / "fsdp_llama_worker.py"
    out = tmp_path / "use_outside.json"
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    env["FSDP_LLAMA_ONLY"] = "use_outside"
    proc = subprocess.run(
        [sys.executable, str(worker), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())["use_outside"]
    assert set(res) == {"bookkeeping", "two_pass"}
    assert all("['lin2.weight'] are used outside the forward" in m for m in res.values())
