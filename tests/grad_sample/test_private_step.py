"""The private backward as one owner (issue 21, item 3): one method runs it and returns a frozen
:class:`ClipResult`, the DP loss is thin, and the optimizer's DP event is built from what it was
handed, not read from the grad-sample module.

Every test here fails on the code before the refactor: there the loss's ``backward()`` made
ten calls into the module and the optimizer (``begin_private_backward``,
``check_parameter_uses``, ``take_first_pass_inputs``, ``discard_gradients``,
``get_clipping_coef``, ``all_ranks_ok``, ``apply_clipped_sum`` ...), returned nothing, and
``dp_event`` read the sketch from the module at every step.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
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
    result = gsm.private_backward(loss.loss_per_sample, reduced_loss=reduced, peer=opt)
    assert isinstance(result, ClipResult)
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
    """The DP loss reduces, checks its arguments and calls ``module.private_backward`` once,
    then hands its result to ``optimizer.accept_clip_result``: nothing else of either is
    called (stubs with only these two methods suffice). An argument error is passed to the
    private backward, which raises it where it fails the step."""
    calls: list[tuple[str, Any]] = []
    sentinel = object()

    class Module:
        def private_backward(self, losses: Any, **kwargs: Any) -> Any:
            calls.append(("private_backward", (losses, kwargs)))
            return sentinel

    class Optimizer:
        def accept_clip_result(self, result: Any) -> None:
            calls.append(("accept_clip_result", result))

    losses = torch.tensor([1.0, 3.0], requires_grad=True)
    loss = DPTensorRandomizedClipping(Module(), Optimizer(), losses, "mean")
    loss.backward()
    assert [name for name, _ in calls] == ["private_backward", "accept_clip_result"]
    got_losses, kwargs = calls[0][1]
    assert got_losses is losses and kwargs["refused"] is None
    assert isinstance(kwargs["peer"], Optimizer)
    assert float(kwargs["reduced_loss"]) == 2.0  # the mean of the per-sample losses
    assert calls[1][1] is sentinel
    calls.clear()
    loss.backward(retain_graph=True)
    refused = calls[0][1][1]["refused"]
    assert isinstance(refused, TypeError) and "retain_graph=True" in str(refused)


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


def test_the_step_flags_live_in_the_step_state() -> None:
    """How a step's backward runs (checkpointed forward, smaller stash) is step state: set
    during the step, kept while it lasts (a forward recomputed inside its backward does not
    reset it), and reset by the first hooked forward of the next step; the module's property
    reads it from there."""
    net = model()
    gsm, opt, crit = private(net)
    step = gsm.step_state
    x, y = batch()
    out = gsm(x)
    step.mark_checkpointed()
    step.plan_backward(full_first_pass=True, smaller_stash=True)
    assert step.checkpointed and step.full_first_pass and gsm.step_smaller_stash
    gsm.discard_recorded()
    opt.zero_grad()
    assert step.checkpointed and gsm.step_smaller_stash
    out = gsm(x)  # the next step's first hooked forward
    assert not step.checkpointed and not gsm.step_smaller_stash
    crit(out, y).backward()  # and its private backward plans afresh
    assert not step.full_first_pass and not gsm.step_smaller_stash
