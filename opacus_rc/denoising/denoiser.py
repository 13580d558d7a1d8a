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
gradients reads the device once, for the finiteness check (:func:`_denoise_gradients_`); the
records of what was done are read only when asked for (:class:`_PendingReport`). Nothing here
imports Opacus; :mod:`opacus_rc.denoising.opacus_adapter` reads the optimizer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from opacus_rc.denoising.shrinkage import (
    _check_noise_std,
    _check_positive_int,
    shrink_singular_values,
)
from opacus_rc.denoising.svd import (
    DEFAULT_MAX_ITERATIONS,
    DEFAULT_OVERSAMPLING,
    DEFAULT_RANK,
    DEFAULT_TOL,
    SVD_BACKENDS,
    _check_svd,
    _check_tol,
)

__all__ = [
    "DEFAULT_KAPPA",
    "DEFAULT_MIN_DIM",
    "DenoiseRecord",
    "DenoiseReport",
    "denoise_matrix",
    "optimal_shrinkage",
]

#: Default threshold factor kappa. Source: docs/denoising.md#denoising-oracle, whose pure-noise
#: control uses kappa = 1.05. Why not kappa = 1 [num, checked here with torch.randn, 2000 draws per
#: shape]: for pure Gaussian noise s_1 / (sigma_e (sqrt(m) + sqrt(n))) exceeds 1 in 5-16% of draws
#: at shapes (2..768, 256..1024) (finite-size Tracy-Widom fluctuations above the bulk edge), but
#: never exceeded 1.05 (maximum 1.046) once the larger dimension is >= 256. At a larger dimension of
#: 64 or less, 1.6-5% of pure-noise draws still pass 1.05 (raise kappa or min_dim there).
DEFAULT_KAPPA = 1.05

#: Default smallest dimension of a matrix the denoiser touches. Source: with norm correction, a
#: matrix with one row or column (one singular value) is mapped to itself, so ``min_dim = 2`` is
#: the smallest size at which the operation is not the identity; skipping smaller matrices is exact.
DEFAULT_MIN_DIM = 2


# ------------------------------------------------------------------------------------------------
# Validators


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


