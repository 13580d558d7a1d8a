"""Mixed precision with the DP loss and the optimizer: fp16 loss scaling (``torch.amp.GradScaler``,
Opacus #377 / PR #764; issue 20 item 7) and bf16 autocast.

``scaler.scale(loss)`` multiplies each per-sample gradient by the loss scale ``S`` before the
clip factors exist, and ``scaler.step`` skips a step whenever a gradient overflows, a decision
that is a function of the unnoised data. Both are refused with a message that names bf16
autocast; a disabled scaler (``GradScaler(enabled=False)``, the usual ``use_amp`` switch) is a
no-op and trains exactly as without it; bf16 autocast, the supported way, clips as the float64
oracle does. Runs on CPU (``GradScaler("cpu")``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc.privacy_engine import PrivacyEngine

D, H, CLASSES, B = 5, 6, 3, 4
C = 1.0  # max_grad_norm
LR = 0.5


class FlatMLP(nn.Module):
    """Rank-2 inputs only: every per-sample norm is exact, so runs compare exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)))


def make(sigma: float = 1.0, seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    model = FlatMLP()
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(16, D, generator=g) * 3, torch.randint(0, CLASSES, (16,)))
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' secure-RNG note
        module, opt, crit, _ = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=DataLoader(ds, batch_size=B),
            criterion=nn.CrossEntropyLoss(),
            noise_multiplier=sigma,
            max_grad_norm=C,
            clipping="randomized",
            sketch_dim=8,
            noise_generator=torch.Generator().manual_seed(2),
        )
    return engine, model, module, opt, crit


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(B, D, generator=g) * 3, torch.randint(0, CLASSES, (B,), generator=g)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_grad_scaler_scale_of_the_dp_loss_is_refused_naming_bf16() -> None:
    """Before: torch's bare ``ValueError: outputs must be a Tensor or an iterable of Tensors``
    (Opacus #377). After: a ``TypeError`` that says why and names bf16 autocast; nothing
    stepped or accounted."""
    engine, model, module, opt, crit = make()
    before = flat(model).clone()
    x, y = batch()
    loss = crit(module(x), y)
    with pytest.raises(TypeError, match=r"GradScaler.*bf16 autocast.*needs no scaler"):
        torch.amp.GradScaler("cpu").scale(loss)
    assert len(engine.accountant) == 0
    assert torch.equal(flat(model), before)


@pytest.mark.parametrize("explicit_unscale", [False, True], ids=["step", "unscale_-then-step"])
def test_grad_scaler_step_is_refused_before_anything_is_noised_or_accounted(
    explicit_unscale: bool,
) -> None:
    """A scaler whose scale exists (it scaled some other tensor) driving the private optimizer
    after a plain ``loss.backward()``. Before: ``scaler.step`` divided the clipped sum by
    ``S = 65536`` and stepped, accounted. After: ``RuntimeError`` naming bf16 autocast, the
    parameters and the accountant unchanged; the optimizer is left clean, so after
    ``zero_grad()`` a plain step works and is accounted once."""
    engine, model, module, opt, crit = make()
    before = flat(model).clone()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # creates the scale, as any scaled tensor would
    x, y = batch()
    crit(module(x), y).backward()
    if explicit_unscale:
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"GradScaler.*bf16 autocast"):
        scaler.step(opt)
    assert len(engine.accountant) == 0
    assert torch.equal(flat(model), before)
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    opt.zero_grad()
    crit(module(x), y).backward()
    opt.step()
    assert len(engine.accountant) == 1
    assert not torch.equal(flat(model), before)


def run_two_steps(*, scaler: torch.amp.GradScaler | None) -> tuple[torch.Tensor, int]:
    engine, model, module, opt, crit = make()
    x, y = batch()
    for _ in range(2):
        loss = crit(module(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return flat(model), len(engine.accountant)


def test_disabled_grad_scaler_trains_exactly_as_without_it() -> None:
    """``GradScaler(enabled=False)`` (the ``use_amp=False`` switch of an AMP loop) passes the
    loss and the step through: bit-identical parameters (same noise seed) and 2 accounted
    steps."""
    plain, n_plain = run_two_steps(scaler=None)
    scaled, n_scaled = run_two_steps(scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert n_plain == n_scaled == 2
    assert torch.equal(plain, scaled)


def test_bf16_autocast_step_clips_as_the_float64_oracle() -> None:
    """The supported way: one step under CPU bf16 autocast at sigma = 0 equals the float64
    one-sample-at-a-time oracle ``theta - lr * sum_i min(1, C / ||g_i||) g_i / B``. Clipping is
    active (every ||g_i|| > C, checked). Tolerance: bf16 keeps 8 significant bits (relative
    rounding 2^-9 per product); the per-sample gradients pass through ~4 such roundings, so
    2e-2 relative on each update entry, plus 1e-4 absolute for entries near zero."""
    engine, model, module, opt, crit = make(sigma=0.0)
    ref = FlatMLP().double()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    x, y = batch()
    total = [torch.zeros_like(p) for p in ref.parameters()]
    norms = []
    for i in range(B):
        loss = nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(ref.parameters()))
        norm = float(torch.sqrt(sum((g**2).sum() for g in grads)))
        norms.append(norm)
        for t, g in zip(total, grads, strict=True):
            t += min(1.0, C / norm) * g
    assert min(norms) > C  # every sample is clipped
    expected = torch.cat(
        [(p - LR * t / B).reshape(-1) for p, t in zip(ref.parameters(), total, strict=True)]
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(x)
    assert out.dtype == torch.bfloat16
    crit(out.float(), y).backward()
    opt.step()
    assert len(engine.accountant) == 1
    update = flat(model).double() - torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    expected_update = expected - torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    torch.testing.assert_close(update, expected_update, rtol=2e-2, atol=1e-4)
