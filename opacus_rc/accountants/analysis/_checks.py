"""Validation of the accountant's scalar parameters (one place, shared by every module)."""

from __future__ import annotations

import math

__all__ = ["check_choice", "check_delta", "check_q", "check_sigma"]


def check_sigma(noise_multiplier: float, *, allow_zero: bool = False) -> float:
    """``noise_multiplier`` as a float: finite and > 0 (noise std / clipping bound), or exactly
    0 where ``allow_zero`` (a step without noise, whose epsilon is infinite)."""
    try:
        sigma = float(noise_multiplier)
    except (TypeError, ValueError):
        raise TypeError(f"noise_multiplier must be a number, got {noise_multiplier!r}") from None
    if allow_zero and sigma == 0.0:
        return 0.0
    if not (sigma > 0.0 and math.isfinite(sigma)):
        zero = " or 0 (a step without noise)" if allow_zero else ""
        raise ValueError(
            f"noise_multiplier must be a finite number > 0{zero} (noise std / clipping "
            f"bound), got {noise_multiplier!r}"
        )
    return sigma


def check_q(sample_rate: float) -> float:
    """``sample_rate`` as a float in ``(0, 1]`` (Poisson sampling probability)."""
    try:
        q = float(sample_rate)
    except (TypeError, ValueError):
        raise TypeError(f"sample_rate must be a number, got {sample_rate!r}") from None
    if not 0.0 < q <= 1.0:
        raise ValueError(
            f"sample_rate must be in (0, 1] (Poisson sampling probability), got {sample_rate!r}"
        )
    return q


def check_delta(delta: float) -> float:
    """``delta`` as a float in ``(0, 1)``."""
    try:
        d = float(delta)
    except (TypeError, ValueError):
        raise TypeError(f"delta must be a number, got {delta!r}") from None
    if not 0.0 < d < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return d


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
