"""Shared fixtures for the denoising tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    """Run each test with one intra-op thread, restoring the setting afterwards.

    Small batched SVDs are 10-50x slower with 2 threads than with 1 on a shared 2-core machine
    (measured: 0.6 s against 0.036 s for 200 SVDs of 8 x 512), which would dominate the suite.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
