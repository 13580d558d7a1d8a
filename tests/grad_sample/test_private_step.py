"""The private step as one owner (issue 21, item 3; issue 31, items 1 and 2): one object,
``module.private_step``, runs the private backward and returns a frozen :class:`ClipResult`,
the only thing that crosses to the optimizer; the DP loss is thin; the optimizer holds the
pending result, refuses ``step()`` without one and holds no reference to the grad-sample module.

The issue-31 tests fail on the code before it: there the private backward called back into the
optimizer (``StepPeer``: ``discard_gradients``, ``all_ranks_ok``), the optimizer held the module
and drove its step state, and Opacus' own two-pass loss stepped without any clip result.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from torch import nn

from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.grad_sample.private_step import ClipResult
from opacus_rc.optimizers import DPLossRandomizedClipping, RandomizedClipOptimizer
from opacus_rc.optimizers.dp_loss import DPTensorRandomizedClipping

pytestmark = pytest.mark.filterwarnings("ignore:a sketch_generator was passed:UserWarning")

B, D, H, C = 6, 5, 7, 3
#: Small enough that every sample is clipped (the per-sample norms are O(1)).
MAX_GRAD_NORM = 1e-2


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, C))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, D, generator=g), torch.randint(0, C, (B,), generator=g)


def private(net: nn.Module, *, bookkeeping: bool = True, k: int = 16) -> tuple[Any, Any, Any]:
    gsm = GradSampleModuleRandomizedClipping(
        net,
        max_grad_norm=MAX_GRAD_NORM,
        sketch_dim=k,
        sketch_generator=torch.Generator().manual_seed(0),
        bookkeeping=bookkeeping,
    )
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1),
        grad_sample_module=gsm,
        noise_multiplier=1.0,
        expected_batch_size=B,
    )
    crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss(), "mean")
    return gsm, opt, crit


def per_sample_grads(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(B, P)`` float64 per-sample gradients ``g_i`` of each sample's loss (the clipped sum
    is ``sum_i c_i g_i``; the optimizer divides by the expected batch size later)."""
    ref = copy.deepcopy(net).double()
    params = list(ref.parameters())
    rows = []
    for i in range(B):
        loss = nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1])
        rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


@pytest.mark.parametrize("bookkeeping", [True, False])
def test_private_backward_returns_the_factors_it_applied(bookkeeping: bool) -> None:
    """The one private backward returns a frozen ClipResult whose clip factors are
    ``min(1, C / (n_hat + 1e-6))`` of its own norms, and are the ones in ``p.grad``: the
    released sum equals ``sum_i c_i g_i`` with the float64 oracle's per-sample gradients. The
    optimizer holds the same result."""
    net = model()
    x, y = batch()
    G = per_sample_grads(net, x, y)
    gsm, opt, crit = private(net, bookkeeping=bookkeeping)
    out = gsm(x)
    loss = crit(out, y)
    reduced = torch.mean(loss.loss_per_sample)
    result = gsm.private_step.backward(
        loss.loss_per_sample, reduced_loss=reduced, max_grad_norm=MAX_GRAD_NORM
    )
    assert isinstance(result, ClipResult)
    assert result.max_grad_norm == MAX_GRAD_NORM and result.open_unit is None
    assert result.clipped == frozenset(id(p) for p in net.parameters())
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.num_records = 0  # type: ignore[misc]
    assert result.num_records == B and not result.per_unit
    assert result.bookkeeping is bookkeeping is gsm.bookkeeping
    assert result.sketch_spec is gsm.sketch_spec
    assert result.per_sample_norms is gsm.per_sample_gradient_norms
    want_factors = (MAX_GRAD_NORM / (result.per_sample_norms + 1e-6)).clamp(max=1.0)
    assert result.clip_factors.shape == (B,) and bool((result.clip_factors < 1).all())
    torch.testing.assert_close(result.clip_factors.double(), want_factors, rtol=1e-6, atol=0)
    got = torch.cat([p.grad.flatten() for p in net.parameters()]).double()
    want = (result.clip_factors.double()[:, None] * G).sum(0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-9)
    # Through the loss: the same kind of result is handed to the optimizer.
    opt.zero_grad()
    crit(gsm(x), y).backward()
    handed = opt.last_clip_result
    assert isinstance(handed, ClipResult) and handed is not result
    assert handed.num_records == B


