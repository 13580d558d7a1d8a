"""DenoiseOptions: the nine denoiser options built and checked in one place."""

from __future__ import annotations

import pytest
import torch

from opacus_rc.denoising import (
    DEFAULT_KAPPA,
    DenoiseOptions,
    SpectralDenoiser,
    denoise_matrix,
    make_denoiser,
)


def test_defaults_and_names() -> None:
    opts = DenoiseOptions()
    assert opts.kappa == DEFAULT_KAPPA and opts.svd == "exact" and opts.generator is None
    assert DenoiseOptions.names() == (
        "kappa",
        "norm_correction",
        "min_dim",
        "svd",
        "rank",
        "oversampling",
        "tol",
        "max_iterations",
        "generator",
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kappa": 0.9}, ValueError, "kappa must be >= 1"),
        ({"svd": "truncated"}, ValueError, "svd must be one of"),
        ({"min_dim": 0}, ValueError, "min_dim must be >= 1"),
        ({"rank": 1.5}, TypeError, "rank must be an int"),
        ({"oversampling": -1}, ValueError, "oversampling must be >= 0"),
        ({"tol": 1.0}, ValueError, r"tol must be in \(0, 1\)"),
        ({"max_iterations": -1}, ValueError, "max_iterations must be >= 0"),
    ],
)
def test_every_entry_point_refuses_a_bad_option_alike(kwargs, error, match) -> None:
    # The record, the denoiser, the registry factory and the matrix function share one check.
    with pytest.raises(error, match=match):
        DenoiseOptions(**kwargs)
    with pytest.raises(error, match=match):
        SpectralDenoiser(**kwargs)
    with pytest.raises(error, match=match):
        make_denoiser("spectral", **kwargs)
    if "min_dim" not in kwargs:
        with pytest.raises(error, match=match):
            denoise_matrix(torch.zeros(3, 4), noise_std=1.0, **kwargs)


def test_the_denoiser_reads_its_options_from_the_record() -> None:
    d = SpectralDenoiser(kappa=2, svd="randomized", min_dim=4, norm_correction=0)
    assert d.options == DenoiseOptions(
        kappa=2.0, svd="randomized", min_dim=4, norm_correction=False
    )
    assert d.options.norm_correction is False and d.options.kappa == 2.0
    assert (d.kappa, d.svd, d.min_dim, d.norm_correction) == (2.0, "randomized", 4, False)
    again = SpectralDenoiser.from_options(d.options)
    assert again.options == d.options
    with pytest.raises(TypeError, match="options must be a DenoiseOptions"):
        SpectralDenoiser.from_options({"kappa": 2.0})
    with pytest.raises(AttributeError, match="no attribute 'kapa'"):
        _ = d.kapa


def test_records_are_immutable() -> None:
    with pytest.raises(AttributeError):
        DenoiseOptions().kappa = 3.0  # type: ignore[misc]
