"""Fixtures of the benchmark tests: the repository root on ``sys.path`` (``benchmarks`` and
``tutorials`` are imported as packages from it) and one intra-op thread."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", "ignore:Full backward hook is firing")
    config.addinivalue_line("filterwarnings", "ignore:Secure RNG turned off")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
