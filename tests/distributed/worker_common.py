"""What the 2-rank workers (ddp_worker.py, fsdp_worker.py) share: sizes, models, data, helpers.

The workers run as scripts (``python tests/distributed/<worker>.py OUT.json``), so this module
is imported from the script's folder (first on ``sys.path``, inherited by spawned ranks).
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
from torch import nn

WORLD = 2
D, CLASSES, T = 5, 3, 4
B = 8  # global batch; each rank gets B / WORLD rows


class FlatMLP(nn.Module):
    """Rank-2 inputs: exact norms, so a distributed run and one process compare exactly."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, hidden)
        self.lin2 = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)))


class SeqMLP(FlatMLP):
    """Rank-3 inputs: sketched norms."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).mean(1)


def global_batch(seq: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch ``(B, T, D)`` or ``(B, D)`` and its labels, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn((B, T, D) if seq else (B, D), generator=g)
    return x, torch.randint(0, CLASSES, (B,), generator=g)


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` of every rank (all-gather)."""
    out = [torch.zeros_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t.contiguous())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
