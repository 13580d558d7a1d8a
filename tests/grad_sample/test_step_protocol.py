"""The step protocol (issue 12): the StepState's transitions, its invariant, the norm-path
resolver, and the silent privacy failures it closes.

Every test here fails on the code before the step-protocol redesign: there a parameter made
trainable or replaced after ``make_private`` was released unclipped (two passes) or silently
dropped (book-keeping), a module owning a direct parameter sent its Linear children to
functorch while they were logged as sketched, and a zero_grad() between backward and step,
or a step before any backward, was taken and accounted.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc import PrivacyEngine
from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.grad_sample.private_step import StepPhase, StepProtocolError
from opacus_rc.grad_sample.routing import NormPath, UnsupportedModuleError

D, H, C, T = 4, 6, 3, 5


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, H)
        self.head = nn.Linear(H, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))).mean(1)


def _private(model: nn.Module, *, bookkeeping: bool = True) -> tuple[Any, Any, Any, Any]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, T, D, generator=gen)
    y = torch.randint(0, C, (16,), generator=gen)
    engine = PrivacyEngine()
    module, opt, crit, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1e-3,
        clipping="randomized",
        sketch_dim=8,
        bookkeeping=bookkeeping,
    )
    return engine, module, opt, crit


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(4, T, D, generator=gen), torch.randint(0, C, (4,), generator=gen)


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ----------------------------------------------------------------------------------------------
# Silent failure 1: the trainable set changed after make_private
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bookkeeping", [True, False])
@pytest.mark.parametrize("change", ["unfreeze", "replace", "tie"])
def test_trainable_set_changed_after_make_private_raises(bookkeeping: bool, change: str) -> None:
    """Unfreezing a parameter, replacing a module (and adding it to the optimizer) or tying a
    parameter after make_private: the next private backward raises naming the parameter, before
    any gradient exists, and nothing is stepped or accounted. Before the redesign the unfrozen
    weight was released unclipped (two passes: with C = 1e-3 its update is ~1e3 x C) or dropped
    (book-keeping); a tie raised a bare AttributeError ('_forward_counter')."""
    torch.manual_seed(0)
    model = TwoLayer()
    model.fc1.weight.requires_grad_(False)
    engine, module, opt, crit = _private(model, bookkeeping=bookkeeping)
    if change == "unfreeze":  # already in the optimizer (it was built on model.parameters())
        model.fc1.weight.requires_grad_(True)
        culprit = "fc1.weight"
    elif change == "replace":
        model.fc2 = nn.Linear(H, H)
        opt.add_param_group({"params": list(model.fc2.parameters())})
        culprit = "fc2."
    else:  # fc2's bias becomes fc1's (both of size H), already in the optimizer
        model.fc2.bias = model.fc1.bias
        culprit = "fc[12].bias"
    x, y = _batch()
    theta = _params(model)
    with pytest.raises(RuntimeError, match=rf"'{culprit}.*after the model was made private"):
        crit(module(x), y).backward()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="(?i)no step is taken and nothing is accounted"):
        opt.step()
    assert len(engine.accountant) == 0
    assert torch.equal(_params(model), theta)


def test_frozen_after_make_private_is_fine() -> None:
    """Freezing a parameter after make_private is allowed: it gets no gradient, and the step
    clips and accounts the others."""
    torch.manual_seed(0)
    model = TwoLayer()
    engine, module, opt, crit = _private(model)
    model.fc1.weight.requires_grad_(False)
    crit(module(*_batch()[:1]), _batch()[1]).backward()
    assert model.fc1.weight.grad is None
    opt.step()
    assert len(engine.accountant) == 1


# ----------------------------------------------------------------------------------------------
# Silent failure 2: a module owning a direct parameter and trainable children
# ----------------------------------------------------------------------------------------------


class Sinks(nn.Module):
    """GPT-OSS-like attention: a direct trainable parameter next to Linear children."""

    def __init__(self) -> None:
        super().__init__()
        self.sinks = nn.Parameter(torch.zeros(H))
        self.q = nn.Linear(D, H)
        self.o = nn.Linear(H, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.tanh(self.q(x)) + self.sinks).mean(1)


class Scale(nn.Module):
    """A leaf with a direct parameter and no children: functorch computes it exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def test_direct_parameter_over_trainable_children_is_refused() -> None:
    """Opacus would run functorch over the whole subtree (Linear children computed exactly but
    logged as sketched; dropout inside it cannot be replayed, and GPT-OSS ``sinks`` crashed
    with a bare IndexError). The resolver refuses it at make_private, naming the module and
    what to do, and leaves no hook behind."""
    model = Sinks()
    with pytest.raises(UnsupportedModuleError, match=r"'<root>' \(Sinks\).*\['sinks'\]"):
        GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0)
    assert not hasattr(model, "autograd_grad_sample_hooks")
    model.sinks.requires_grad_(False)  # freezing the direct parameter is one way out
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0)
    assert {r.name: r.path for r in gsm.norm_routes.values()} == {
        "q": NormPath.SKETCHED,
        "o": NormPath.SKETCHED,
    }
    gsm.cleanup()


