r"""Per-step spectral denoising of noisy DP gradients by optimal singular-value shrinkage.

Method: Dadsetan and Rudzicz, "Re-examining Low Rank adaptation for private LLM fine-tuning",
arXiv:2510.01137 (v3). Shrinker: Gavish and Donoho, "Optimal Shrinkage of Singular Values",
IEEE Trans. Inf. Theory 63(4):2137-2152, 2017 (arXiv:1405.7511), Frobenius (MSE) loss. The math,
the noise level, the threshold rule and the test oracle are in ``THEORY.md`` section E.

Model (THEORY.md E.1). After Opacus' ``add_noise`` and ``scale_grad``, the gradient of every 2-D
parameter is

.. math::  \tilde G = \bar G + E, \qquad E_{ab} \overset{iid}{\sim} \mathcal N(0, \sigma_e^2),

with :math:`\bar G` the (clipped, averaged) gradient and
:math:`\sigma_e = \sigma C / (B_{exp} \cdot A)` for ``loss_reduction="mean"`` (``B_exp`` the
*expected* batch size, ``A`` the accumulated iterations) or :math:`\sigma_e = \sigma C` for
``"sum"``.

Per matrix (THEORY.md E.3), with ``m <= n`` its dimensions and ``s_1 >= s_2 >= ...`` its singular
values:

1. threshold rule: if :math:`s_1 \le \kappa \sigma_e(\sqrt m + \sqrt n)` leave the matrix as it is;
2. shrink every singular value with the Frobenius-optimal shrinker (:func:`shrink_singular_values`);
3. norm correction: rescale the result to the Frobenius norm of the noisy matrix.

Contract: the denoiser is **post-processing**. Its output is a deterministic function (or, with
``svd="randomized"``, a function plus data-independent randomness) of the released noisy gradient
and of public constants (noise multiplier, clipping norm, expected batch size, accumulated
iterations, loss reduction, kappa, shapes). It reads no per-sample quantity, no realised batch
size and no clean-gradient statistic, so the privacy accountant is unchanged (THEORY.md E.4).

The pure functions here (:func:`frobenius_shrinker`, :func:`shrink_singular_values`,
:func:`optimal_shrinkage`, :func:`denoise_matrix`) import nothing from Opacus;
:class:`SpectralDenoiser` reads the public attributes of an Opacus ``DPOptimizer`` by name.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_KAPPA",
    "DEFAULT_MIN_DIM",
    "SVD_METHODS",
    "DenoiseRecord",
    "DenoiseReport",
    "SpectralDenoiser",
    "denoise_matrix",
    "frobenius_shrinker",
    "noise_std_from_optimizer",
    "optimal_shrinkage",
    "shrink_singular_values",
]

logger = logging.getLogger(__name__)

#: Default threshold factor kappa. Source: THEORY.md E.5, whose pure-noise control uses
#: kappa = 1.05. Why not kappa = 1 [num, checked here with torch.randn, 2000 draws per shape]:
#: for pure Gaussian noise s_1 / (sigma_e (sqrt(m) + sqrt(n))) exceeds 1 in 5-16% of draws at
#: shapes (2..768, 256..1024) (finite-size Tracy-Widom fluctuations above the bulk edge), but never
#: exceeded 1.05 (maximum 1.046) once the larger dimension is >= 256. At a larger dimension of 64
#: or less, 1.6-5% of pure-noise draws still pass 1.05 (raise kappa or min_dim there).
DEFAULT_KAPPA = 1.05

#: Default smallest dimension of a matrix the denoiser touches. Source: with norm correction, a
#: matrix with one row or column (one singular value) is mapped to itself, so ``min_dim = 2`` is
#: the smallest size at which the operation is not the identity; skipping smaller matrices is exact.
DEFAULT_MIN_DIM = 2

#: Accepted values of the ``svd`` argument, in the order they are documented.
SVD_METHODS = ("exact", "randomized")

#: Default starting rank of the randomized SVD. Not from a paper: the rank doubles until the stopping
#: rule of THEORY.md E.3 holds, so this value affects cost, not the result.
DEFAULT_RANK = 16

#: Default oversampling of the randomized range finder. Source: Halko, Martinsson and Tropp 2011,
#: "Finding structure with randomness", SIAM Rev. 53(2), section 4.2 (p = 10 suggested), also the
#: default ``n_oversamples`` of scikit-learn's ``randomized_svd``.
DEFAULT_OVERSAMPLING = 10

#: Default relative residual tolerance of the randomized SVD: every kept singular triplet satisfies
#: ||M v - s u|| <= tol * s. Source [num, THEORY.md E.5 planted matrix, float32 and float64]: the
#: relative Frobenius distance between the randomized and the exact denoised matrix is about tol/2
#: (4.3e-5 at tol = 1e-4), three to four orders below the denoising error itself (0.48); tol = 1e-6
#: is still reachable in float32 there.
DEFAULT_TOL = 1e-4

#: Default cap on power iterations of the randomized SVD before it falls back to the exact SVD.
#: Source [num, CPU, float32, one thread, sketch width 26]: 32 iterations took 0.064 s against
#: 0.044 s for the exact SVD of a 256 x 1024 matrix, and 0.37 s against 0.82 s at 768 x 3072; an
#: iteration costs O(m*n*w) and the exact SVD O(m^2*n), so past this cap exact is as cheap for
#: matrices with a few hundred rows.
DEFAULT_MAX_ITERATIONS = 32


# ------------------------------------------------------------------------------------------------
# Validators


def _check_noise_std(noise_std: float) -> float:
    try:
        value = float(noise_std)
    except (TypeError, ValueError) as err:
        raise TypeError(f"noise_std must be a real number, got {type(noise_std).__name__}") from err
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"noise_std must be finite and >= 0, got {noise_std}")
    return value


def _check_kappa(kappa: float) -> float:
    value = float(kappa)
    if math.isnan(value) or value < 1.0:
        raise ValueError(
            f"kappa must be >= 1, got {kappa}. kappa = 1 puts the threshold at the bulk edge "
            "sigma_e*(sqrt(m)+sqrt(n)), the largest singular value of pure noise; below it a "
            "pure-noise matrix would be 'denoised', and the Frobenius-optimal shrinker maps every "
            "singular value inside the bulk to 0 (THEORY.md E.2-E.3)"
        )
    return value


def _check_positive_int(value: int, name: str, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_tol(tol: float) -> float:
    value = float(tol)
    if not 0.0 < value < 1.0:
        raise ValueError(f"tol must be in (0, 1), got {tol}")
    return value


def _check_svd(svd: str) -> str:
    if svd not in SVD_METHODS:
        raise ValueError(f"svd must be one of {SVD_METHODS}, got {svd!r}")
    return svd


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precision and float32 inputs, float64 for float64 (never lower)."""
    if not dtype.is_floating_point:
        raise TypeError(f"expected a floating-point matrix, got dtype {dtype}")
    return torch.promote_types(dtype, torch.float32)


