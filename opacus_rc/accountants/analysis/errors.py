"""Errors of the randomized-clipping accountant."""

from __future__ import annotations

__all__ = ["EpsilonOutOfRangeError"]


class EpsilonOutOfRangeError(RuntimeError):
    """The epsilon of a configuration exceeds what the PRV accountant can represent.

    Raised instead of returning a number that could be too small: the mass at infinity (the
    capped envelope tail ``eta`` plus the loss above the largest cap, 200) reaches delta, the
    discretisation domain would be too large, or prv_accountant cannot locate epsilon. Increase
    the noise multiplier, the sketch dimension or delta.
    """
