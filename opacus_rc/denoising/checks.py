"""Checks of the denoiser's arguments: the threshold factor and the noisy matrix.

The noise level and integer options are checked in :mod:`opacus_rc.denoising.shrinkage`, the
SVD options in :mod:`opacus_rc.denoising.svd`. Every check raises before any gradient is read
for denoising or written.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__: list[str] = []


def _check_kappa(kappa: float) -> float:
    value = float(kappa)
    if math.isnan(value) or value < 1.0:
        raise ValueError(
            f"kappa must be >= 1, got {kappa}. kappa = 1 puts the threshold at the bulk edge "
            "sigma_e*(sqrt(m)+sqrt(n)), the largest singular value of pure noise; below it a "
            "pure-noise matrix would be 'denoised', and the Frobenius-optimal shrinker maps every "
            "singular value inside the bulk to 0 (docs/denoising.md#denoising-algorithm)"
        )
    return value


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precision and float32 inputs, float64 for float64 (never lower)."""
    if not dtype.is_floating_point:
        raise TypeError(f"expected a floating-point matrix, got dtype {dtype}")
    return torch.promote_types(dtype, torch.float32)


def _check_matrix(matrix: Tensor, name: str = "matrix") -> None:
    if not isinstance(matrix, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(matrix).__name__}")
    if matrix.dim() < 2:
        raise ValueError(f"{name} must have shape (..., m, n), got shape {tuple(matrix.shape)}")
    _compute_dtype(matrix.dtype)
    if not bool(torch.isfinite(matrix).all()):
        raise ValueError(
            f"{name} of shape {tuple(matrix.shape)} has non-finite entries (nan or inf); "
            "spectral denoising needs a finite noisy gradient (check the learning rate, loss "
            "scaling or mixed-precision overflow)"
        )