# ------------------------------------------------------------------------------------------------
# The shrinker


def frobenius_shrinker(y: Tensor | float, *, beta: float) -> Tensor:
    r"""Gavish-Donoho Frobenius-optimal shrinker in normalised units, :math:`\eta^*(y; \beta)`.

    .. math::
        \eta^*(y) = \frac{\sqrt{(y^2 - \beta - 1)^2 - 4\beta}}{y}
                  = \frac{\sqrt{(y^2 - (1+\sqrt\beta)^2)(y^2 - (1-\sqrt\beta)^2)}}{y}
        \quad \text{if } y > 1 + \sqrt\beta, \text{ else } 0.

    Source: Gavish and Donoho 2017, the optimal shrinker for Frobenius loss; THEORY.md E.2. The
    factored form (used here) avoids the cancellation of the expanded one near the edge. In the
    spiked model, :math:`\eta^*(y(x)) = x\,c(x)\,\tilde c(x)` (THEORY.md E.2), which the tests use
    as an independent check.

    Args:
        y: Observed singular values in units of :math:`\sigma_e\sqrt n` (``n`` the larger
            dimension); any shape. A Python float becomes a float64 scalar tensor.
        beta: Aspect ratio ``m / n`` in ``(0, 1]``.

    Returns:
        Tensor of the shape and dtype of ``y`` (float64 for a Python float): the shrunk values in
        the same units; exactly 0 at or below the bulk edge :math:`1 + \sqrt\beta`.

    Raises:
        ValueError: if ``beta`` is not in ``(0, 1]`` or ``y`` has a negative or non-finite entry.
    """
    if not 0.0 < float(beta) <= 1.0:
        raise ValueError(f"beta must be in (0, 1], got {beta}")
    y_t = torch.as_tensor(y, dtype=torch.float64) if not isinstance(y, Tensor) else y
    if not bool(torch.isfinite(y_t).all()) or bool((y_t < 0).any()):
        raise ValueError("y must be finite and >= 0 (singular values in units of sigma_e*sqrt(n))")
    root_beta = math.sqrt(beta)
    upper, lower = (1.0 + root_beta) ** 2, (1.0 - root_beta) ** 2
    y2 = y_t * y_t
    above = y_t > 1.0 + root_beta
    safe_y = torch.where(above, y_t, torch.ones_like(y_t))
    value = torch.sqrt(((y2 - upper) * (y2 - lower)).clamp(min=0)) / safe_y
    return torch.where(above, value, torch.zeros_like(value))