def test_logged_and_accounted_path_is_the_computed_one(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log line, the route and the sampler actually called agree for every module: the
    Linear is sketched (the sketched sampler runs once, for it), the leaf with a direct
    parameter is exact through functorch (the sketched sampler never sees it), and only the
    sketched route reports the module's sketch spec."""
    from opacus_rc.grad_sample import registry

    model = nn.Sequential(nn.Linear(D, H), Scale(), nn.Linear(H, C))
    model[2].requires_grad_(False)
    calls: list[str] = []
    sampler = registry.SKETCHED_NORM_SAMPLERS[nn.Linear]

    def spy(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls.append(type(layer).__name__)
        return sampler(layer, *args, **kwargs)

    monkeypatch.setitem(registry.SKETCHED_NORM_SAMPLERS, nn.Linear, spy)
    with caplog.at_level(logging.INFO, logger="opacus_rc.grad_sample.grad_sample_module"):
        gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, sketch_dim=8)
    logged = {r.args[0]: r.args[2] for r in caplog.records if r.args and len(r.args) == 3}
    assert logged == {
        "0": "sketched (hutchinson, k=8)",
        "1": "exact per-sample gradients (functorch fallback)",
    }
    routes = gsm.norm_routes
    assert routes["0"].accounted(gsm.sketch_spec) == gsm.sketch_spec
    assert routes["1"].accounted(gsm.sketch_spec) is None
    gsm(torch.randn(2, T, D)).sum().backward()
    assert calls == ["Linear"]
    assert set(gsm.norm_samples) == {"0.weight", "0.bias", "1.w"}
    gsm.cleanup()


# ----------------------------------------------------------------------------------------------
# The state machine
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bookkeeping", [True, False])
def test_out_of_order_calls_raise_and_leave_nothing_half_done(bookkeeping: bool) -> None:
    """Each out-of-order call raises the documented error; neither the parameters nor the
    accountant move, and the protocol recovers with zero_grad()."""
    torch.manual_seed(0)
    model = TwoLayer()
    engine, module, opt, crit = _private(model, bookkeeping=bookkeeping)
    state = module.private_step
    x, y = _batch()
    theta = _params(model)

    # step() before any backward
    with pytest.raises(StepProtocolError, match="no private backward ran since the last step"):
        opt.step()
    # two backwards without a step: the first one's clipped gradients stay usable
    crit(module(x), y).backward()
    assert state.phase is StepPhase.APPLIED
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(StepProtocolError, match="backward\\(\\) was called twice"):
        crit(module(x), y).backward()
    # the refused forward's records are dropped; the first batch's result stays pending
    assert state.phase is StepPhase.IDLE and opt.last_clip_result is not None
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
    # zero_grad() between backward and step
    opt.zero_grad()
    with pytest.raises(StepProtocolError, match="zero_grad\\(\\) between backward\\(\\) and step"):
        opt.step()
    assert len(engine.accountant) == 0 and torch.equal(_params(model), theta)

    # a failed backward (NaN input), then a backward without zero_grad
    bad = x.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(FloatingPointError):
        crit(module(bad), y).backward()
    assert state.phase is StepPhase.IDLE and not state.has_stashes
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(StepProtocolError, match="call optimizer.zero_grad\\(\\) before"):
        crit(module(x), y).backward()
    with pytest.raises(StepProtocolError, match="raised; its gradients may be unclipped"):
        opt.step()
    assert len(engine.accountant) == 0 and torch.equal(_params(model), theta)

    # recovery: zero_grad, one clean step, accounted once
    opt.zero_grad()
    assert state.phase is StepPhase.IDLE
    crit(module(x), y).backward()
    opt.step()
    assert state.phase is StepPhase.APPLIED  # the step's records are kept until the next forward
    assert len(engine.accountant) == 1
    # a second step after one backward
    with pytest.raises(StepProtocolError, match="step\\(\\) twice"):
        opt.step()
    assert len(engine.accountant) == 1


def test_norms_stay_readable_after_backward_until_the_next_forward() -> None:
    """Issue 14, item 8: Opacus users read get_norm_sample() / per_sample_gradient_norms after
    backward() to log norms; both answer (the same values) until the next forward pass."""
    torch.manual_seed(0)
    model = TwoLayer()
    _, module, opt, crit = _private(model)
    x, y = _batch()
    crit(module(x), y).backward()
    norms = module.get_norm_sample()
    assert norms.shape == (4,) and torch.equal(norms, module.per_sample_gradient_norms)
    opt.step()
    opt.zero_grad()
    assert torch.equal(module.get_norm_sample(), norms)
    module(x)  # the next forward
    with pytest.raises(RuntimeError, match="no per-sample norms for this step"):
        module.get_norm_sample()


def test_a_forward_that_raises_leaves_nothing_for_the_next_step() -> None:
    """A new user's HF model raised inside its forward on an empty Poisson batch; the inputs
    recorded before the error made the next, healthy batch raise 'ran more than once'. The
    wrapper now drops what a failed forward recorded."""

    class Picky(TwoLayer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.fc1(x))
            if x.shape[0] == 0:
                raise RuntimeError("cannot reshape tensor of 0 elements")
            return self.head(torch.tanh(self.fc2(h))).mean(1)

    torch.manual_seed(0)
    model = Picky()
    engine, module, opt, crit = _private(model)
    x, y = _batch()
    with pytest.raises(RuntimeError, match="cannot reshape"):
        module(x[:0])
    crit(module(x), y).backward()
    opt.step()
    assert len(engine.accountant) == 1
