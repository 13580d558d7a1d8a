"""A flat MLP (rank-2 inputs, exact norms) made private through the engine, its data and a
float64 clipped-sum oracle: shared by tests of the sketch generator, the DP loss, the data loader,
the grad-sample module and the engine that replay reports from Opacus' and its peers' trackers
(tests/reliability/CATALOGUE.md, "Issue 14, peers' trackers").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc.privacy_engine import PrivacyEngine

D, H, CLASSES, T, B = 5, 6, 3, 4, 4


C = 1.0  # max_grad_norm


class FlatMLP(nn.Module):
    """MLP on (B, D): rank-2 inputs, so every norm is exact and runs compare exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)))


def data(n: int = 16, *, seq: bool = False, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, T, D) if seq else (n, D), generator=g) * 3
    return TensorDataset(x, torch.randint(0, CLASSES, (n,), generator=g))


def private(
    model: nn.Module, *, engine: Any = None, seq: bool = False, **kwargs: Any
) -> tuple[Any, ...]:
    engine = PrivacyEngine() if engine is None else engine
    args: dict[str, Any] = {
        "noise_multiplier": 1.0,
        "max_grad_norm": C,
        "clipping": "randomized",
        "sketch_dim": 8,
    }
    args.update(kwargs)
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data(seq=seq), batch_size=B),
        **args,
    )
    return (engine, *out)


def batch(*, seq: bool = False, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ds = data(B, seq=seq, seed=seed)
    return ds.tensors[0].clone(), ds.tensors[1].clone()


# --------------------------------------------------------------------------------------------
# Ten reports from the peers' trackers, 2024-2026 (CATALOGUE.md, "Issue 14, peers' trackers")
# --------------------------------------------------------------------------------------------


def train_all(module: Any, opt: Any, crit: Any, loader: Any, *, key: Any = None) -> int:
    """One pass over ``loader``; returns the number of empty batches seen."""
    empty = 0
    for batch_ in loader:
        x, y = (batch_["x"], batch_["labels"]) if key == "dict" else batch_
        empty += int(len(x) == 0)
        crit(module(x), y).backward()
        opt.step()
        opt.zero_grad()
    return empty
