"""An MLP made private at sigma = 0 with clipping active, and the float64 clipped-sum oracle
(one autograd backward per sample on a float64 copy): shared by the grad-sample checks, the DP
loss, the optimizer and the accountant tests of public reports (tests/reliability/CATALOGUE.md,
"Round 3 (reports)").
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc.privacy_engine import PrivacyEngine

D, H, K, B = 5, 6, 3, 4


C = 0.5  # max_grad_norm: below every per-sample norm of these inputs, so clipping is active


SIGMA = 0.0  # no noise: the released gradient is the clipped sum (epsilon is infinite)


class MLP(nn.Module):
    """Two linear layers on (B, D) inputs: rank-2 inputs, so every norm is exact."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)))


def loader(n: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, D, generator=g) * 3, torch.randint(0, K, (n,), generator=g))
    return DataLoader(ds, batch_size=B)


def private(model: nn.Module, *, lr: float = 0.5, **kwargs: Any) -> tuple[Any, ...]:
    """``(engine, module, optimizer, criterion)`` of randomized clipping on ``model``."""
    engine = PrivacyEngine()
    args: dict[str, Any] = {
        "noise_multiplier": SIGMA,
        "max_grad_norm": C,
        "clipping": "randomized",
        "sketch_dim": 8,
    }
    args.update(kwargs)
    trainable = [p for p in model.parameters() if p.requires_grad]
    module, opt, crit, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(trainable, lr=lr), data_loader=loader(), **args
    )
    return engine, module, opt, crit


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, D, generator=g) * 3, torch.randint(0, K, (B,), generator=g)


def float64_copy(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model`` without any hook (a hooked model's copy would run the
    original's hooks): a fresh instance of its class with its state, or a deep copy (for a
    modified instance) with the hooks removed."""
    state = {k: v.detach().double() for k, v in model.state_dict().items()}
    try:
        ref = type(model)().double()
        ref.load_state_dict(state)
    except (TypeError, RuntimeError):
        ref = copy.deepcopy(model).double()
    for (_, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        r.requires_grad_(p.requires_grad)
    for m in ref.modules():
        for hooks in (
            m._forward_hooks,
            m._forward_pre_hooks,
            m._backward_hooks,
            m._backward_pre_hooks,
        ):
            hooks.clear()
    return ref


def clipped_sum_oracle(
    model: nn.Module,
    x: torch.Tensor,
    loss_of_sample: Callable[[nn.Module, int], torch.Tensor],
    *,
    c: float = C,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """float64 ``sum_i min(1, c/||g_i||) g_i`` over the trainable parameters, one autograd
    call per sample on a float64 copy without hooks; also the per-sample norms ``||g_i||``.
    This is ``p.grad`` after the private backward (the optimizer divides by the expected batch
    size at ``step()``)."""
    ref = float64_copy(model)
    named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    total = {n: torch.zeros_like(p) for n, p in named}
    norms = []
    for i in range(len(x)):
        grads = torch.autograd.grad(loss_of_sample(ref, i), [p for _, p in named])
        norm = float(torch.sqrt(sum((g**2).sum() for g in grads)))
        norms.append(norm)
        for (n, _), g in zip(named, grads, strict=True):
            total[n] += min(1.0, c / norm) * g
    return total, norms


def assert_grads_equal(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for n, p in model.named_parameters():
        if n in expected:
            torch.testing.assert_close(p.grad.double(), expected[n], rtol=1e-5, atol=1e-7)


def ce_of_sample(x: torch.Tensor, y: torch.Tensor) -> Callable[[nn.Module, int], torch.Tensor]:
    return lambda ref, i: nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1])


# --------------------------------------------------------------------------------------------
# meta-pytorch/opacus#740 (2025-03): mixed precision, "RuntimeError: expected scalar type
# BFloat16 but found Float" when activations are bf16 and backprops float32.
# --------------------------------------------------------------------------------------------


class NormMLP(nn.Module):
    """Linear, LayerNorm (Opacus' grad sampler), Linear: rank-2 inputs, exact norms."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.norm = nn.LayerNorm(H)
        self.lin2 = nn.Linear(H, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.norm(torch.tanh(self.lin1(x))))
