r"""Spectral denoising of an Opacus DP optimizer's released gradients, as a post-processing hook.

What here reads an Opacus ``DPOptimizer`` (by its public attributes, without importing Opacus):
the per-entry noise level :math:`\sigma_e` of the released gradient
(:func:`noise_std_from_optimizer`, docs/denoising.md#denoising-noise-level), the refusal of
distributed optimizers, and :class:`SpectralDenoiser`, the step hook that
``make_private(denoise="spectral")`` attaches with ``attach_post_processing_hook`` and that runs
:mod:`opacus_rc.denoising.denoiser` on ``optimizer.params``.

:math:`\sigma_e = \sigma C / (B_{exp} \cdot A)` for ``loss_reduction="mean"`` (``B_exp`` the
*expected* batch size, ``A`` the accumulated iterations) or :math:`\sigma_e = \sigma C` for
``"sum"``: public constants only, so the denoiser stays post-processing
(docs/denoising.md#denoising-post-processing).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from opacus_rc._compat.opacus import adjusted_noise_multiplier
from opacus_rc.denoising.denoiser import DEFAULT_KAPPA, DEFAULT_MIN_DIM
from opacus_rc.denoising.gradients import _classify, _denoise_gradients_
from opacus_rc.denoising.options import DenoiseOptions
from opacus_rc.denoising.records import DenoiseReport, _PendingReport
from opacus_rc.denoising.shrinkage import _check_noise_std
from opacus_rc.denoising.svd import (
    DEFAULT_MAX_ITERATIONS,
    DEFAULT_OVERSAMPLING,
    DEFAULT_RANK,
    DEFAULT_TOL,
)
from opacus_rc.validation import validate_choice

__all__ = ["DENOISERS", "SpectralDenoiser", "make_denoiser", "noise_std_from_optimizer"]

logger = logging.getLogger(__name__)


def noise_std_from_optimizer(optimizer: Any) -> float:
    r"""Per-entry noise standard deviation :math:`\sigma_e` of a DP optimizer's released gradient.

    docs/denoising.md#denoising-noise-level, mirroring Opacus' ``add_noise`` then ``scale_grad``:

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
    sigma = adjusted_noise_multiplier(optimizer)
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


