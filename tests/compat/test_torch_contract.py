"""Contract tests of :mod:`opacus_rc._compat.torch` on the installed PyTorch."""

from __future__ import annotations

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
