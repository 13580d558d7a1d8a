"""Spectral denoising of noisy DP gradients (Dadsetan and Rudzicz, arXiv:2510.01137).

Post-processing of the released noisy gradient: each 2-D gradient's singular values are shrunk by
the Gavish-Donoho Frobenius-optimal shrinker and the result is rescaled to the noisy Frobenius
norm (``THEORY.md`` section E). See :mod:`opacus_rc.denoising.spectral`; ``make_private(denoise=...)``
resolves names through :mod:`opacus_rc.denoising.registry`.
"""

from opacus_rc.denoising.registry import (
    DenoiserFactory,
    denoiser_names,
    make_denoiser,
    register_denoiser,
)
from opacus_rc.denoising.spectral import (
    DEFAULT_KAPPA,
    DEFAULT_MIN_DIM,
    SVD_METHODS,
    DenoiseRecord,
    DenoiseReport,
    SpectralDenoiser,
    denoise_matrix,
    frobenius_shrinker,
    noise_std_from_optimizer,
    optimal_shrinkage,
    shrink_singular_values,
)

__all__ = [
    "DEFAULT_KAPPA",
    "DEFAULT_MIN_DIM",
    "SVD_METHODS",
    "DenoiseRecord",
    "DenoiseReport",
    "DenoiserFactory",
    "SpectralDenoiser",
    "denoise_matrix",
    "denoiser_names",
    "frobenius_shrinker",
    "make_denoiser",
    "noise_std_from_optimizer",
    "optimal_shrinkage",
    "register_denoiser",
    "shrink_singular_values",
]
