"""The denoiser registry behind ``make_private(denoise=...)`` (opacus_rc.denoising.registry)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc import PrivacyEngine
from opacus_rc.denoising import (
    DEFAULT_KAPPA,
    SVD_METHODS,
    SpectralDenoiser,
    denoise_matrix,
    denoiser_names,
    make_denoiser,
    register_denoiser,
)
from opacus_rc.denoising import registry as registry_module
from opacus_rc.denoising import svd as svd_module


@pytest.fixture
def restore_registry() -> Iterator[None]:
    saved = dict(registry_module._DENOISERS)
    try:
        yield
    finally:
        registry_module._DENOISERS.clear()
        registry_module._DENOISERS.update(saved)


def test_spectral_is_registered_with_the_documented_defaults() -> None:
    assert "spectral" in denoiser_names()
    default = make_denoiser("spectral")
    assert isinstance(default, SpectralDenoiser) and default.kappa == DEFAULT_KAPPA
    custom = make_denoiser("spectral", kappa=2.0, svd="randomized", min_dim=4)
    assert (custom.kappa, custom.svd, custom.min_dim) == (2.0, "randomized", 4)


@pytest.mark.parametrize(
    ("name", "error", "match"),
    [
        pytest.param("Spectral", ValueError, r"^unknown denoise 'Spectral'; allowed: 'spectral'$"),
        pytest.param(None, ValueError, r"^unknown denoise None; allowed: 'spectral'$"),
    ],
)
def test_unknown_name_lists_the_allowed_ones(name: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make_denoiser(name)


def test_duplicates_are_rejected_unless_forced(restore_registry: None) -> None:
    with pytest.raises(ValueError, match="duplicate registration for denoiser 'spectral'"):
        register_denoiser("spectral", lambda **kw: None)
    with pytest.raises(TypeError, match="non-empty str"):
        register_denoiser("", lambda **kw: None)
    with pytest.raises(TypeError, match="must be callable"):
        register_denoiser("x", 3)  # type: ignore[arg-type]
    marker = object()
    register_denoiser("spectral", lambda **kw: marker, force=True)
    assert make_denoiser("spectral") is marker


def test_engine_resolves_names_through_the_registry(restore_registry: None) -> None:
    """A newly registered denoiser is usable by name, gets kappa and options, and runs once per
    step before the accountant (the step is still accounted)."""
    calls: list[tuple[float | None, int]] = []

    class Zeroing:
        def __init__(self, *, kappa: float | None, scale: int) -> None:
            self.kappa, self.scale = kappa, scale

        def __call__(self, optimizer: Any) -> None:
            calls.append((self.kappa, len(engine.accountant)))
            for p in optimizer.params:
                p.grad.zero_()

    register_denoiser("zeroing", Zeroing)
    assert denoiser_names() == ("spectral", "zeroing")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    before = model.weight.detach().clone()
    engine = PrivacyEngine()
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    module, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        denoise="zeroing",
        denoise_kappa=1.5,
        denoise_options={"scale": 3},
    )
    assert isinstance(engine.denoiser, Zeroing) and engine.denoiser.scale == 3
    x, y = data.tensors
    nn.functional.cross_entropy(module(x[:4]), y[:4]).backward()
    optimizer.step()
    assert calls == [(1.5, 0)]  # ran before the accountant recorded the step
    assert len(engine.accountant) == 1
    assert torch.equal(model.weight, before)  # the zeroed (post-processed) gradient was used


def test_register_denoiser_is_a_decorator(restore_registry: None) -> None:
    @register_denoiser("identity")
    def make_identity(*, kappa: float | None = None) -> Any:
        return lambda optimizer: None

    assert make_identity.__name__ == "make_identity"  # returned unchanged
    assert denoiser_names() == ("identity", "spectral")
    assert callable(make_denoiser("identity"))
    with pytest.raises(ValueError, match="duplicate registration for denoiser 'identity'"):
        register_denoiser("identity")(make_identity)


@pytest.fixture
def restore_svd_backends() -> Iterator[None]:
    saved = dict(svd_module.SVD_BACKENDS)
    try:
        yield
    finally:
        svd_module.SVD_BACKENDS.clear()
        svd_module.SVD_BACKENDS.update(saved)


def test_svd_back_ends_are_resolved_by_name(restore_svd_backends: None) -> None:
    """``svd=`` names go through SVD_BACKENDS: a registered back end is the one called."""
    assert tuple(svd_module.SVD_BACKENDS) == SVD_METHODS == ("exact", "randomized")
    calls: list[tuple[int, ...]] = []

    @svd_module.register_svd_backend("counted")
    def counted(M: torch.Tensor, **options: Any) -> Any:
        calls.append(tuple(M.shape))
        return svd_module.SVD_BACKENDS["exact"](M, **options)

    G = torch.randn(30, 12, generator=torch.Generator().manual_seed(0))
    out = denoise_matrix(G, noise_std=0.05, svd="counted")
    assert calls == [(1, 12, 30)]  # batched and transposed so that rows <= columns
    assert torch.equal(out, denoise_matrix(G, noise_std=0.05, svd="exact"))
    assert make_denoiser("spectral", svd="counted").svd == "counted"
    with pytest.raises(ValueError, match="duplicate registration for SVD back end 'counted'"):
        svd_module.register_svd_backend("counted")(counted)
    with pytest.raises(TypeError, match="non-empty str"):
        svd_module.register_svd_backend("")
    with pytest.raises(
        ValueError, match=r"svd must be one of \('exact', 'randomized', 'counted'\)"
    ):
        denoise_matrix(G, noise_std=0.05, svd="lanczos")
