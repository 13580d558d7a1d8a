"""RandomizedClipOptimizer: full steps against Opacus ghost clipping and plain training."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from torch import nn

from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.optimizers import DPLossRandomizedClipping, RandomizedClipOptimizer

pytestmark = pytest.mark.filterwarnings("ignore:a sketch_generator was passed")

B, T, D_IN, HID, CLASSES = 8, 10, 6, 8, 4


class SeqClassifier(nn.Module):
    """Token-wise MLP on (B, T, D_IN), logits averaged over T: every weight is sketched."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D_IN, HID)
        self.lin2 = nn.Linear(HID, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x))).mean(1)


def data(seed: int, batch: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, T, D_IN, generator=g), torch.randint(
        0, CLASSES, (batch,), generator=g
    )


def rc_setup(
    model: nn.Module,
    *,
    max_grad_norm: float,
    sketch_dim: int,
    noise_multiplier: float = 0.0,
    loss_reduction: str = "mean",
    lr: float = 0.5,
    expected_batch_size: int = B,
) -> tuple[Any, RandomizedClipOptimizer, DPLossRandomizedClipping]:
    gsm = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=max_grad_norm,
        sketch_dim=sketch_dim,
        loss_reduction=loss_reduction,
        sketch_generator=torch.Generator().manual_seed(123),
    )
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=lr),
        grad_sample_module=gsm,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=expected_batch_size,
        loss_reduction=loss_reduction,
        generator=torch.Generator().manual_seed(7),
    )
    crit = DPLossRandomizedClipping(
        gsm, opt, nn.CrossEntropyLoss(reduction=loss_reduction), loss_reduction
    )
    return gsm, opt, crit


def params_after_one_step(
    model: nn.Module, crit: Any, opt: Any, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    crit(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_sigma0_step_matches_opacus_ghost_clipping() -> None:
    """One sigma = 0 step with k = 4096 against Opacus' exact ghost-clipping step.

    Tolerances (docs/privacy/estimators.md#estimators-hutchinson): at k = 4096, W = n_hat^2/n^2 has
    sd <= sqrt(2/k) = 0.022, so n_hat/n has sd <= 0.011 and |n_hat_i/n_i - 1| <= 0.06 is >= 5 sd for
    each sample.
    1. The norm estimates are within 6% of Opacus' exact ghost norms (k = 1 fails this).
    2. The step applies exactly the factors min(1, C/(n_hat_i + 1e-6)) to the exact per-sample
       gradients (a microbatch loop), to float32 precision.
    3. Hence c_i g_i changes by |c_hat_i - c_i| n_i <= 0.064 min(n_i, C) per sample and the
       update differs from ghost clipping's by at most lr * 0.064 * sum_i min(n_i, C) / B,
       a bound several times smaller than the update itself.
    """
    torch.manual_seed(0)
    base = SeqClassifier()
    x, y = data(1)
    lr, C = 0.5, 0.3
    theta0 = torch.cat([p.detach().flatten() for p in base.parameters()])

    ghost_model = copy.deepcopy(base)
    ghost = GradSampleModuleFastGradientClipping(ghost_model, max_grad_norm=C)
    ghost_opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(ghost.parameters(), lr=lr),
        noise_multiplier=0.0,
        max_grad_norm=C,
        expected_batch_size=B,
    )
    ghost_crit = DPLossFastGradientClipping(ghost, ghost_opt, nn.CrossEntropyLoss())
    ghost_crit(ghost(x), y).backward()
    exact_norms = ghost.per_sample_gradient_norms.detach().double()
    ghost_opt.step()
    theta_ghost = torch.cat([p.detach().flatten() for p in ghost_model.parameters()])

    gsm, opt, crit = rc_setup(copy.deepcopy(base), max_grad_norm=C, sketch_dim=4096, lr=lr)
    crit(gsm(x), y).backward()
    n_hat = gsm.per_sample_gradient_norms.detach().double()
    opt.step()
    theta_rc = torch.cat([p.detach().flatten() for p in gsm.parameters()])

    # 1. estimates vs exact norms
    assert (exact_norms > C).sum() >= B // 2  # most samples are clipped: the scale matters
    torch.testing.assert_close(n_hat, exact_norms, rtol=0.06, atol=0)
    # 2. the update is lr * sum_i c_hat_i g_i / B with the exact per-sample gradients g_i
    per_sample = []
    for i in range(B):
        ref = copy.deepcopy(base)
        nn.CrossEntropyLoss()(ref(x[i : i + 1]), y[i : i + 1]).backward()
        per_sample.append(torch.cat([p.grad.flatten() for p in ref.parameters()]))
    c_hat = (C / (n_hat + 1e-6)).clamp(max=1.0).float()
    expected = theta0 - lr * (c_hat[:, None] * torch.stack(per_sample)).sum(0) / B
    torch.testing.assert_close(theta_rc, expected, rtol=1e-5, atol=1e-6)
    # 3. the ghost-clipping step, within the propagated bound
    bound = lr * 0.064 * exact_norms.clamp(max=C).sum().item() / B
    assert (theta_rc - theta_ghost).norm().item() <= bound
    assert (theta_ghost - theta0).norm().item() > 3 * bound


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_huge_clip_sigma0_equals_nonprivate_training(loss_reduction: str) -> None:
    """C = 1e6 and sigma = 0: every factor is 1 and the update is the plain SGD update."""
    torch.manual_seed(0)
    base = SeqClassifier()
    x, y = data(2)
    plain = copy.deepcopy(base)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.5)
    nn.CrossEntropyLoss(reduction=loss_reduction)(plain(x), y).backward()
    sgd.step()
    theta_plain = torch.cat([p.detach().flatten() for p in plain.parameters()])
    gsm, opt, crit = rc_setup(
        copy.deepcopy(base), max_grad_norm=1e6, sketch_dim=2, loss_reduction=loss_reduction
    )
    theta_rc = params_after_one_step(gsm, crit, opt, x, y)
    torch.testing.assert_close(theta_rc, theta_plain, rtol=1e-5, atol=1e-6)


