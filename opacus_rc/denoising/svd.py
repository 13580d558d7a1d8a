r"""SVD back ends of the spectral denoiser: exact and randomized, resolved by name.

The denoiser (:mod:`opacus_rc.denoising.denoiser`) needs, for a batch of noisy matrices, every
singular triplet whose value lies above the noise bulk edge :math:`\sigma_e(\sqrt m + \sqrt n)`:
only those survive the Frobenius-optimal shrinker (docs/denoising.md#denoising-algorithm). A back
end is resolved from the ``svd=`` option through :data:`SVD_BACKENDS` and has the signature::

    backend(M, *, edge, rank, oversampling, tol, max_iterations, generator)
        -> (U, S, Vh, svd_rank)

with ``M`` of shape ``(b, m, n)`` and ``m <= n`` (the caller transposes), ``edge`` the bulk edge
in the units of ``M``'s entries, and the remaining keywords the randomized SVD's options (a back
end that needs none ignores them). It returns ``U (b, m, w)``, ``S (b, w)`` in descending order,
``Vh (b, w, n)`` and ``svd_rank`` (the number of triplets it guarantees, ``w >= svd_rank``): every
singular value above ``edge`` must be among the first ``svd_rank`` values of ``S``.
The test matrices of a randomized back end must not depend on ``M`` (post-processing,
docs/denoising.md#denoising-post-processing).

Built in: ``"exact"`` (``torch.linalg.svd``) and ``"randomized"`` (Halko, Martinsson and Tropp
2011, Algorithms 4.4 and 5.1, with the rank-doubling rule of docs/denoising.md#denoising-algorithm).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import Tensor

from opacus_rc.validation import validate_choice

__all__ = [
    "DEFAULT_MAX_ITERATIONS",
    "DEFAULT_OVERSAMPLING",
    "DEFAULT_RANK",
    "DEFAULT_TOL",
    "SVD_BACKENDS",
    "SVD_METHODS",
    "SvdBackend",
]

logger = logging.getLogger(__name__)

#: The values of the ``svd`` argument, in the order they are documented (the keys of
#: :data:`SVD_BACKENDS`).
SVD_METHODS = ("exact", "randomized")

#: Default starting rank of the randomized SVD. Not from a paper: the rank doubles until the
#: stopping rule of docs/denoising.md#denoising-algorithm holds, so this value affects cost, not the
#: result.
DEFAULT_RANK = 16

#: Default oversampling of the randomized range finder. Source: Halko, Martinsson and Tropp 2011,
#: "Finding structure with randomness", SIAM Rev. 53(2), section 4.2 (p = 10 suggested), also the
#: default ``n_oversamples`` of scikit-learn's ``randomized_svd``.
DEFAULT_OVERSAMPLING = 10

#: Default relative residual tolerance of the randomized SVD: every kept singular triplet satisfies
#: ||M v - s u|| <= tol * s. Source [num, docs/denoising.md#denoising-oracle planted matrix, float32
#: and float64]: the relative Frobenius distance between the randomized and the exact denoised
#: matrix is about tol/2 (4.3e-5 at tol = 1e-4), three to four orders below the denoising error
#: itself (0.48); tol = 1e-6 is still reachable in float32 there.
DEFAULT_TOL = 1e-4

#: Default cap on power iterations of the randomized SVD before it falls back to the exact SVD.
#: Source [num, CPU, float32, one thread, sketch width 26]: 32 iterations took 0.064 s against
#: 0.044 s for the exact SVD of a 256 x 1024 matrix, and 0.37 s against 0.82 s at 768 x 3072; an
#: iteration costs O(m*n*w) and the exact SVD O(m^2*n), so past this cap exact is as cheap for
#: matrices with a few hundred rows.
DEFAULT_MAX_ITERATIONS = 32


class SvdBackend(Protocol):
    """Signature of an SVD back end (see the module docstring)."""

    def __call__(
        self,
        M: Tensor,
        *,
        edge: float,
        rank: int,
        oversampling: int,
        tol: float,
        max_iterations: int,
        generator: torch.Generator | None,
    ) -> tuple[Tensor, Tensor, Tensor, int]: ...


def _check_svd(svd: str) -> str:
    validate_choice("svd", svd, SVD_METHODS)
    return svd


def _check_tol(tol: float) -> float:
    value = float(tol)
    if not 0.0 < value < 1.0:
        raise ValueError(f"tol must be in (0, 1), got {tol}")
    return value


def _exact_svd(
    M: Tensor,
    *,
    edge: float | None = None,
    rank: int | None = None,
    oversampling: int | None = None,
    tol: float | None = None,
    max_iterations: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, int]:
    """``torch.linalg.svd(M, full_matrices=False)`` and ``svd_rank = m``; the options are unused."""
    U, S, Vh = torch.linalg.svd(M, full_matrices=False)
    return U, S, Vh, M.shape[-2]


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

    * rank (docs/denoising.md#denoising-algorithm): only singular values above the bulk edge survive
      shrinkage, so the ``r``-th computed value must be ``<= edge`` for every matrix; Ritz values
      are lower bounds of the true ones, so a value above the edge proves that ``r`` is too small:
      ``r`` doubles and the iteration restarts;
    * accuracy: every kept triplet (``s_j > edge``) has residual ``<= tol * s_j`` (the relative
      residual test of ARPACK, as used by ``scipy.sparse.linalg.svds``), i.e. it is an exact
      triplet of a matrix within ``tol * s_j`` of ``M``;
    * fallback: when ``w >= m`` or the accuracy test fails after ``max_iterations`` power
      iterations, the exact SVD is used.

    Both stopping decisions of an iteration are read from the device in one transfer (the loop
    is adaptive, so an iteration costs one host synchronisation; the exact fallback costs none).

    Args:
        M: ``(b, m, n)`` batch, ``m <= n``, float32 or float64.
        edge: Bulk edge :math:`\sigma_e(\sqrt m + \sqrt n)` (units of ``M``'s entries).
        rank: Starting rank ``r >= 1``.
        oversampling: Extra sketch columns, ``>= 0``.
        tol: Relative residual tolerance in ``(0, 1)``.
        max_iterations: Power iterations before the exact fallback, ``>= 0``.
        generator: Source of the test matrices; ``None`` uses torch's global generator.

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
            U = Q @ Ub
            W = M @ Vh.transpose(-2, -1)
            residual = torch.linalg.vector_norm(W - U * S.unsqueeze(-2), dim=-2)
            kept = torch.gt(S, edge)
            rank_too_small = (S[..., r - 1] > edge).any()
            converged = (residual <= tol * S).logical_or(~kept).all()
            too_small, done = torch.stack((rank_too_small, converged)).tolist()
            if too_small:
                break
            if done:
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
    return _exact_svd(M)


#: ``svd=`` name -> back end (the order of :data:`SVD_METHODS`).
SVD_BACKENDS: dict[str, SvdBackend] = {"exact": _exact_svd, "randomized": _randomized_svd}
