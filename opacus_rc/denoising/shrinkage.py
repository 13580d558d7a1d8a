r"""Gavish-Donoho optimal singular-value shrinkage for Frobenius loss (pure math, no Opacus).

Source: Gavish and Donoho, "Optimal Shrinkage of Singular Values", IEEE Trans. Inf. Theory
63(4):2137-2152, 2017 (arXiv:1405.7511), Frobenius (MSE) loss; equivalent to the asymptotic
reconstruction of Shabalin and Nobel 2013, JMVA 118. The formulas, the spiked-model facts used
as test oracles and the reference values are in ``docs/denoising.md#denoising-shrinker``.

The functions act on singular values only (element-wise tensor operations, no SVD, no host
synchronisation); :mod:`opacus_rc.denoising.denoiser` applies them to matrices.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["frobenius_shrinker", "shrink_singular_values"]


def _check_noise_std(noise_std: float) -> float:
    """``noise_std`` as a float; ``TypeError`` if not a real number, ``ValueError`` if negative
    or non-finite."""
    try:
        value = float(noise_std)
    except (TypeError, ValueError) as err:
        raise TypeError(f"noise_std must be a real number, got {type(noise_std).__name__}") from err
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"noise_std must be finite and >= 0, got {noise_std}")
    return value


def _check_positive_int(value: int, name: str, minimum: int = 1) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``; else ``TypeError``/``ValueError``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def frobenius_shrinker(y: Tensor | float, *, beta: float) -> Tensor:
    r"""Gavish-Donoho Frobenius-optimal shrinker in normalised units, :math:`\eta^*(y; \beta)`.

    .. math::
        \eta^*(y) = \frac{\sqrt{(y^2 - \beta - 1)^2 - 4\beta}}{y}
                  = \frac{\sqrt{(y^2 - (1+\sqrt\beta)^2)(y^2 - (1-\sqrt\beta)^2)}}{y}
        \quad \text{if } y > 1 + \sqrt\beta, \text{ else } 0.

    Source: Gavish and Donoho 2017, the optimal shrinker for Frobenius loss;
    docs/denoising.md#denoising-shrinker. The factored form (used here) avoids the cancellation of
    the expanded one near the edge. In the spiked model, :math:`\eta^*(y(x)) = x\,c(x)\,\tilde c(x)`
    (docs/denoising.md#denoising-shrinker), which the tests use as an independent check.

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
    # One reduction, one host read: the validation of this public function.
    if bool((~torch.isfinite(y_t) | (y_t < 0)).any()):
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

    Raw units (docs/denoising.md#denoising-shrinker), with :math:`\sigma = \sigma_e` the noise entry
    standard deviation:

    .. math::
        \hat s = \frac{\sqrt{\big(s^2 - \sigma^2(\sqrt m + \sqrt n)^2\big)
                             \big(s^2 - \sigma^2(\sqrt n - \sqrt m)^2\big)}}{s}
        \quad \text{if } s > \sigma(\sqrt m + \sqrt n), \text{ else } 0,

    which equals :math:`\sigma\sqrt{n}\,\eta^*(s / (\sigma\sqrt n); m/n)` for ``m <= n``
    (Gavish and Donoho 2017, Frobenius loss) and is symmetric in ``(m, n)``. With
    ``noise_std = 0`` it is the identity. Element-wise; no host synchronisation.

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