def shrink_singular_values(s: Tensor, *, noise_std: float, m: int, n: int) -> Tensor:
    r"""Frobenius-optimal shrinkage of the singular values of an ``m x n`` noisy matrix.

    Raw units (THEORY.md E.2), with :math:`\sigma = \sigma_e` the noise entry standard deviation:

    .. math::
        \hat s = \frac{\sqrt{\big(s^2 - \sigma^2(\sqrt m + \sqrt n)^2\big)
                             \big(s^2 - \sigma^2(\sqrt n - \sqrt m)^2\big)}}{s}
        \quad \text{if } s > \sigma(\sqrt m + \sqrt n), \text{ else } 0,

    which equals :math:`\sigma\sqrt{n}\,\eta^*(s / (\sigma\sqrt n); m/n)` for ``m <= n``
    (Gavish and Donoho 2017, Frobenius loss) and is symmetric in ``(m, n)``. With
    ``noise_std = 0`` it is the identity.

    Args:
        s: Singular values, shape ``(..., k)`` with ``k <= min(m, n)``; non-negative.
        noise_std: :math:`\sigma_e`, the standard deviation of each noise entry (units of the
            matrix entries).
        m: Number of rows of the matrix the values come from.
        n: Number of columns (the order of ``m`` and ``n`` does not matter).

    Returns:
        Tensor of the shape and dtype of ``s``: the shrunk singular values (same units).

    Raises:
        ValueError: if ``noise_std`` is negative or non-finite, or ``m`` or ``n`` is < 1.
    """
    sigma = _check_noise_std(noise_std)
    _check_positive_int(m, "m")
    _check_positive_int(n, "n")
    edge = sigma * (math.sqrt(m) + math.sqrt(n))
    inner = sigma * abs(math.sqrt(n) - math.sqrt(m))
    s2 = s * s
    above = s > edge
    safe_s = torch.where(above, s, torch.ones_like(s))
    value = torch.sqrt(((s2 - edge**2) * (s2 - inner**2)).clamp(min=0)) / safe_s
    return torch.where(above, value, torch.zeros_like(value))


# ------------------------------------------------------------------------------------------------
# SVD back ends (inputs already oriented so that rows <= columns)


