"""What the forward hook stores of one call (issue 20 item 6, round 3).

Opacus' forward hook sees the positional inputs only, so ``fc(input=x)`` stored nothing and the
backward failed with ``IndexError: list index out of range``. The randomized-clipping module
binds keyword arguments to their positions in ``forward``'s signature; these tests check the
binding's edge cases directly on the stored activations, and the error for what cannot be
stored (the numbers against the oracle are in tests/reliability/test_round3_grad_samplers.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.grad_sample.checkpointing import NoEarlyStop


class Scaled(nn.Module):
    """A leaf layer (functorch path) with an optional non-tensor argument."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return x * self.weight * scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.scaled = Scaled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled(x=self.fc(input=x))


def stored(gsm: GradSampleModuleRandomizedClipping, module: nn.Module) -> list[torch.Tensor]:
    acts = module.activations[-1]
    gsm.private_step.reset()
    return acts


def test_keywords_are_stored_at_their_positions_and_defaults_are_not() -> None:
    torch.manual_seed(0)
    model = Net()
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, sketch_dim=4)
    x = torch.randn(2, 3)
    out = gsm(x)
    with torch.no_grad():
        h = model.fc(x)
    (a,) = model.fc.activations[-1]
    torch.testing.assert_close(a, x)
    (b,) = model.scaled.activations[-1]  # scale=2.0 left at its default: not stored
    torch.testing.assert_close(b, h)
    assert out.shape == (2, 3)
    gsm.private_step.reset()
    gsm.cleanup()


def test_a_non_tensor_input_is_refused_naming_the_module() -> None:
    model = Net()
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, sketch_dim=4)
    with pytest.raises(TypeError, match=r"'scaled' \(Scaled\) was called with a float as input 1"):
        model.scaled(torch.randn(2, 3), 3.0)
    assert not getattr(model.scaled, "activations", None)
    with torch.no_grad():  # not recorded: anything goes
        model.scaled(torch.randn(2, 3), 3.0)
    gsm.cleanup()


def test_arguments_that_do_not_match_the_signature_are_refused() -> None:
    model = Net()
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, sketch_dim=4)
    with pytest.raises(TypeError):  # PyTorch's own error from the call itself
        model.fc(inputs=torch.randn(2, 3))
    gsm.cleanup()


def test_no_early_stop_is_entered_once_and_left_after_a_failed_forward() -> None:
    """Nested modules enter the context once (the outermost); a forward that raises leaves
    every entry (the hooks run with always_call), so nothing stays entered after the call."""
    outer = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    handles: list = []
    seen: list[list[bool]] = []
    no_stop = NoEarlyStop([outer, outer[0]], handles, active=lambda: True)

    def probe(_m: nn.Module, _args: object) -> None:
        seen.append([ctx is not None for _, ctx in no_stop._contexts])

    handles.append(outer[0][0].register_forward_pre_hook(probe))
    outer(torch.randn(1, 2))
    assert seen == [[True, False]] and no_stop._contexts == []
    with pytest.raises(RuntimeError):
        outer(torch.randn(1, 3))
    assert no_stop._contexts == []
    for h in handles:
        h.remove()