def test_sketch_spec_is_the_modules_and_reaches_the_step_hook() -> None:
    gsm, opt, crit = rc_setup(SeqClassifier(), max_grad_norm=1.0, sketch_dim=16)
    assert opt.sketch_spec is gsm.sketch_spec
    seen: list[Any] = []
    opt.attach_step_hook(lambda o: seen.append(getattr(o, "sketch_spec", None)))
    for seed in range(2):
        params_after_one_step(gsm, crit, opt, *data(seed))
    assert seen == [gsm.sketch_spec, gsm.sketch_spec]
    assert seen[0].sketch_dim == 16 and seen[0].secret is False


def test_max_grad_norm_stays_in_sync() -> None:
    """C comes from one place, the optimizer: the DP loss hands it to each private backward
    (issue 31: the optimizer no longer writes into the module). Changed between a backward
    and its step, the step is refused."""
    gsm, opt, crit = rc_setup(SeqClassifier(), max_grad_norm=1.0, sketch_dim=4)
    opt.max_grad_norm = 2.5  # what an Opacus clip scheduler does
    x, y = data(0)
    crit(gsm(x), y).backward()
    result = opt.last_clip_result
    assert result.max_grad_norm == 2.5
    want = (2.5 / (result.per_sample_norms + 1e-6)).clamp(max=1.0)
    torch.testing.assert_close(result.clip_factors.double(), want, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="max_grad_norm > 0"):
        opt.max_grad_norm = 0.0
    opt.max_grad_norm = 3.0  # changed between the backward and the step
    with pytest.raises(RuntimeError, match="made at max_grad_norm=2.5 but the optimizer noises"):
        opt.step()