def _exact_svd(M: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.linalg.svd(M, full_matrices=False)


def _randomized_svd(
    M: Tensor,
    *,
    edge: float,
    rank: int,
    oversampling: int,
    tol: float,
    max_iterations: int,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor, Tensor, int]:
    r"""Truncated SVD of a ``(b, m, n)`` batch (``m <= n``), exact where shrinkage keeps values.

    Randomized subspace iteration with Rayleigh-Ritz extraction (Halko, Martinsson and Tropp
    2011, Algorithms 4.4 and 5.1), sketch width ``w = r + oversampling``:

    * ``Q = orth(M Omega)``, ``Omega`` an ``n x w`` Gaussian test matrix (data-independent);
    * repeat: ``Q^T M = U_b S V_h`` (small SVD), ``U = Q U_b``, ``W = M V_h^T``; the residual of
      triplet ``j`` is :math:`\|M v_j - s_j u_j\| = \|W_{:,j} - s_j u_j\|` (the other residual,
      :math:`M^\top u_j - s_j v_j`, is exactly 0); then ``Q = orth(W)``, which is one power
      iteration ``Q <- orth(M M^T Q)`` reusing ``W``.

    Stopping rules:

    * rank (THEORY.md E.3): only singular values above the bulk edge survive shrinkage, so the
      ``r``-th computed value must be ``<= edge`` for every matrix; Ritz values are lower bounds
      of the true ones, so a value above the edge proves that ``r`` is too small: ``r`` doubles
      and the iteration restarts;
    * accuracy: every kept triplet (``s_j > edge``) has residual ``<= tol * s_j`` (the relative
      residual test of ARPACK, as used by ``scipy.sparse.linalg.svds``), i.e. it is an exact
      triplet of a matrix within ``tol * s_j`` of ``M``;
    * fallback: when ``w >= m`` or the accuracy test fails after ``max_iterations`` power
      iterations, the exact SVD is used.

    Returns:
        ``(U, S, Vh, r)`` with ``U (b, m, w)``, ``S (b, w)``, ``Vh (b, w, n)`` and ``r`` the rank
        used; ``r == m`` when the exact SVD was used (then ``w == m``).
    """
    b, m, n = M.shape
    r = rank
    while r + oversampling < m:
        width = r + oversampling
        gen_device = generator.device if generator is not None else M.device
        omega = torch.randn((b, n, width), generator=generator, device=gen_device, dtype=M.dtype)
        Q = torch.linalg.qr(M @ omega.to(M.device)).Q
        too_small = False
        for iteration in range(max_iterations + 1):
            Ub, S, Vh = torch.linalg.svd(Q.transpose(-2, -1) @ M, full_matrices=False)
            if bool((S[..., r - 1] > edge).any()):
                too_small = True
                break
            U = Q @ Ub
            W = M @ Vh.transpose(-2, -1)
            residual = torch.linalg.vector_norm(W - U * S.unsqueeze(-2), dim=-2)
            kept = torch.gt(S, edge)
            if bool((residual <= tol * S).logical_or(~kept).all()):
                return U, S, Vh, r
            if iteration < max_iterations:
                Q = torch.linalg.qr(W).Q
        if not too_small:
            logger.debug(
                "randomized SVD of shape %s not converged to tol=%g after %d power iterations; "
                "using the exact SVD",
                tuple(M.shape),
                tol,
                max_iterations,
            )
            break
        r *= 2
    U, S, Vh = _exact_svd(M)
    return U, S, Vh, m


# ------------------------------------------------------------------------------------------------
# Matrix-level functions


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
    kappa: float | None,
    norm_correction: bool,
    svd: str,
    rank: int,
    oversampling: int,
    tol: float,
    max_iterations: int,
    generator: torch.Generator | None,
) -> _BatchResult:
    """Core of :func:`denoise_matrix` on a ``(b, rows, cols)`` tensor in compute dtype.

    ``kappa=None`` means "no threshold rule" (pure shrinkage, :func:`optimal_shrinkage`).
    """
    transposed = G.shape[-2] > G.shape[-1]
    M = G.transpose(-2, -1) if transposed else G
    m, n = M.shape[-2], M.shape[-1]
    edge = noise_std * (math.sqrt(m) + math.sqrt(n))
    if svd == "exact":
        U, S, Vh = _exact_svd(M)
        svd_rank = m
    else:
        U, S, Vh, svd_rank = _randomized_svd(
            M,
            edge=edge,
            rank=rank,
            oversampling=oversampling,
            tol=tol,
            max_iterations=max_iterations,
            generator=generator,
        )
    shat = shrink_singular_values(S, noise_std=noise_std, m=m, n=n)
    D = (U * shat.unsqueeze(-2)) @ Vh
    top = S[..., 0]
    kept_rank = (shat > 0).sum(-1)
    # kappa=None: pure shrinkage (optimal_shrinkage), no threshold rule. Otherwise apply only if
    # s_1 > kappa * edge (THEORY.md E.3); with kappa >= 1 that keeps s_1, but if rounding zeroes
    # it anyway the matrix is left as it is, as below the threshold (never a zero gradient).
    if kappa is None:
        applied = torch.ones_like(top, dtype=torch.bool)
    else:
        applied = (top > kappa * edge) & (kept_rank > 0)
    if norm_correction:
        d_norm = torch.linalg.matrix_norm(D)
        # Rows that are not applied keep the input; guard their (possibly zero) norm.
        safe = torch.where(applied & (d_norm > 0), d_norm, torch.ones_like(d_norm))
        D = D * (torch.linalg.matrix_norm(M) / safe)[..., None, None]
    D = torch.where(applied[..., None, None], D, M)
    if transposed:
        D = D.transpose(-2, -1)
    return _BatchResult(out=D, top=top, applied=applied, kept_rank=kept_rank, svd_rank=svd_rank)


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


def _run_on_stack(
    matrix: Tensor,
    *,
    noise_std: float,
    kappa: float | None,
    norm_correction: bool,
    svd: str,
    rank: int,
    oversampling: int,
    tol: float,
    max_iterations: int,
    generator: torch.Generator | None,
) -> Tensor:
    if matrix.shape[-1] == 0 or matrix.shape[-2] == 0 or matrix.numel() == 0:
        return matrix.clone()
    batch_shape = matrix.shape[:-2]
    G = matrix.to(_compute_dtype(matrix.dtype)).reshape(-1, *matrix.shape[-2:])
    result = _denoise_batch(
        G,
        noise_std=noise_std,
        kappa=kappa,
        norm_correction=norm_correction,
        svd=svd,
        rank=rank,
        oversampling=oversampling,
        tol=tol,
        max_iterations=max_iterations,
        generator=generator,
    )
    return result.out.reshape(*batch_shape, *matrix.shape[-2:]).to(matrix.dtype)


