"""The names ``make_private(denoise=...)`` and ``svd=`` accept: plain tables, no registry."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from opacus_rc.denoising import (
    DEFAULT_KAPPA,
    DENOISERS,
    SVD_METHODS,
    SpectralDenoiser,
    denoise_matrix,
    make_denoiser,
)
from opacus_rc.denoising import svd as svd_module


def test_spectral_is_built_with_the_documented_defaults() -> None:
    assert DENOISERS == ("spectral",)
    default = make_denoiser("spectral")
    assert isinstance(default, SpectralDenoiser) and default.kappa == DEFAULT_KAPPA
    custom = make_denoiser("spectral", kappa=2.0, svd="randomized", min_dim=4)
    assert (custom.kappa, custom.svd, custom.min_dim) == (2.0, "randomized", 4)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        pytest.param("Spectral", r"^denoise must be one of \('spectral',\), got 'Spectral'$"),
        pytest.param(None, r"^denoise must be one of \('spectral',\), got None$"),
    ],
)
def test_unknown_name_lists_the_allowed_ones(name: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_denoiser(name)


def test_svd_names_select_their_back_end() -> None:
    """``svd=`` names are the keys of SVD_BACKENDS; each gives the SVD it names (the exact one
    equals torch.linalg.svd's reconstruction, the randomized one matches it on a matrix whose
    kept spectrum it must resolve), and an unknown name lists both."""
    assert tuple(svd_module.SVD_BACKENDS) == SVD_METHODS == ("exact", "randomized")
    gen = torch.Generator().manual_seed(0)
    planted = torch.randn(30, 3, generator=gen, dtype=torch.float64) @ torch.randn(
        3, 12, generator=gen, dtype=torch.float64
    )
    G = (5.0 * planted + 0.05 * torch.randn(30, 12, generator=gen, dtype=torch.float64)).float()
    exact = denoise_matrix(G, noise_std=0.05, svd="exact")
    randomized = denoise_matrix(
        G,
        noise_std=0.05,
        svd="randomized",
        rank=1,  # sketch width 3 < 12 rows: the randomized iteration runs, no exact fallback
        oversampling=2,
        generator=torch.Generator().manual_seed(1),
    )
    assert not torch.equal(exact, G)  # the denoiser did something
    assert not torch.equal(randomized, exact)  # a different computation ...
    torch.testing.assert_close(randomized, exact, rtol=1e-3, atol=1e-3)  # ... of the same SVD
    with pytest.raises(ValueError, match=r"svd must be one of \('exact', 'randomized'\)"):
        denoise_matrix(G, noise_std=0.05, svd="lanczos")
    with pytest.raises(ValueError, match=r"svd must be one of \('exact', 'randomized'\)"):
        make_denoiser("spectral", svd="lanczos")
