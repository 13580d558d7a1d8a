"""attach_post_processing_hook on RandomizedClipOptimizer and on plain Opacus optimizers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.optimizers import (
    DPLossRandomizedClipping,
    RandomizedClipOptimizer,
    attach_post_processing_hook,
)


def rc_parts(sigma: float = 0.0) -> tuple[nn.Module, Any, RandomizedClipOptimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1e6, sketch_dim=4)
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=1.0),
        grad_sample_module=gsm,
        noise_multiplier=sigma,
        max_grad_norm=1e6,
        expected_batch_size=8,
    )
    crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss(), "mean")
    return model, gsm, opt, crit


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)


def test_runs_after_noise_and_scaling_before_accountant() -> None:
    """sigma = 0, 4 samples, expected batch size 8: at hook time p.grad must already be the
    clipped sum divided by 8 (scale_grad done), and the accountant hook must come after."""
    model, gsm, opt, crit = rc_parts()
    order: list[str] = []
    grads_at_hook: list[torch.Tensor] = []
    opt.attach_step_hook(lambda o: order.append("accountant"))

    def post(o: Any) -> None:
        order.append("post")
        grads_at_hook.append(model[0].weight.grad.clone())

    attach_post_processing_hook(opt, post)
    x, y = batch()
    ref = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    ref.load_state_dict(model.state_dict())
    (nn.CrossEntropyLoss(reduction="sum")(ref(x), y) / 8).backward()
    crit(gsm(x), y).backward()
    opt.step()
    assert order == ["post", "accountant"]
    torch.testing.assert_close(grads_at_hook[0], ref[0].weight.grad, rtol=1e-5, atol=1e-7)


def test_hook_output_is_what_the_optimizer_applies_and_remove() -> None:
    model, gsm, opt, crit = rc_parts(sigma=1.0)

    def zero_all(o: Any) -> None:
        for p in o.params:
            p.grad.zero_()

    handle = attach_post_processing_hook(opt, zero_all)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch()
    crit(gsm(x), y).backward()
    opt.step()
    opt.zero_grad()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    handle.remove()
    handle.remove()  # idempotent
    crit(gsm(x), y).backward()
    opt.step()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_chain_survives_a_later_accountant_hook_on_rc_optimizer() -> None:
    model, gsm, opt, crit = rc_parts()
    order: list[str] = []
    attach_post_processing_hook(opt, lambda o: order.append("post"))
    opt.attach_step_hook(lambda o: order.append("accountant"))
    x, y = batch()
    crit(gsm(x), y).backward()
    opt.step()
    assert order == ["post", "accountant"]


def test_works_with_plain_opacus_dp_optimizer() -> None:
    torch.manual_seed(0)
    model = GradSampleModule(nn.Linear(4, 3))
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
    )
    with pytest.warns(UserWarning, match="no step hook yet"):
        attach_post_processing_hook(opt, lambda o: None)
    order: list[str] = []
    opt2 = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
    )
    opt2.attach_step_hook(lambda o: order.append("accountant"))
    attach_post_processing_hook(opt2, lambda o: order.append("post1"))
    attach_post_processing_hook(opt2, lambda o: order.append("post2"))
    x, y = batch()
    nn.CrossEntropyLoss()(model(x), y).backward()
    opt2.step()
    assert order == ["post1", "post2", "accountant"]


def test_rejects_bad_arguments() -> None:
    _, _, opt, _ = rc_parts()
    with pytest.raises(TypeError, match="hook must be callable"):
        attach_post_processing_hook(opt, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="has no step_hook"):
        attach_post_processing_hook(torch.optim.SGD([nn.Parameter(torch.zeros(1))]), print)


@pytest.mark.filterwarnings("ignore:a sketch_generator was passed")
def test_post_processing_refused_on_opacus_ddp_optimizers() -> None:
    """Opacus' DDP optimizers call step hooks before their all-reduce, where ranks > 0 hold an
    un-noised partial sum: a post-processing hook (the spectral denoiser) there would not be
    post-processing. attach_post_processing_hook refuses them; the randomized-clipping DDP
    optimizer reduces first (tests/distributed, scenario noise_once)."""
    from opacus.optimizers import DistributedDPOptimizer, DistributedDPOptimizerFastGradientClipping

    from opacus_rc.optimizers import attach_post_processing_hook

    for cls in (DistributedDPOptimizer, DistributedDPOptimizerFastGradientClipping):
        opt = object.__new__(cls)  # no process group here; only the type matters
        opt.step_hook = None
        with pytest.raises(ValueError, match="before its gradient all-reduce"):
            attach_post_processing_hook(opt, lambda o: None)