def optimal_shrinkage(matrix: Tensor, *, noise_std: float) -> Tensor:
    r"""Shrink every singular value of ``matrix`` with the Frobenius-optimal shrinker.

    :math:`\hat X = \sum_a \hat s_a u_a v_a^\top` with :math:`\hat s_a` from
    :func:`shrink_singular_values` (Gavish and Donoho 2017; THEORY.md E.2). No threshold rule and
    no norm correction: this is the "shrunk" column of the THEORY.md E.5 table, the asymptotically
    MSE-optimal estimate of a low-rank signal in white noise. Computed with an exact SVD in
    float32 (float64 for float64 input), returned in the input dtype.

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
    return _run_on_stack(
        matrix,
        noise_std=sigma,
        kappa=None,
        norm_correction=False,
        svd="exact",
        rank=DEFAULT_RANK,
        oversampling=DEFAULT_OVERSAMPLING,
        tol=DEFAULT_TOL,
        max_iterations=DEFAULT_MAX_ITERATIONS,
        generator=None,
    )


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

    THEORY.md E.3, per matrix ``M`` (``m <= n`` after an internal transpose):

    1. if :math:`s_1 \le \kappa\,\sigma_e(\sqrt m + \sqrt n)`, return ``M`` unchanged;
    2. :math:`D = \sum_a \hat s_a u_a v_a^\top` (:func:`shrink_singular_values`);
    3. if ``norm_correction``, :math:`D \leftarrow D\,\|M\|_F / \|D\|_F`. This keeps the noisy
       norm, so the Frobenius error grows while the direction improves (THEORY.md E.3, E.5);
       it is intended.

    Since :math:`\kappa \ge 1`, step 2 keeps at least the top singular value, so ``D`` is never
    zero when applied. The result is equivariant under transposition and homogeneous:
    ``denoise(c*M, noise_std=c*s) == c*denoise(M, noise_std=s)`` for ``c > 0``.

    Args:
        matrix: Noisy matrix, shape ``(..., m, n)``; leading dimensions are a batch of
            independent matrices, each with its own threshold decision.
        noise_std: :math:`\sigma_e`, the standard deviation of each noise entry (for a DP
            optimizer see :func:`noise_std_from_optimizer`).
        kappa: Threshold factor, ``>= 1``. Default :data:`DEFAULT_KAPPA` (THEORY.md E.5).
        norm_correction: Rescale to the noisy Frobenius norm. Default ``True`` (THEORY.md E.3,
            the paper's step C).
        svd: ``"exact"`` (``torch.linalg.svd``) or ``"randomized"`` (truncated randomized
            subspace iteration, Halko et al. 2011: the rank doubles from ``rank`` until the
            ``rank``-th computed singular value is at most the bulk edge, so every singular value
            that survives shrinkage is computed, each to relative residual ``tol``; exact SVD
            when the sketch would be as wide as the matrix or ``max_iterations`` is reached).
        rank: Starting rank of the randomized SVD. Default :data:`DEFAULT_RANK`.
        oversampling: Extra sketch columns of the randomized SVD. Default
            :data:`DEFAULT_OVERSAMPLING` (Halko et al. 2011, section 4.2).
        tol: Relative residual tolerance of the randomized SVD. Default :data:`DEFAULT_TOL`.
        max_iterations: Power iterations of the randomized SVD before it falls back to the
            exact SVD. Default :data:`DEFAULT_MAX_ITERATIONS`.
        generator: Source of the randomized SVD's Gaussian test matrix (data-independent, so the
            result is still post-processing). ``None`` uses torch's global generator.

    Returns:
        Tensor of the shape and dtype of ``matrix``. Computed in float32 (float64 for float64
        input) and cast back.

    Raises:
        TypeError: if ``matrix`` is not a floating-point tensor.
        ValueError: if ``matrix`` has fewer than 2 dimensions or non-finite entries;
            ``noise_std`` is negative or non-finite; ``kappa < 1`` (the bulk edge, see
            :data:`DEFAULT_KAPPA`); ``svd`` is not in :data:`SVD_METHODS`; ``rank < 1``;
            ``oversampling < 0``; ``tol`` not in ``(0, 1)``; ``max_iterations < 0``.
    """
    _check_matrix(matrix)
    sigma = _check_noise_std(noise_std)
    kappa = _check_kappa(kappa)
    _check_svd(svd)
    _check_positive_int(rank, "rank")
    _check_positive_int(oversampling, "oversampling", minimum=0)
    tol = _check_tol(tol)
    _check_positive_int(max_iterations, "max_iterations", minimum=0)
    return _run_on_stack(
        matrix,
        noise_std=sigma,
        kappa=kappa,
        norm_correction=bool(norm_correction),
        svd=svd,
        rank=rank,
        oversampling=oversampling,
        tol=tol,
        max_iterations=max_iterations,
        generator=generator,
    )


# ------------------------------------------------------------------------------------------------
# Opacus optimizer adapter


