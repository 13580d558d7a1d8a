"""The core of the denoiser on one batch of equal-shape matrices (no validation, no host sync).

One SVD per batch (``docs/denoising.md#denoising-algorithm``): threshold rule as a
``torch.where``, the Frobenius-optimal shrinker, the norm correction, in float32 (float64 for
float64 input). Used by the matrix-level functions of :mod:`opacus_rc.denoising.denoiser` and by
the in-place gradient pass of :mod:`opacus_rc.denoising.gradients`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from opacus_rc.denoising.checks import _compute_dtype
from opacus_rc.denoising.options import DenoiseOptions
from opacus_rc.denoising.shrinkage import shrink_singular_values
from opacus_rc.denoising.svd import SVD_BACKENDS

__all__: list[str] = []


@dataclass(frozen=True)
class _BatchResult:
    out: Tensor  # (b, rows, cols), compute dtype, original orientation
    top: Tensor  # (b,) top singular value
    applied: Tensor  # (b,) bool, threshold rule met
    kept_rank: Tensor  # (b,) number of non-zero shrunk singular values
    svd_rank: int  # singular triplets computed (min dim for the exact SVD)


def _denoise_batch(
    G: Tensor,
    *,
    noise_std: float,
    options: DenoiseOptions,
    threshold: bool = True,
) -> _BatchResult:
    """Core of :func:`denoise_matrix` on a ``(b, rows, cols)`` tensor in compute dtype.

    ``threshold=False`` means "no threshold rule" (pure shrinkage, :func:`optimal_shrinkage`;
    ``options.kappa`` is then unused). No host synchronisation with the exact SVD: the threshold
    rule is a ``torch.where``.
    """
    transposed = G.shape[-2] > G.shape[-1]
    M = G.transpose(-2, -1) if transposed else G
    m, n = M.shape[-2], M.shape[-1]
    edge = noise_std * (math.sqrt(m) + math.sqrt(n))
    U, S, Vh, svd_rank = SVD_BACKENDS[options.svd](
        M,
        edge=edge,
        rank=options.rank,
        oversampling=options.oversampling,
        tol=options.tol,
        max_iterations=options.max_iterations,
        generator=options.generator,
    )
    shat = shrink_singular_values(S, noise_std=noise_std, m=m, n=n)
    D = (U * shat.unsqueeze(-2)) @ Vh
    top = S[..., 0]
    kept_rank = (shat > 0).sum(-1)
    # threshold=False: pure shrinkage (optimal_shrinkage), no threshold rule. Else apply only if
    # s_1 > kappa * edge (docs/denoising.md#denoising-algorithm); with kappa >= 1 that keeps s_1,
    # but if rounding zeroes it anyway the matrix is left as it is, as below the threshold (never a
    # zero gradient).
    if not threshold:
        applied = torch.ones_like(top, dtype=torch.bool)
    else:
        applied = (top > options.kappa * edge) & (kept_rank > 0)
    if options.norm_correction:
        d_norm = torch.linalg.matrix_norm(D)
        # Rows that are not applied keep the input; guard their (possibly zero) norm.
        safe = torch.where(applied & (d_norm > 0), d_norm, torch.ones_like(d_norm))
        D = D * (torch.linalg.matrix_norm(M) / safe)[..., None, None]
    D = torch.where(applied[..., None, None], D, M)
    if transposed:
        D = D.transpose(-2, -1)
    return _BatchResult(out=D, top=top, applied=applied, kept_rank=kept_rank, svd_rank=svd_rank)


def _run_on_stack(
    matrix: Tensor,
    *,
    noise_std: float,
    options: DenoiseOptions,
    threshold: bool = True,
) -> Tensor:
    if matrix.shape[-1] == 0 or matrix.shape[-2] == 0 or matrix.numel() == 0:
        return matrix.clone()
    batch_shape = matrix.shape[:-2]
    G = matrix.to(_compute_dtype(matrix.dtype)).reshape(-1, *matrix.shape[-2:])
    result = _denoise_batch(G, noise_std=noise_std, options=options, threshold=threshold)
    return result.out.reshape(*batch_shape, *matrix.shape[-2:]).to(matrix.dtype)
