r"""The spectral denoiser of noisy gradient matrices: threshold test, shrinkage, norm correction.

Method: Dadsetan and Rudzicz, "Re-examining Low Rank adaptation for private LLM fine-tuning",
arXiv:2510.01137 (v3); the shrinker (:mod:`opacus_rc.denoising.shrinkage`) is Gavish and
Donoho's for Frobenius loss. The math, the noise level, the threshold rule and the test oracle
are in ``docs/denoising.md#denoising``.

Model (docs/denoising.md#denoising-noise-level). A released 2-D gradient is

.. math::  \tilde G = \bar G + E, \qquad E_{ab} \overset{iid}{\sim} \mathcal N(0, \sigma_e^2),

with :math:`\bar G` the (clipped, averaged) gradient; :math:`\sigma_e` of an Opacus optimizer is
:func:`~opacus_rc.denoising.noise_std_from_optimizer`.

Per matrix (docs/denoising.md#denoising-algorithm), with ``m <= n`` its dimensions and ``s_1 >= s_2
>= ...`` its singular values:

1. threshold rule: if :math:`s_1 \le \kappa \sigma_e(\sqrt m + \sqrt n)` leave the matrix as it is;
2. shrink every singular value with the Frobenius-optimal shrinker
   (:func:`~opacus_rc.denoising.shrink_singular_values`);
3. norm correction: rescale the result to the Frobenius norm of the noisy matrix.

Contract: the denoiser is **post-processing**. Its output is a deterministic function (or, with
``svd="randomized"``, a function plus data-independent randomness) of the released noisy gradient
and of public constants (noise level, kappa, shapes). It reads no per-sample quantity, so the
privacy accountant is unchanged (docs/denoising.md#denoising-post-processing).

The threshold decision is a tensor (``torch.where``), not a host branch: denoising a set of
gradients reads the device once, for the finiteness check
(:func:`~opacus_rc.denoising.gradients._denoise_gradients_`); the
records of what was done are read only when asked for
(:class:`~opacus_rc.denoising.records._PendingReport`). Nothing here
imports Opacus; :mod:`opacus_rc.denoising.opacus_adapter` reads the optimizer.

Modules, one concept each: this one holds the defaults and the matrix-level functions
(:func:`denoise_matrix`, :func:`optimal_shrinkage`); :mod:`~opacus_rc.denoising.checks` their
argument checks; :mod:`~opacus_rc.denoising.batch` the batched core;
:mod:`~opacus_rc.denoising.records` the records and reports (re-exported here);
:mod:`~opacus_rc.denoising.gradients` the in-place pass over a list of gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from opacus_rc.denoising.batch import _run_on_stack
from opacus_rc.denoising.checks import _check_matrix
from opacus_rc.denoising.options import DEFAULT_KAPPA, DEFAULT_MIN_DIM, DenoiseOptions
from opacus_rc.denoising.records import DenoiseRecord, DenoiseReport
from opacus_rc.denoising.shrinkage import _check_noise_std
from opacus_rc.denoising.svd import (
    DEFAULT_MAX_ITERATIONS,
    DEFAULT_OVERSAMPLING,
    DEFAULT_RANK,
    DEFAULT_TOL,
)

__all__ = [
    "DEFAULT_KAPPA",
    "DEFAULT_MIN_DIM",
    "DenoiseRecord",
    "DenoiseReport",
    "denoise_matrix",
    "optimal_shrinkage",
]


def optimal_shrinkage(matrix: Tensor, *, noise_std: float) -> Tensor:
    r"""Shrink every singular value of ``matrix`` with the Frobenius-optimal shrinker.

    :math:`\hat X = \sum_a \hat s_a u_a v_a^\top` with :math:`\hat s_a` from
    :func:`~opacus_rc.denoising.shrink_singular_values` (Gavish and Donoho 2017;
    docs/denoising.md#denoising-shrinker). No threshold rule and no norm correction: this is the
    "shrunk" column of the docs/denoising.md#denoising-oracle table, the asymptotically MSE-optimal
    estimate of a low-rank signal in white noise. Computed with an exact SVD in float32 (float64 for
    float64 input), returned in the input dtype.

    Args:
        matrix: Noisy matrix, shape ``(..., m, n)``, any aspect ratio; leading dimensions are a
            batch of independent matrices.
        noise_std: :math:`\sigma_e`, the standard deviation of each noise entry.

    Returns:
        Tensor of the shape and dtype of ``matrix``; zero where no singular value exceeds the bulk
        edge :math:`\sigma_e(\sqrt m + \sqrt n)`.

    Raises:
        TypeError: if ``matrix`` is not a floating-point tensor.
        ValueError: if ``matrix`` has fewer than 2 dimensions or non-finite entries, or
            ``noise_std`` is negative or non-finite.
    """
    _check_matrix(matrix)
    sigma = _check_noise_std(noise_std)
    options = DenoiseOptions(norm_correction=False)  # exact SVD; threshold rule off below
    return _run_on_stack(matrix, noise_std=sigma, options=options, threshold=False)


def denoise_matrix(
    matrix: Tensor,
    *,
    noise_std: float,
    kappa: float = DEFAULT_KAPPA,
    norm_correction: bool = True,
    svd: str = "exact",
    rank: int = DEFAULT_RANK,
    oversampling: int = DEFAULT_OVERSAMPLING,
    tol: float = DEFAULT_TOL,
    max_iterations: int = DEFAULT_MAX_ITERATIONS,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""Spectral denoising of one noisy gradient matrix (or a batch of equal shapes).

    docs/denoising.md#denoising-algorithm, per matrix ``M`` (``m <= n`` after an internal
    transpose):

    1. if :math:`s_1 \le \kappa\,\sigma_e(\sqrt m + \sqrt n)`, return ``M`` unchanged;
    2. :math:`D = \sum_a \hat s_a u_a v_a^\top`
       (:func:`~opacus_rc.denoising.shrink_singular_values`);
    3. if ``norm_correction``, :math:`D \leftarrow D\,\|M\|_F / \|D\|_F`. This keeps the noisy
       norm, so the Frobenius error grows while the direction improves
       (docs/denoising.md#denoising-algorithm, docs/denoising.md#denoising-oracle); it is intended.

    Since :math:`\kappa \ge 1`, step 2 keeps at least the top singular value, so ``D`` is never
    zero when applied. The result is equivariant under transposition and homogeneous:
    ``denoise(c*M, noise_std=c*s) == c*denoise(M, noise_std=s)`` for ``c > 0``.

    Args:
        matrix: Noisy matrix, shape ``(..., m, n)``; leading dimensions are a batch of
            independent matrices, each with its own threshold decision.
        noise_std: :math:`\sigma_e`, the standard deviation of each noise entry (for a DP
            optimizer see :func:`~opacus_rc.denoising.noise_std_from_optimizer`).
        kappa: Threshold factor, ``>= 1``. Default :data:`DEFAULT_KAPPA`
            (docs/denoising.md#denoising-oracle).
        norm_correction: Rescale to the noisy Frobenius norm. Default ``True``
            (docs/denoising.md#denoising-algorithm, the paper's step C).
        svd: A name in :data:`~opacus_rc.denoising.svd.SVD_BACKENDS`: ``"exact"``
            (``torch.linalg.svd``) or ``"randomized"`` (truncated randomized subspace iteration,
            Halko et al. 2011: the rank doubles from ``rank`` until the ``rank``-th computed
            singular value is at most the bulk edge, so every singular value that survives
            shrinkage is computed, each to relative residual ``tol``; exact SVD when the sketch
            would be as wide as the matrix or ``max_iterations`` is reached).
        rank: Starting rank of the randomized SVD. Default
            :data:`~opacus_rc.denoising.svd.DEFAULT_RANK`.
        oversampling: Extra sketch columns of the randomized SVD. Default
            :data:`~opacus_rc.denoising.svd.DEFAULT_OVERSAMPLING` (Halko et al. 2011, section
            4.2).
        tol: Relative residual tolerance of the randomized SVD. Default
            :data:`~opacus_rc.denoising.svd.DEFAULT_TOL`.
        max_iterations: Power iterations of the randomized SVD before it falls back to the
            exact SVD. Default :data:`~opacus_rc.denoising.svd.DEFAULT_MAX_ITERATIONS`.
        generator: Source of the randomized SVD's Gaussian test matrix (data-independent, so the
            result is still post-processing). ``None`` uses torch's global generator.

    Returns:
        Tensor of the shape and dtype of ``matrix``. Computed in float32 (float64 for float64
        input) and cast back.

    Raises:
        TypeError: if ``matrix`` is not a floating-point tensor.
        ValueError: if ``matrix`` has fewer than 2 dimensions or non-finite entries;
            ``noise_std`` is negative or non-finite; ``kappa < 1`` (the bulk edge, see
            :data:`DEFAULT_KAPPA`); ``svd`` is not in :data:`~opacus_rc.denoising.SVD_METHODS`;
            ``rank < 1``; ``oversampling < 0``; ``tol`` not in ``(0, 1)``; ``max_iterations < 0``.
    """
    _check_matrix(matrix)
    sigma = _check_noise_std(noise_std)
    options = DenoiseOptions(
        kappa=kappa,
        norm_correction=norm_correction,
        svd=svd,
        rank=rank,
        oversampling=oversampling,
        tol=tol,
        max_iterations=max_iterations,
        generator=generator,
    )
    return _run_on_stack(matrix, noise_std=sigma, options=options)