def noise_std_from_optimizer(optimizer: Any) -> float:
    r"""Per-entry noise standard deviation :math:`\sigma_e` of a DP optimizer's released gradient.

    THEORY.md E.1, mirroring Opacus' ``add_noise`` then ``scale_grad``:

    * ``loss_reduction="mean"``: :math:`\sigma_e = \sigma C / (B_{exp} \cdot A)`;
    * ``loss_reduction="sum"``: :math:`\sigma_e = \sigma C`,

    with ``sigma`` the multiplier the optimizer *adds noise with*, ``C = max_grad_norm``,
    ``B_exp = expected_batch_size`` and ``A = accumulated_iterations``. Only public constants are
    read: never the realised batch size, never per-sample data.

    The noise multiplier is ``optimizer.noise_multiplier``, except for Opacus' adaptive clipping,
    whose noise (but not accounting) multiplier is larger: ``_adjusted_noise_multiplier`` when the
    optimizer sets it (``DPOptimizerFastGradientClipping``), else, for ``AdaClipDPOptimizer``
    (recognised by its ``unclipped_num_std`` attribute),
    :math:`(\sigma^{-2} - (2\sigma_u)^{-2})^{-1/2}` (Andrew et al. 2021, arXiv:1905.03871,
    Theorem 1, as in Opacus' ``AdaClipDPOptimizer.add_noise``). For per-layer clipping Opacus
    stores the combined norm in ``max_grad_norm``, which is what its noise uses.

    Args:
        optimizer: An Opacus ``DPOptimizer`` (or any object with ``noise_multiplier``,
            ``max_grad_norm``, ``loss_reduction``, and for ``"mean"`` ``expected_batch_size`` and
            ``accumulated_iterations``), after ``add_noise`` and ``scale_grad``.

    Returns:
        :math:`\sigma_e` (units of the gradient entries).

    Raises:
        AttributeError: if a needed attribute is missing.
        ValueError: if ``loss_reduction`` is not ``"mean"`` or ``"sum"``, the expected batch size
            or accumulated iterations are not positive, or the result is negative or non-finite.
    """
    return _noise_std(optimizer, accumulated=None)


def _noise_std(optimizer: Any, *, accumulated: int | None) -> float:
    """:func:`noise_std_from_optimizer`; ``accumulated=None`` reads the optimizer's (after a
    backward pass only: Opacus derives it from ``p.grad_sample``)."""
    sigma = getattr(optimizer, "_adjusted_noise_multiplier", None)
    if sigma is None:
        sigma = float(optimizer.noise_multiplier)
        sigma_u = getattr(optimizer, "unclipped_num_std", None)
        if sigma_u is not None and sigma > 0:
            sigma = (sigma ** (-2) - (2.0 * float(sigma_u)) ** (-2)) ** (-0.5)
    clip = float(optimizer.max_grad_norm)
    reduction = optimizer.loss_reduction
    if reduction == "sum":
        std = float(sigma) * clip
    elif reduction == "mean":
        batch = optimizer.expected_batch_size
        if accumulated is None:
            accumulated = optimizer.accumulated_iterations
        if batch is None or batch <= 0:
            raise ValueError(
                f"loss_reduction='mean' needs a positive expected_batch_size, got {batch}"
            )
        if accumulated <= 0:
            raise ValueError(f"accumulated_iterations must be positive, got {accumulated}")
        std = float(sigma) * clip / (float(batch) * float(accumulated))
    else:
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {reduction!r}")
    return _check_noise_std(std)


def _refuse_distributed(optimizer: Any) -> None:
    world_size = getattr(optimizer, "world_size", 1)
    if world_size is not None and int(world_size) > 1:
        raise NotImplementedError(
            f"SpectralDenoiser does not support distributed DP optimizers "
            f"(world_size={world_size}): Opacus adds the noise on rank 0 only and all-reduces "
            "after the step hook, so denoising there would act on un-noised partial sums, "
            "which is not post-processing"
        )


@dataclass(frozen=True)
class DenoiseRecord:
    r"""What the denoiser did to one parameter at its last call.

    All numbers are functions of the released noisy gradient and public constants, so recording
    them is post-processing too.

    Attributes:
        index: Position of the parameter in ``optimizer.params``.
        shape: Shape of its gradient.
        status: ``"denoised"`` (threshold met, gradient replaced), ``"below_threshold"`` (left
            unchanged by the rule), ``"skipped_not_2d"``, ``"skipped_min_dim"`` or ``"no_grad"``.
        top_singular_value: :math:`s_1` of the noisy gradient (``None`` if skipped).
        threshold: :math:`\kappa\sigma_e(\sqrt m + \sqrt n)` (``None`` if skipped).
        kept_rank: Number of singular values the shrinker kept non-zero (``None`` if skipped).
        svd_rank: Singular triplets computed: ``min(m, n)`` for the exact SVD, less for a
            randomized one that stopped early (``None`` if skipped).
    """

    index: int
    shape: tuple[int, ...]
    status: str
    top_singular_value: float | None = None
    threshold: float | None = None
    kept_rank: int | None = None
    svd_rank: int | None = None