def test_the_loss_calls_one_method_of_each_collaborator() -> None:
    """The DP loss reduces, checks its arguments, reads whether the optimizer allows a
    backward (``backward_allowed``), runs ``module.private_step.backward`` once with the
    optimizer's ``C``, and hands its result to ``optimizer.accept_clip_result`` (stubs with
    only these methods suffice). An
    argument error is passed to the private backward, which raises it where it fails the
    step; the optimizer is then told (``backward_failed``)."""
    calls: list[tuple[str, Any]] = []
    sentinel = object()

    class Step:
        def backward(self, losses: Any, **kwargs: Any) -> Any:
            calls.append(("backward", (losses, kwargs)))
            if kwargs["refused"] is not None:
                raise kwargs["refused"]
            return sentinel

    class Module:
        private_step = Step()

    class Optimizer:
        max_grad_norm = 0.5
        backward_allowed = True

        def _check_skip_next_step(self, pop_next: bool) -> bool:
            return False

        def accept_clip_result(self, result: Any) -> None:
            calls.append(("accept_clip_result", result))

        def backward_failed(self) -> None:
            calls.append(("backward_failed", None))

    losses = torch.tensor([1.0, 3.0], requires_grad=True)
    loss = DPTensorRandomizedClipping(Module(), Optimizer(), losses, "mean")
    loss.backward()
    assert [name for name, _ in calls] == ["backward", "accept_clip_result"]
    got_losses, kwargs = calls[0][1]
    assert got_losses is losses and kwargs["refused"] is None
    assert kwargs["max_grad_norm"] == 0.5 and kwargs["agree_ranks"] is True
    assert float(kwargs["reduced_loss"].detach()) == 2.0  # the mean of the per-sample losses
    assert calls[1][1] is sentinel
    calls.clear()
    with pytest.raises(TypeError, match="retain_graph=True"):
        loss.backward(retain_graph=True)
    assert [name for name, _ in calls] == ["backward", "backward_failed"]


def test_the_optimizer_holds_no_reference_to_the_module() -> None:
    """Issue 31: the optimizer's state (its attributes and the containers among them) holds
    neither the grad-sample module nor its step (only the plain model, whose parameters it
    checks); a step still runs."""
    net = model()
    x, y = batch()
    gsm, opt, crit = private(net)
    crit(gsm(x), y).backward()
    opt.step()
    held = list(vars(opt).values())
    for value in list(held):
        if isinstance(value, dict):
            held.extend(value.values())
        elif isinstance(value, (list, tuple)):
            held.extend(value)
    for value in held:
        assert value is not gsm and value is not gsm.private_step


def test_step_without_a_clip_result_is_refused() -> None:
    """Opacus' own two-pass loss clips the gradients but hands the optimizer no clip result:
    ``step()`` refuses (naming the DP loss to use) and nothing is noised or accounted; the
    accountant's hook never runs."""
    net = model()
    x, y = batch()
    gsm, opt, _ = private(net)
    hooked: list[int] = []
    opt.attach_step_hook(lambda o: hooked.append(1))
    theta = [p.detach().clone() for p in net.parameters()]
    DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss())(gsm(x), y).backward()
    assert all(p.grad is not None for p in net.parameters())
    with pytest.raises(RuntimeError, match="DPLossRandomizedClipping"):
        opt.step()
    assert not hooked
    assert all(torch.equal(a, p) for a, p in zip(theta, net.parameters(), strict=True))


@pytest.mark.parametrize("how", ["plain backward", "in place"])
def test_a_gradient_changed_after_the_private_backward_is_refused(how: str) -> None:
    """Issue 31: the optimizer cannot read the module, so it checks the gradients its clip
    result covers: a plain (hooked) backward after the private one adds an unclipped gradient
    into ``p.grad`` in place, and ``step()`` refuses; ``zero_grad()`` recovers."""
    net = model()
    x, y = batch()
    gsm, opt, crit = private(net)
    crit(gsm(x), y).backward()
    if how == "plain backward":
        nn.functional.cross_entropy(gsm(x), y).backward()
    else:
        with torch.no_grad():
            next(net.parameters()).grad.mul_(2.0)
    theta = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match="changed after the private backward"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(theta, net.parameters(), strict=True))
    opt.zero_grad()
    crit(gsm(x), y).backward()
    opt.step()
    assert not all(torch.equal(a, p) for a, p in zip(theta, net.parameters(), strict=True))


