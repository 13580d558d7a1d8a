"""Errors of the randomized-clipping accountant: a privacy answer versus a numerical limit.

* :class:`EpsilonOutOfRangeError`: epsilon exceeds every value the analysis certifies at this
  delta (the mass at infinity of the composed privacy loss, from the envelope's revealing tail
  and the loss above the largest cap, reaches delta). This *is* an answer about privacy: more
  noise, a larger sketch or a larger delta helps.
* :class:`NumericalLimitError`: the accountant cannot compute epsilon to the requested
  ``eps_error`` within its numerical limits (FFT length, tail resolution). This says nothing
  about epsilon; a larger ``eps_error`` helps. A noise-multiplier search must never read it as
  "epsilon too large".

Both derive from :class:`AccountingError`, and neither from the other.
"""

from __future__ import annotations

__all__ = ["AccountingError", "EpsilonOutOfRangeError", "NumericalLimitError"]


class AccountingError(RuntimeError):
    """Base class: the accountant could not return an epsilon bound."""


class EpsilonOutOfRangeError(AccountingError):
    """Epsilon exceeds every value the analysis certifies at this delta (a privacy answer).

    Raised instead of returning a number that could be too small, when the mass at infinity of
    the composed privacy loss (the revealing tail of the envelope plus the loss above the
    largest cap, 200) reaches ``delta - delta_error``. Increase the noise multiplier, the sketch
    dimension or delta.
    """


class NumericalLimitError(AccountingError):
    """The accountant cannot compute epsilon at the requested ``eps_error`` (a numerical limit).

    Not a statement about epsilon: the FFT the composition needs is longer than the limit, or
    the tail cannot be resolved. Increase ``eps_error``; the message names an ``eps_error``
    that fits when it can.

    Args:
        message: The explanation.
        factor: If known, the factor by which the mesh (hence ``eps_error``, to which every
            mesh is proportional) must at least grow for the vector that hit the limit to fit.
    """

    def __init__(self, message: str, *, factor: float | None = None) -> None:
        super().__init__(message)
        self.factor = factor