@dataclass(frozen=True)
class DenoiseReport:
    r"""Summary of one :class:`SpectralDenoiser` call.

    Attributes:
        noise_std: :math:`\sigma_e` used for every matrix (:func:`noise_std_from_optimizer`).
        records: One :class:`DenoiseRecord` per parameter of ``optimizer.params``, in order.
    """

    noise_std: float
    records: tuple[DenoiseRecord, ...]

    @property
    def num_denoised(self) -> int:
        """Number of parameters whose gradient was replaced."""
        return sum(r.status == "denoised" for r in self.records)


class SpectralDenoiser:
    r"""Spectral denoising of every 2-D noisy gradient of a DP optimizer, as a step hook.

    Call it on an Opacus ``DPOptimizer`` after ``add_noise`` and ``scale_grad`` and before the
    wrapped optimizer's step (``denoiser(optimizer)``); ``opacus_rc`` attaches it with
    ``attach_post_processing_hook``. For each parameter in ``optimizer.params`` with a dense 2-D
    gradient whose smaller dimension is ``>= min_dim`` (``nn.Linear`` weights; each LoRA factor
    separately), ``p.grad`` is replaced in place by :func:`denoise_matrix` with
    :math:`\sigma_e` from :func:`noise_std_from_optimizer`. Other parameters (biases, norm layers,
    convolution kernels, tiny matrices) are left untouched and listed once in the log. Gradients
    of equal shape, dtype and device share one batched SVD. Computation is in float32 (float64
    for float64 gradients) and the result is cast back to the gradient's dtype.

    Post-processing (THEORY.md E.4): the output depends only on the released noisy gradients and
    public constants, so the accountant is unchanged.

    Distributed optimizers are refused: Opacus adds the noise on rank 0 only and all-reduces
    *after* the step hook, so in the hook the gradients on other ranks are un-noised partial sums
    and a non-linear map of them is not post-processing.

    Args:
        kappa: Threshold factor, ``>= 1``. Default :data:`DEFAULT_KAPPA` (THEORY.md E.5).
        norm_correction: Rescale each denoised gradient to its noisy Frobenius norm. Default
            ``True`` (THEORY.md E.3).
        min_dim: Smallest ``min(m, n)`` that is denoised. Default :data:`DEFAULT_MIN_DIM`.
        svd: ``"exact"`` (default) or ``"randomized"``; see :func:`denoise_matrix`.
        rank: Starting rank of the randomized SVD. Default :data:`DEFAULT_RANK`.
        oversampling: Randomized SVD oversampling. Default :data:`DEFAULT_OVERSAMPLING`.
        tol: Randomized SVD relative residual tolerance. Default :data:`DEFAULT_TOL`.
        max_iterations: Randomized SVD power iterations before the exact fallback. Default
            :data:`DEFAULT_MAX_ITERATIONS`.
        generator: Generator for the randomized SVD's test matrices; ``None`` uses torch's
            global generator.

    Attributes:
        last_report: :class:`DenoiseReport` of the last call (``None`` before the first).

    Raises:
        ValueError: at construction, for ``kappa < 1`` (message explains the bulk edge), an
            unknown ``svd``, ``min_dim`` or ``rank`` < 1, ``oversampling`` or
            ``max_iterations`` < 0, or ``tol`` not in ``(0, 1)``; at call time, for a non-finite gradient, or if ``sigma_e``
            cannot be formed (:func:`noise_std_from_optimizer`).
        NotImplementedError: at call time, for a distributed optimizer (``world_size > 1``).

    Example:
        >>> denoiser = SpectralDenoiser(kappa=1.05)
        >>> denoiser(dp_optimizer)  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        kappa: float = DEFAULT_KAPPA,
        norm_correction: bool = True,
        min_dim: int = DEFAULT_MIN_DIM,
        svd: str = "exact",
        rank: int = DEFAULT_RANK,
        oversampling: int = DEFAULT_OVERSAMPLING,
        tol: float = DEFAULT_TOL,
        max_iterations: int = DEFAULT_MAX_ITERATIONS,
        generator: torch.Generator | None = None,
    ) -> None:
        self.kappa = _check_kappa(kappa)
        self.norm_correction = bool(norm_correction)
        self.min_dim = _check_positive_int(min_dim, "min_dim")
        self.svd = _check_svd(svd)
        self.rank = _check_positive_int(rank, "rank")
        self.oversampling = _check_positive_int(oversampling, "oversampling", minimum=0)
        self.tol = _check_tol(tol)
        self.max_iterations = _check_positive_int(max_iterations, "max_iterations", minimum=0)
        self.generator = generator
        self.last_report: DenoiseReport | None = None
        self._skips_logged = False

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(kappa={self.kappa}, norm_correction={self.norm_correction}, "
            f"min_dim={self.min_dim}, svd={self.svd!r})"
        )

    def check_optimizer(self, optimizer: Any) -> float:
        r"""Check, before any step, that this denoiser can run on ``optimizer``.

        ``PrivacyEngine.make_private(denoise=...)`` calls it right after building the DP
        optimizer, so a bad configuration fails there and not at the first step.

        Args:
            optimizer: An Opacus ``DPOptimizer``.

        Returns:
            :math:`\sigma_e` that the denoiser will use for a step without gradient
            accumulation (:func:`noise_std_from_optimizer` with ``accumulated_iterations = 1``:
            Opacus can only count accumulated iterations after a backward pass).

        Raises:
            NotImplementedError: For a distributed optimizer (``world_size > 1``).
            AttributeError, ValueError: If :math:`\sigma_e` cannot be formed.
        """
        _refuse_distributed(optimizer)
        return _noise_std(optimizer, accumulated=1)

    def _classify(self, grad: Tensor | None) -> str | None:
        if grad is None:
            return "no_grad"
        if grad.dim() != 2 or grad.layout != torch.strided:
            return "skipped_not_2d"
        if min(grad.shape) < self.min_dim:
            return "skipped_min_dim"
        return None

    def __call__(self, optimizer: Any) -> None:
        """Denoise ``p.grad`` in place for every eligible parameter of ``optimizer.params``.

        Args:
            optimizer: An Opacus ``DPOptimizer`` after ``add_noise`` and ``scale_grad`` (see
                :func:`noise_std_from_optimizer` for the attributes read).

        Raises:
            ValueError: if a gradient to denoise has non-finite entries, or ``sigma_e`` cannot be
                formed.
            NotImplementedError: if ``optimizer.world_size > 1``.
        """
        _refuse_distributed(optimizer)
        params: Sequence[Tensor] = list(optimizer.params)
        statuses = [self._classify(p.grad) for p in params]
        eligible = [i for i, st in enumerate(statuses) if st is None]
        noise_std = noise_std_from_optimizer(optimizer) if eligible else 0.0
        self._log_skips(params, statuses)

        groups: dict[tuple[Any, ...], list[int]] = {}
        for i in eligible:
            g = params[i].grad
            groups.setdefault((tuple(g.shape), g.dtype, g.device), []).append(i)

        records: dict[int, DenoiseRecord] = {}
        for (shape, _, _), indices in groups.items():
            grads = [params[i].grad for i in indices]
            stack = torch.stack(grads)
            if not bool(torch.isfinite(stack).all()):
                bad = [i for i, g in zip(indices, grads) if not bool(torch.isfinite(g).all())]
                raise ValueError(
                    f"non-finite gradient (nan or inf) for optimizer.params index(es) {bad} of "
                    f"shape {shape}; spectral denoising needs a finite noisy gradient (check the "
                    "learning rate, loss scaling or mixed-precision overflow)"
                )
            result = _denoise_batch(
                stack.to(_compute_dtype(stack.dtype)),
                noise_std=noise_std,
                kappa=self.kappa,
                norm_correction=self.norm_correction,
                svd=self.svd,
                rank=self.rank,
                oversampling=self.oversampling,
                tol=self.tol,
                max_iterations=self.max_iterations,
                generator=self.generator,
            )
            out = result.out.to(stack.dtype)
            threshold = self.kappa * noise_std * (math.sqrt(shape[0]) + math.sqrt(shape[1]))
            tops = result.top.tolist()
            applied = result.applied.tolist()
            kept = result.kept_rank.tolist()
            for j, i in enumerate(indices):
                if applied[j]:
                    grads[j].copy_(out[j])
                records[i] = DenoiseRecord(
                    index=i,
                    shape=shape,
                    status="denoised" if applied[j] else "below_threshold",
                    top_singular_value=tops[j],
                    threshold=threshold,
                    kept_rank=kept[j],
                    svd_rank=result.svd_rank,
                )
        for i, st in enumerate(statuses):
            if st is not None:
                grad = params[i].grad
                shape = tuple(grad.shape) if grad is not None else tuple(params[i].shape)
                records[i] = DenoiseRecord(index=i, shape=shape, status=st)
        self.last_report = DenoiseReport(
            noise_std=noise_std, records=tuple(records[i] for i in range(len(params)))
        )
        logger.debug(
            "SpectralDenoiser: sigma_e=%.3g, denoised %d of %d parameters",
            noise_std,
            self.last_report.num_denoised,
            len(params),
        )

    def _log_skips(self, params: Sequence[Tensor], statuses: Sequence[str | None]) -> None:
        if self._skips_logged:
            return
        skipped = [
            (i, tuple(params[i].shape), st)
            for i, st in enumerate(statuses)
            if st in ("skipped_not_2d", "skipped_min_dim")
        ]
        if skipped:
            logger.info(
                "SpectralDenoiser leaves %d parameter(s) untouched by rule (only 2-D gradients "
                "with min dimension >= %d are denoised): %s",
                len(skipped),
                self.min_dim,
                ", ".join(f"#{i} {shape} ({st})" for i, shape, st in skipped),
            )
        self._skips_logged = True
