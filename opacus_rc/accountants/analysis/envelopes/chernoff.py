"""The envelope ``"chernoff"``: ``P(W_env <= y) = (y e^{1-y})^{k/2}``, proved for every ``k``
(``docs/privacy/envelope.md#envelope-chernoff``; the independent cross-check).

Law of ``S``: no atom, ``P(S > s) = (s^{-2} e^{1 - s^{-2}})^{k/2}`` for ``s >= 1``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from opacus_rc.accountants.analysis.envelopes.law import EnvelopeLaw, register_envelope

__all__ = ["ChernoffLaw"]


@register_envelope("chernoff")
class ChernoffLaw(EnvelopeLaw):
    """``P(W_env <= y) = (y e^{1-y})^{k/2}`` (``docs/privacy/envelope.md#envelope-chernoff``)."""

    def __init__(self, k: int) -> None:
        self.k = float(k)

    def w_cdf(self, y: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return np.exp((self.k / 2.0) * (np.log(y) + 1.0 - y))

    def atoms(self) -> tuple[tuple[float, float], ...]:
        return ()

    def logsf(self, s: np.ndarray) -> np.ndarray:
        y = 1.0 / (s * s)
        return np.where(s <= 1.0, 0.0, (self.k / 2.0) * (np.log(y) + 1.0 - y))

    def cdf(self, s: np.ndarray) -> np.ndarray:
        y = 1.0 / (s * s)
        return -np.expm1((self.k / 2.0) * (np.log(y) + 1.0 - y))

    def logpdf(self, s: np.ndarray) -> np.ndarray:
        k = self.k
        y = 1.0 / (s * s)
        return math.log(k) - np.log(s) + np.log1p(-y) + (k / 2.0) * (np.log(y) + 1.0 - y)

    def isf(self, p: np.ndarray) -> np.ndarray:
        # s = y^{-1/2} with y = -W_0(-p^{2/k} / e) (Lambert W, principal branch)
        y = _chernoff_inverse(p, self.k)
        with np.errstate(divide="ignore"):
            s = 1.0 / np.sqrt(y)
        return np.where(p >= 1.0, 1.0, s)

    def breaks(self) -> tuple[float, ...]:
        return ()


def _chernoff_inverse(p: np.ndarray, k: float) -> np.ndarray:
    """The ``y`` in ``(0, 1]`` with ``(y e^{1-y})^{k/2} = p``."""
    arg = -np.exp((2.0 / k) * np.log(p) - 1.0)
    return -np.real(special.lambertw(arg, 0))