class SpectralDenoiser:
    r"""Spectral denoising of every 2-D noisy gradient of a DP optimizer, as a step hook.

    Call it on an Opacus ``DPOptimizer`` after ``add_noise`` and ``scale_grad`` and before the
    wrapped optimizer's step (``denoiser(optimizer)``); ``opacus_rc`` attaches it with
    ``attach_post_processing_hook``. For each parameter in ``optimizer.params`` with a dense 2-D
    gradient whose smaller dimension is ``>= min_dim`` (``nn.Linear`` weights; each LoRA factor
    separately), ``p.grad`` is replaced in place by :func:`~opacus_rc.denoising.denoise_matrix`
    with :math:`\sigma_e` from :func:`noise_std_from_optimizer`. Other parameters (biases, norm
    layers, convolution kernels, tiny matrices) are left untouched and listed once in the log.
    Gradients of equal shape, dtype and device share one batched SVD. Computation is in float32
    (float64 for float64 gradients) and the result is cast back to the gradient's dtype.

    A call synchronises with the device once (the finiteness check, one reduction) with the exact
    SVD, whatever the number of layers; the randomized SVD adds one per power iteration.
    ``last_report`` reads its numbers from the device when first accessed after a call.

    Post-processing (docs/denoising.md#denoising-post-processing): the output depends only on the
    released noisy gradients and public constants, so the accountant is unchanged.

    Distributed optimizers are refused: Opacus adds the noise on rank 0 only and all-reduces
    *after* the step hook, so in the hook the gradients on other ranks are un-noised partial sums
    and a non-linear map of them is not post-processing.

    Args:
        kappa: Threshold factor, ``>= 1``. Default :data:`~opacus_rc.denoising.DEFAULT_KAPPA`
            (docs/denoising.md#denoising-oracle).
        norm_correction: Rescale each denoised gradient to its noisy Frobenius norm. Default
            ``True`` (docs/denoising.md#denoising-algorithm).
        min_dim: Smallest ``min(m, n)`` that is denoised. Default
            :data:`~opacus_rc.denoising.DEFAULT_MIN_DIM`.
        svd: ``"exact"`` (default) or ``"randomized"``
            (:data:`~opacus_rc.denoising.SVD_METHODS`); see
            :func:`~opacus_rc.denoising.denoise_matrix`.
        rank: Starting rank of the randomized SVD. Default
            :data:`~opacus_rc.denoising.svd.DEFAULT_RANK`.
        oversampling: Randomized SVD oversampling. Default
            :data:`~opacus_rc.denoising.svd.DEFAULT_OVERSAMPLING`.
        tol: Randomized SVD relative residual tolerance. Default
            :data:`~opacus_rc.denoising.svd.DEFAULT_TOL`.
        max_iterations: Randomized SVD power iterations before the exact fallback. Default
            :data:`~opacus_rc.denoising.svd.DEFAULT_MAX_ITERATIONS`.
        generator: Generator for the randomized SVD's test matrices; ``None`` uses torch's
            global generator.

    Raises:
        ValueError: at construction, for ``kappa < 1`` (message explains the bulk edge), an
            unknown ``svd``, ``min_dim`` or ``rank`` < 1, ``oversampling`` or
            ``max_iterations`` < 0, or ``tol`` not in ``(0, 1)``; at call time, for a
            non-finite gradient (nothing is written then), or if ``sigma_e`` cannot be formed
            (:func:`noise_std_from_optimizer`).
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
        #: The validated record of the nine options (:class:`~opacus_rc.denoising.DenoiseOptions`).
        self.options = DenoiseOptions(
            kappa=kappa,
            norm_correction=norm_correction,
            min_dim=min_dim,
            svd=svd,
            rank=rank,
            oversampling=oversampling,
            tol=tol,
            max_iterations=max_iterations,
            generator=generator,
        )
        self._report: DenoiseReport | None = None
        self._pending: _PendingReport | None = None
        self._skips_logged = False

    @classmethod
    def from_options(cls, options: DenoiseOptions) -> SpectralDenoiser:
        """The denoiser of an existing :class:`~opacus_rc.denoising.DenoiseOptions` record."""
        if not isinstance(options, DenoiseOptions):
            raise TypeError(f"options must be a DenoiseOptions, got {type(options).__name__}")
        return cls(**{name: getattr(options, name) for name in DenoiseOptions.names()})

    def __getattr__(self, name: str) -> Any:
        # self.kappa, self.svd, ...: read from the one record (set in __init__).
        if name in DenoiseOptions.names() and "options" in self.__dict__:
            return getattr(self.__dict__["options"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(kappa={self.kappa}, norm_correction={self.norm_correction}, "
            f"min_dim={self.min_dim}, svd={self.svd!r})"
        )

    @property
    def last_report(self) -> DenoiseReport | None:
        """:class:`~opacus_rc.denoising.DenoiseReport` of the last call (``None`` before the
        first); its numbers are read from the device on first access after a call."""
        if self._pending is not None:
            self._report, self._pending = self._pending.resolve(), None
        return self._report

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

    def __call__(self, optimizer: Any) -> None:
        """Denoise ``p.grad`` in place for every eligible parameter of ``optimizer.params``.

        Args:
            optimizer: An Opacus ``DPOptimizer`` after ``add_noise`` and ``scale_grad`` (see
                :func:`noise_std_from_optimizer` for the attributes read).

        Raises:
            ValueError: if a gradient to denoise has non-finite entries (then no gradient is
                changed), or ``sigma_e`` cannot be formed.
            NotImplementedError: if ``optimizer.world_size > 1``.
        """
        _refuse_distributed(optimizer)
        params: Sequence[Tensor] = list(optimizer.params)
        statuses = [_classify(p.grad, min_dim=self.min_dim) for p in params]
        eligible = any(st is None for st in statuses)
        noise_std = noise_std_from_optimizer(optimizer) if eligible else 0.0
        self._log_skips(params, statuses)
        pending = _denoise_gradients_(params, statuses, noise_std=noise_std, options=self.options)
        self._report, self._pending = None, pending
        if logger.isEnabledFor(logging.DEBUG):  # counting reads the device
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


#: The values of ``make_private(denoise=...)``: ``"spectral"`` (:class:`SpectralDenoiser`).
DENOISERS = ("spectral",)


def make_denoiser(name: str, *, kappa: float | None = None, **options: Any) -> SpectralDenoiser:
    """Build the denoiser ``make_private(denoise=name)`` attaches.

    Example:
        >>> make_denoiser("spectral", kappa=1.2)
        SpectralDenoiser(kappa=1.2, norm_correction=True, min_dim=2, svd='exact')

    Args:
        name: One of :data:`DENOISERS`.
        kappa: Threshold factor, or ``None`` for :data:`~opacus_rc.denoising.DEFAULT_KAPPA`.
        **options: Further keyword arguments of :class:`SpectralDenoiser` (e.g. ``svd``,
            ``min_dim``, ``norm_correction``).

    Returns:
        The denoiser, a callable ``denoiser(optimizer) -> None``.

    Raises:
        ValueError: If ``name`` is not one of :data:`DENOISERS` (the message lists them), or a
            value is refused (e.g. ``kappa < 1``).
        TypeError: If an option name or type is refused.
    """
    validate_choice("denoise", name, DENOISERS)
    return SpectralDenoiser(kappa=DEFAULT_KAPPA if kappa is None else kappa, **options)
