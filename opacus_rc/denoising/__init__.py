"""Spectral denoising of noisy DP gradients (Dadsetan and Rudzicz, arXiv:2510.01137).

Post-processing of the released noisy gradient: each 2-D gradient's singular values are shrunk by
the Gavish-Donoho Frobenius-optimal shrinker and the result is rescaled to the noisy Frobenius
norm (``docs/denoising.md#denoising``). One concept per module:

* :mod:`~opacus_rc.denoising.shrinkage`: the shrinker on singular values (pure math);
* :mod:`~opacus_rc.denoising.svd`: SVD back ends (exact, randomized), resolved by name;
* :mod:`~opacus_rc.denoising.denoiser`: the matrix denoiser (threshold test, shrinkage, norm
  correction) and its defaults;
* :mod:`~opacus_rc.denoising.options`: its nine options as one validated record,
  :class:`DenoiseOptions`;
* :mod:`~opacus_rc.denoising.checks`: the checks of its arguments (threshold factor, matrix);
* :mod:`~opacus_rc.denoising.batch`: its batched core on equal-shape matrices;
* :mod:`~opacus_rc.denoising.records`: the records and reports of what it did;
* :mod:`~opacus_rc.denoising.gradients`: denoising a list of gradients in place;
* :mod:`~opacus_rc.denoising.opacus_adapter`: what reads an Opacus DP optimizer (the noise level,
  the refusal of distributed optimizers), :class:`SpectralDenoiser`, its step hook, and
  :func:`make_denoiser`, which builds it for ``make_private(denoise=...)``.
"""

from opacus_rc.denoising.denoiser import (
    DEFAULT_KAPPA,
    DEFAULT_MIN_DIM,
    DenoiseRecord,
    DenoiseReport,
    denoise_matrix,
    optimal_shrinkage,
)
from opacus_rc.denoising.opacus_adapter import (
    DENOISERS,
    SpectralDenoiser,
    make_denoiser,
    noise_std_from_optimizer,
)
from opacus_rc.denoising.options import DenoiseOptions
from opacus_rc.denoising.shrinkage import frobenius_shrinker, shrink_singular_values
from opacus_rc.denoising.svd import SVD_METHODS

__all__ = [
    "DEFAULT_KAPPA",
    "DEFAULT_MIN_DIM",
    "DENOISERS",
    "SVD_METHODS",
    "DenoiseOptions",
    "DenoiseRecord",
    "DenoiseReport",
    "SpectralDenoiser",
    "denoise_matrix",
    "frobenius_shrinker",
    "make_denoiser",
    "noise_std_from_optimizer",
    "optimal_shrinkage",
    "shrink_singular_values",
]
