"""The denoising step on the device: host reads per call, and the check before any write.

Host reads are counted on CPU, where they are free but visible: ``aten._local_scalar_dense`` (what
``.item()``, ``bool()``, ``float()`` and ``int()`` of a tensor dispatch to) with a
``TorchDispatchMode``, and ``Tensor.tolist`` / ``.cpu()`` / ``.numpy()`` with a
``TorchFunctionMode`` (``tolist`` never reaches the dispatcher on CPU; on a GPU each of these is
a device-to-host copy that waits for the stream). The counts are exact, not statistical.
"""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc import PrivacyEngine
from opacus_rc.denoising import SpectralDenoiser

SIGMA_E = 2.0 / 50  # noise_multiplier * max_grad_norm / expected_batch_size of fake_optimizer


class _LocalScalarDense(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _HostCopies(TorchFunctionMode):
    NAMES = ("tolist", "cpu", "numpy")

    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


class HostReads:
    """Context manager: ``scalar`` = ``_local_scalar_dense`` calls, ``copies`` = host copies."""

    def __enter__(self) -> HostReads:
        self._scalar, self._copies = _LocalScalarDense(), _HostCopies()
        self._scalar.__enter__()
        self._copies.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._copies.__exit__(*exc)
        self._scalar.__exit__(*exc)
        self.scalar = self._scalar.count
        self.copies = sum(self._copies.count.values())


def fake_optimizer(params: list[torch.Tensor]) -> SimpleNamespace:
    return SimpleNamespace(
        params=params,
        noise_multiplier=1.0,
        max_grad_norm=2.0,
        expected_batch_size=50,
        accumulated_iterations=1,
        loss_reduction="mean",
    )


def planted(rows: int, cols: int, seed: int, signal: bool = True) -> torch.Tensor:
    """A rank-1 signal at 3x the bulk edge (or none) plus N(0, SIGMA_E^2) noise."""
    gen = torch.Generator().manual_seed(seed)
    noise = SIGMA_E * torch.randn(rows, cols, generator=gen)
    if not signal:
        return noise
    u = torch.nn.functional.normalize(torch.randn(rows, 1, generator=gen), dim=0)
    v = torch.nn.functional.normalize(torch.randn(cols, 1, generator=gen), dim=0)
    return 3.0 * SIGMA_E * (rows**0.5 + cols**0.5) * (u @ v.T) + noise


def params_of(grads: list[torch.Tensor]) -> list[nn.Parameter]:
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


@pytest.mark.parametrize("layers", [2, 8])
def test_one_host_read_per_call_whatever_the_number_of_layers(layers: int) -> None:
    # `layers` distinct shapes (one batched SVD each) with biases; before this module was made
    # device-ready a call read the host 4 times per shape (1 bool + 3 tolist).
    grads: list[torch.Tensor] = []
    for k in range(layers):
        grads += [planted(8 + k, 24, seed=k, signal=k % 2 == 0), torch.randn(8 + k)]
    params = params_of(grads)
    # kappa = 2: the rank-1 signals (3x the edge) pass, pure noise at these sizes never does.
    denoiser = SpectralDenoiser(kappa=2.0)
    with HostReads() as call:
        denoiser(fake_optimizer(params))
    assert (call.scalar, call.copies) == (1, 0)  # the finiteness check, one reduction
    with HostReads() as first_read:
        report = denoiser.last_report
    assert (first_read.scalar, first_read.copies) == (0, 1)  # all numbers in one transfer
    with HostReads() as second_read:
        assert denoiser.last_report is report
    assert (second_read.scalar, second_read.copies) == (0, 0)
    assert [r.status for r in report.records[::2]] == [
        "denoised" if k % 2 == 0 else "below_threshold" for k in range(layers)
    ]


def test_records_map_to_their_parameters_across_interleaved_groups() -> None:
    # Shapes A, B, A, B (two groups, positions interleaved): each record's s_1 is its own
    # gradient's, checked against torch.linalg.svdvals of the input (float32 both ways).
    grads = [
        planted(12, 30, seed=0),
        planted(30, 10, seed=1, signal=False),
        planted(12, 30, seed=2, signal=False),
        planted(30, 10, seed=3),
    ]
    params = params_of(grads)
    denoiser = SpectralDenoiser()
    denoiser(fake_optimizer(params))
    report = denoiser.last_report
    for g, r in zip(grads, report.records):
        top = torch.linalg.svdvals(g)[0].item()
        assert r.top_singular_value == pytest.approx(top, rel=1e-5)
        assert r.shape == tuple(g.shape)
    assert [r.status for r in report.records] == [
        "denoised",
        "below_threshold",
        "below_threshold",
        "denoised",
    ]
    assert torch.equal(params[1].grad, grads[1]) and torch.equal(params[2].grad, grads[2])
    assert not torch.equal(params[0].grad, grads[0])


def test_non_finite_gradient_in_a_later_group_writes_nothing() -> None:
    # The first group (12 x 30, with signal) would be denoised; the second holds a nan. Before
    # this module was made device-ready, the first group was written before the second raised.
    grads = [planted(12, 30, seed=0), planted(30, 10, seed=1)]
    grads[1][2, 3] = float("nan")
    params = params_of(grads)
    denoiser = SpectralDenoiser()
    with pytest.raises(ValueError, match=r"index\(es\) \[1\] of shape \(30, 10\)"):
        denoiser(fake_optimizer(params))
    assert torch.equal(params[0].grad, grads[0])
    assert denoiser.last_report is None


def _denoised_step_reads(denoise: str | None) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 32), nn.ReLU())
    model.append(nn.Linear(32, 4))
    data = TensorDataset(torch.randn(16, 16), torch.randint(0, 4, (16,)))
    module, optimizer, _ = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=16),
        noise_multiplier=0.3,
        max_grad_norm=1.0,
        denoise=denoise,
        noise_generator=torch.Generator().manual_seed(1),
    )
    x, y = data.tensors
    nn.functional.cross_entropy(module(x), y).backward()
    with HostReads() as reads:
        optimizer.step()
    return reads.scalar + reads.copies


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_a_denoised_training_step_adds_one_host_read() -> None:
    # Three Linear layers of three shapes: one read more than the same step without denoising
    # (before: 12 more, 4 per shape).
    assert _denoised_step_reads("spectral") - _denoised_step_reads(None) == 1