def test_constructor_validation() -> None:
    gsm = GradSampleModuleRandomizedClipping(SeqClassifier(), max_grad_norm=1.0)
    sgd = torch.optim.SGD(gsm.parameters(), lr=0.1)
    common = {"expected_batch_size": 4, "noise_multiplier": 1.0}
    with pytest.raises(ValueError, match="differs from the grad-sample module's max_grad_norm"):
        RandomizedClipOptimizer(sgd, grad_sample_module=gsm, max_grad_norm=2.0, **common)
    with pytest.raises(ValueError, match="loss_reduction='sum' differs"):
        RandomizedClipOptimizer(
            sgd, grad_sample_module=gsm, max_grad_norm=1.0, loss_reduction="sum", **common
        )
    with pytest.raises(TypeError, match="must be a GradSampleModuleRandomizedClipping"):
        RandomizedClipOptimizer(
            sgd, grad_sample_module=nn.Linear(2, 2), max_grad_norm=1.0, **common
        )
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number > 0, or 0"):
        RandomizedClipOptimizer(
            sgd, grad_sample_module=gsm, max_grad_norm=1.0, expected_batch_size=4,
            noise_multiplier=-1.0,
        )  # fmt: skip


def test_empty_batch_is_noised_and_counted() -> None:
    """B = 0 (an empty Poisson batch): the step adds N(0, sigma^2 C^2) noise, divides by the
    expected batch size, and calls the (accountant) step hook exactly once."""
    model = SeqClassifier()
    gsm, opt, crit = rc_setup(model, max_grad_norm=1.0, sketch_dim=4, noise_multiplier=1.0, lr=1.0)
    calls: list[int] = []
    opt.attach_step_hook(lambda o: calls.append(1))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data(0, batch=0)
    params_after_one_step(gsm, crit, opt, x, y)
    assert calls == [1]
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    # Each coordinate moved by lr * N(0, 1) / B: its sample std is about 1/B = 0.125.
    assert 0.08 < moved.std().item() < 0.17


def test_parameter_without_gradient_is_still_noised() -> None:
    class WithUnused(SeqClassifier):
        def __init__(self) -> None:
            super().__init__()
            self.unused = nn.Linear(3, 3)  # trainable, never called: no .grad

    model = WithUnused()
    gsm, opt, crit = rc_setup(model, max_grad_norm=1.0, sketch_dim=4, noise_multiplier=1.0)
    before = model.unused.weight.detach().clone()
    params_after_one_step(gsm, crit, opt, *data(0))
    assert not torch.equal(model.unused.weight, before)


def test_noise_only_step_of_an_empty_batch_is_noised_and_accounted() -> None:
    """An empty Poisson batch for a model that cannot run on B = 0 (a new-user test: the
    tutorials zeroed the gradients and called step(), which the step protocol refuses). The
    update of every coordinate is -lr * N(0, (sigma C)^2) / expected_batch_size. With
    sigma = 2, C = 3, lr = 1, B = 8 its sd is 0.75; over the n = 92 coordinates the sample sd
    has relative standard error 1 / sqrt(2 n) = 0.074, so 0.75 * (1 +- 0.37) is a 5-sigma
    band. The accountant's hook runs once; a second call, or one after a backward, refuses."""
    torch.manual_seed(0)
    model = SeqClassifier()
    gsm, opt, crit = rc_setup(model, max_grad_norm=3.0, sketch_dim=4, noise_multiplier=2.0, lr=1.0)
    calls = []
    opt.attach_step_hook(lambda o: calls.append(o.noise_multiplier))
    theta = torch.cat([p.detach().flatten() for p in model.parameters()])
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # stale gradients are dropped, not released
    opt.zero_grad(set_to_none=False)
    opt.noise_only_step()
    delta = torch.cat([p.detach().flatten() for p in model.parameters()]) - theta
    assert calls == [2.0]
    assert delta.numel() == 92
    assert 0.75 * 0.63 < float(delta.std()) < 0.75 * 1.37, float(delta.std())
    assert abs(float(delta.mean())) < 5 * 0.75 / 92**0.5
    with pytest.raises(RuntimeError, match="No step is taken and nothing is accounted"):
        opt.step()  # nothing new since the noise-only step
    x, y = data(1)
    opt.zero_grad()
    crit(gsm(x), y).backward()
    with pytest.raises(RuntimeError, match="empty-batch step was requested in phase"):
        opt.noise_only_step()  # the batch was not empty: its clipped gradients are kept
    opt.step()
    assert calls == [2.0, 2.0]