def test_an_empty_batch_is_one_path() -> None:
    """An empty batch run without a forward (a model that cannot take ``B = 0``) yields a
    ClipResult with no record from the step (``private_step.empty_batch()``), which the
    optimizer steps like any other: the step is noised and accounted. It is refused after a
    forward of the same step."""
    net = model()
    x, y = batch()
    gsm, opt, crit = private(net)
    hooked: list[int] = []
    opt.attach_step_hook(lambda o: hooked.append(1))
    for p in net.parameters():
        p.grad = torch.ones_like(p)  # stale gradients are dropped
    result = gsm.private_step.empty_batch()
    assert result.num_records == 0 and result.clip_factors.shape == (0,)
    assert result.clipped == frozenset() and all(p.grad is None for p in net.parameters())
    opt.accept_clip_result(result)
    theta = [p.detach().clone() for p in net.parameters()]
    opt.step()
    assert hooked == [1]
    assert all(not torch.equal(a, p) for a, p in zip(theta, net.parameters(), strict=True))
    opt.zero_grad()
    gsm(x)
    with pytest.raises(RuntimeError, match="empty-batch step was requested in phase"):
        gsm.private_step.empty_batch()


def test_dp_event_does_not_read_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """After construction the optimizer's event comes from what it holds: with the module's
    ``sketch_spec`` made unreadable, ``dp_event`` still gives the step's event, with the sketch
    the clip factors came from."""
    net = model()
    x, y = batch()
    gsm, opt, crit = private(net)
    spec = gsm.sketch_spec
    crit(gsm(x), y).backward()
    assert opt.last_clip_result.sketch_spec is spec

    def unreadable(self: Any) -> Any:
        raise AssertionError("dp_event read the grad-sample module")

    monkeypatch.setattr(GradSampleModuleRandomizedClipping, "sketch_spec", property(unreadable))
    event = opt.dp_event(sample_rate=0.25)
    assert event.sketch_spec == spec and event.sample_rate == 0.25
    assert event.noise_multiplier == 1.0 and event.threat_model == "revealed"  # seeded sketch


def test_a_clip_result_of_another_sketch_is_refused() -> None:
    """A loss built from one module and the optimizer of another (another sketch dimension):
    the optimizer refuses the result instead of accounting the step for a sketch that did not
    produce its clip factors, and refuses to step."""
    net = model()
    x, y = batch()
    gsm, _opt, _crit = private(net, k=16)
    other = model()
    gsm_other, opt_other, _ = private(other, k=32)
    crit = DPLossRandomizedClipping(gsm, opt_other, nn.CrossEntropyLoss(), "mean")
    with pytest.raises(RuntimeError, match="different grad-sample modules"):
        crit(gsm(x), y).backward()
    assert opt_other.last_clip_result is None
    with pytest.raises(RuntimeError, match="no clip factors were computed"):
        opt_other.step()
    gsm_other.cleanup()


def test_the_step_flags_live_in_the_private_step() -> None:
    """How a step's backward runs (checkpointed forward, smaller stash) is the private step's:
    set during the step, kept while it lasts (a reset of its records keeps it), and reset by
    the first hooked forward of the next step; the module's property reads it from there."""
    net = model()
    gsm, opt, crit = private(net)
    step = gsm.private_step
    x, y = batch()
    out = gsm(x)
    step.checkpointed = True
    step.smaller_stash = True
    assert gsm.step_smaller_stash
    step.reset()
    opt.zero_grad()
    assert step.checkpointed and gsm.step_smaller_stash
    out = gsm(x)  # the next step's first hooked forward
    assert not step.checkpointed and not gsm.step_smaller_stash
    crit(out, y).backward()  # and its private backward plans afresh
    assert not gsm.step_smaller_stash
