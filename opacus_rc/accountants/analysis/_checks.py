"""The accountant's historical names for the validators of :mod:`opacus_rc.validation`.

Kept so that existing imports keep working; new code calls :mod:`opacus_rc.validation`.
"""

from __future__ import annotations

from opacus_rc.validation import (
    validate_choice,
    validate_delta,
    validate_noise_multiplier,
    validate_sample_rate,
)

__all__ = ["check_choice", "check_delta", "check_q", "check_sigma"]

check_choice = validate_choice
check_delta = validate_delta
check_q = validate_sample_rate


def check_sigma(noise_multiplier: float, *, allow_zero: bool = False) -> float:
    """:func:`opacus_rc.validation.validate_noise_multiplier`, refusing 0 unless ``allow_zero``."""
    return validate_noise_multiplier(noise_multiplier, allow_zero=allow_zero)
