"""Validators of the scalar options shared across the package, one function per option.

Every public entry point (the engine, the grad-sample module's config, the optimizer, the
accountant and its events, the sketches, the envelope, the trainer integration, the audit) checks
a sketch dimension, a clipping bound, a noise multiplier, a sampling rate or a delta by calling
the function here, so the same value is accepted or refused with the same message everywhere
(docs/architecture.md#architecture-concepts). Pure Python: no torch, Opacus or numpy import.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = [
    "validate_choice",
    "validate_delta",
    "validate_max_grad_norm",
    "validate_noise_multiplier",
    "validate_sample_rate",
    "validate_sketch_dim",
]


def validate_sketch_dim(value: Any, name: str = "sketch_dim", *, allow_none: bool = False):
    """Check a sketch dimension ``k`` (number of Gaussian sketch columns) and return it.

    Args:
        value: The candidate number of columns: an integer >= 1 (Python or numpy integer), or
            ``None`` where ``allow_none`` (exact clipping, no sketch).
        name: The argument name used in the error message (``"sketch_dim"``, ``"head_dim"``,
            ``"sketch_head_dim"``).
        allow_none: Whether ``None`` (exact clipping) is accepted.

    Returns:
        ``int(value)``, or ``None``.

    Raises:
        TypeError: If ``value`` is not an integer (``bool`` and floats are rejected).
        ValueError: If ``value < 1``.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        extra = " >= 1 or None (exact clipping)" if allow_none else ""
        raise TypeError(f"{name} must be an int{extra}, got {type(value).__name__}")
    if value < 1:
        hint = f"; use {name}=None for exact clipping" if allow_none else ""
        raise ValueError(
            f"{name} must be >= 1, got {value} (the number of Gaussian sketch columns){hint}"
        )
    return int(value)


def validate_max_grad_norm(value: Any) -> float:
    """Check a flat clipping bound ``C`` and return it as a float.

    Args:
        value: The candidate ``max_grad_norm`` (units of the per-sample gradient's norm).

    Returns:
        ``float(value)``.

    Raises:
        TypeError: If ``value`` is not one real number (a list of per-layer bounds, a bool).
        ValueError: If ``value`` is not finite and > 0.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            "randomized clipping needs one float max_grad_norm (flat clipping); got "
            f"{type(value).__name__}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"max_grad_norm must be a finite number > 0, got {value}")
    return float(value)


def validate_noise_multiplier(value: Any, *, allow_zero: bool = True) -> float:
    """Check a noise multiplier ``sigma`` (noise std / clipping bound) and return it as a float.

    ``sigma = 0`` is a debugging run without noise, whose epsilon is infinite; it is accepted
    where ``allow_zero`` (the engine, the optimizer, the accountant's steps) and refused where a
    finite privacy loss must be computed from it (a PRV, an audit).

    Args:
        value: The candidate ``noise_multiplier``.
        allow_zero: Whether exactly 0 is accepted.

    Returns:
        ``float(value)``.

    Raises:
        TypeError: If ``value`` is not a real number (bools are rejected).
        ValueError: If ``value`` is not finite, negative, or 0 where ``allow_zero`` is False.
    """
    if isinstance(value, bool):
        raise TypeError(f"noise_multiplier must be a number, got {value!r}")
    try:
        sigma = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"noise_multiplier must be a number, got {value!r}") from None
    if allow_zero and sigma == 0.0:
        return 0.0
    if not (sigma > 0.0 and math.isfinite(sigma)):
        zero = ", or 0 for a step without noise" if allow_zero else ""
        raise ValueError(
            f"noise_multiplier must be a finite number > 0{zero} (noise std / clipping bound), "
            f"got {value!r}"
        )
    return sigma


def validate_sample_rate(value: Any) -> float:
    """Check a sampling rate ``q`` (Poisson sampling probability) and return it as a float.

    Args:
        value: The candidate ``sample_rate``.

    Returns:
        ``float(value)``, in ``(0, 1]``.

    Raises:
        TypeError: If ``value`` is not a number.
        ValueError: If ``value`` is not in ``(0, 1]``.
    """
    try:
        q = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"sample_rate must be a number, got {value!r}") from None
    if not 0.0 < q <= 1.0:
        raise ValueError(
            f"sample_rate must be in (0, 1] (Poisson sampling probability), got {value!r}"
        )
    return q


def validate_delta(value: Any, name: str = "delta") -> float:
    """Check a ``delta`` of ``(epsilon, delta)``-DP and return it as a float.

    Args:
        value: The candidate delta.
        name: The argument name used in the error message (``"delta"``, ``"target_delta"``).

    Returns:
        ``float(value)``, in ``(0, 1)``.

    Raises:
        TypeError: If ``value`` is not a number.
        ValueError: If ``value`` is not in ``(0, 1)``.
    """
    try:
        d = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None
    if not 0.0 < d < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return d


def validate_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Check that an option names one of ``choices``.

    Args:
        name: The argument name used in the error message.
        value: The candidate.
        choices: The accepted names.

    Raises:
        ValueError: Unless ``value`` is one of ``choices`` (the message lists them).
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
