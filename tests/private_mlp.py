"""Small MLPs made private through the engine, and the check of a refused step.

Shared by the bad-input tests of the grad-sample module (tests/grad_sample/), the optimizer and
the DP loss (tests/optimizers/) and the engine (tests/engine/); the catalogue of these cases is
tests/reliability/CATALOGUE.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc.privacy_engine import PrivacyEngine

D, H, CLASSES, T = 5, 6, 3, 4


class SeqMLP(nn.Module):
    """Token-wise MLP on (B, T, D), logits averaged over T: both weights are sketched."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x))).mean(1)


class FlatMLP(nn.Module):
    """MLP on (B, D): rank-2 inputs, so every norm is exact (no probes) and runs compare exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)))


def dataset(n: int, *, seq: bool, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, T, D) if seq else (n, D), generator=g) * 3
    return TensorDataset(x, torch.randint(0, CLASSES, (n,), generator=g))


def params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def private(
    model: nn.Module,
    *,
    engine: Any = None,
    n: int = 16,
    batch_size: int = 4,
    seq: bool = True,
    noise_multiplier: float = 1.0,
    **kwargs: Any,
) -> tuple[Any, Any, Any, Any, Any]:
    engine = PrivacyEngine() if engine is None else engine
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(dataset(n, seq=seq), batch_size=batch_size),
        noise_multiplier=noise_multiplier,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=kwargs.pop("sketch_dim", 8),
        **kwargs,
    )
    return (engine, *out)


def batch(n: int = 4, *, seq: bool = True, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ds = dataset(n, seq=seq, seed=seed)
    return ds.tensors[0].clone(), ds.tensors[1].clone()


class Scale(nn.Module):
    """A parameterised layer with no Opacus sampler (functorch fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w
