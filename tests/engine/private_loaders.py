"""An MLP and its data made private through ``PrivacyEngine.make_private`` with a given data
loader: shared by the engine's tests (tests/engine/), the optimizer's check of its parameter
groups and the checkpoint tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import (
    DataLoader,
    TensorDataset,
)

from opacus_rc.privacy_engine import PrivacyEngine

D, H, CLASSES = 6, 40, 5


B = 4


SIGMA, C = 1.0, 1.0


def dataset(n: int, *, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, D, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    )


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)))


def private(
    data_loader: DataLoader,
    *,
    model: nn.Module | None = None,
    clipping: str = "randomized",
    **kwargs: Any,
) -> tuple[PrivacyEngine, tuple[Any, ...]]:
    torch.manual_seed(0)
    model = MLP() if model is None else model
    engine = PrivacyEngine()
    options: dict[str, Any] = {"noise_multiplier": SIGMA, "max_grad_norm": C, "clipping": clipping}
    if clipping == "randomized":
        options["sketch_dim"] = 8
    options.update(kwargs)
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=data_loader,
        **options,
    )
    return engine, out