# ------------------------------------------------------------------------------------------------
# One batch of equal-shape matrices


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

    ``kappa=None`` means "no threshold rule" (pure shrinkage, :func:`optimal_shrinkage`). No host
    synchronisation with the exact SVD: the threshold rule is a ``torch.where``.
    """
    transposed = G.shape[-2] > G.shape[-1]
    M = G.transpose(-2, -1) if transposed else G
    m, n = M.shape[-2], M.shape[-1]
    edge = noise_std * (math.sqrt(m) + math.sqrt(n))
    U, S, Vh, svd_rank = SVD_BACKENDS[svd](
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
    # s_1 > kappa * edge (docs/denoising.md#denoising-algorithm); with kappa >= 1 that keeps s_1,
    # but if rounding zeroes it anyway the matrix is left as it is, as below the threshold (never a
    # zero gradient).
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


# ------------------------------------------------------------------------------------------------
# Matrix-level functions


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
            :data:`DEFAULT_KAPPA`); ``svd`` is not a registered back end; ``rank < 1``;
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
# Records of a call on a list of gradients


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
    r"""Summary of one :class:`~opacus_rc.denoising.SpectralDenoiser` call.

    Attributes:
        noise_std: :math:`\sigma_e` used for every matrix
            (:func:`~opacus_rc.denoising.noise_std_from_optimizer`).
        records: One :class:`DenoiseRecord` per parameter of ``optimizer.params``, in order.
    """

    noise_std: float
    records: tuple[DenoiseRecord, ...]

    @property
    def num_denoised(self) -> int:
        """Number of parameters whose gradient was replaced."""
        return sum(r.status == "denoised" for r in self.records)


@dataclass(frozen=True)
class _PendingReport:
    """A :class:`DenoiseReport` whose per-matrix numbers are still on the device.

    ``records`` holds the final record of every skipped parameter and, for a denoised-or-not one,
    a record with ``status=""`` whose three device-held numbers are column ``j`` of a ``(3, b)``
    float64 tensor ``(s_1, applied, kept_rank)`` in ``stats``: ``(record positions, tensor)``
    per group. :meth:`resolve` reads them in one transfer per device. float64 holds every value
    exactly (float32 or float64 singular values, 0/1, ranks below 2^53), and no tensor here
    aliases a gradient, so the report equals a read at call time.
    """

    noise_std: float
    records: tuple[DenoiseRecord, ...]
    stats: tuple[tuple[tuple[int, ...], Tensor], ...]

    def resolve(self) -> DenoiseReport:
        """The :class:`DenoiseReport`, reading the device once per device."""
        records = list(self.records)
        by_device: dict[torch.device, list[tuple[tuple[int, ...], Tensor]]] = {}
        for positions, stats in self.stats:
            by_device.setdefault(stats.device, []).append((positions, stats))
        for groups in by_device.values():
            columns = torch.cat([stats for _, stats in groups], dim=1).tolist()
            positions = [i for group_positions, _ in groups for i in group_positions]
            for j, i in enumerate(positions):
                top, applied, kept = columns[0][j], columns[1][j], columns[2][j]
                records[i] = dataclasses.replace(
                    records[i],
                    status="denoised" if applied else "below_threshold",
                    top_singular_value=top,
                    kept_rank=int(kept),
                )
        return DenoiseReport(noise_std=self.noise_std, records=tuple(records))


def _classify(grad: Tensor | None, *, min_dim: int) -> str | None:
    """The skip status of a gradient (see :class:`DenoiseRecord`), ``None`` if it is denoised.

    Reads metadata only (no host synchronisation).
    """
    if grad is None:
        return "no_grad"
    if grad.dim() != 2 or grad.layout != torch.strided:
        return "skipped_not_2d"
    if min(grad.shape) < min_dim:
        return "skipped_min_dim"
    return None


def _denoise_gradients_(
    params: Sequence[Tensor],
    statuses: Sequence[str | None],
    *,
    noise_std: float,
    kappa: float,
    norm_correction: bool,
    svd: str,
    rank: int,
    oversampling: int,
    tol: float,
    max_iterations: int,
    generator: torch.Generator | None,
) -> _PendingReport:
    """Denoise ``p.grad`` in place for every ``p`` whose status (:func:`_classify`) is ``None``.

    Gradients of equal shape, dtype and device share one batched SVD, in float32 (float64 for
    float64 gradients), cast back to the gradient's dtype. Every eligible gradient is written
    back: ``torch.where`` has already put the noisy matrix where the threshold rule fails, and
    the round trip through the compute dtype is exact, so those gradients keep their values.

    Host synchronisation: one per device, for the finiteness check, and none per layer. The
    check comes first, so on non-finite input nothing is written.

    Raises:
        ValueError: If a gradient to denoise has non-finite entries (the message names the first
            group, in order of first appearance, that has one).
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, st in enumerate(statuses):
        if st is None:
            g = params[i].grad
            groups.setdefault((tuple(g.shape), g.dtype, g.device), []).append(i)
    _check_finite(params, groups)

    records: list[DenoiseRecord] = []
    for i, (p, st) in enumerate(zip(params, statuses, strict=True)):
        grad = p.grad
        shape = tuple(grad.shape) if grad is not None else tuple(p.shape)
        records.append(DenoiseRecord(index=i, shape=shape, status=st if st is not None else ""))
    stats: list[tuple[tuple[int, ...], Tensor]] = []
    for (shape, _, _), indices in groups.items():
        grads = [params[i].grad for i in indices]
        stack = torch.stack(grads)
        result = _denoise_batch(
            stack.to(_compute_dtype(stack.dtype)),
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
        out = result.out.to(stack.dtype)
        for j, grad in enumerate(grads):
            grad.copy_(out[j])
        threshold = kappa * noise_std * (math.sqrt(shape[0]) + math.sqrt(shape[1]))
        for i in indices:
            records[i] = DenoiseRecord(
                index=i, shape=shape, status="", threshold=threshold, svd_rank=result.svd_rank
            )
        numbers = torch.stack(
            [t.to(torch.float64) for t in (result.top, result.applied, result.kept_rank)]
        )
        stats.append((tuple(indices), numbers))
    return _PendingReport(noise_std=noise_std, records=tuple(records), stats=tuple(stats))


def _check_finite(params: Sequence[Tensor], groups: dict[tuple[Any, ...], list[int]]) -> None:
    """One device read per device: are all gradients in ``groups`` finite? Raise if not."""
    flags: dict[torch.device, list[Tensor]] = {}
    for (_, _, device), indices in groups.items():
        flags.setdefault(device, []).extend(torch.isfinite(params[i].grad).all() for i in indices)
    if all(bool(torch.stack(fl).all()) for fl in flags.values()):
        return
    for (shape, _, _), indices in groups.items():  # error path: find the first bad group
        bad = [i for i in indices if not bool(torch.isfinite(params[i].grad).all())]
        if bad:
            raise ValueError(
                f"non-finite gradient (nan or inf) for optimizer.params index(es) {bad} of "
                f"shape {shape}; spectral denoising needs a finite noisy gradient (check the "
                "learning rate, loss scaling or mixed-precision overflow)"
            )
