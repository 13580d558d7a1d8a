"""The default envelope ``"chi2"``: ``F_env(y) = P(chi2_k <= k y)``, the exact supremum.

It is attained by rank-one gradients; proved for ``k >= 2``
(``docs/privacy/envelope.md#envelope-claim-l``).

Law of ``S``: an atom ``P(S = 1) = P(chi2_k >= k)`` and the density
``rho(s) = (2k / s^3) f_{chi2_k}(k / s^2)`` on ``s > 1``; ``P(S > s) = P(chi2_k < k / s^2)``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from opacus_rc.accountants.analysis.envelopes.law import EnvelopeLaw, register_envelope

__all__ = ["Chi2Law"]


@register_envelope("chi2")
class Chi2Law(EnvelopeLaw):
    """``W_env = min(chi2_k / k, 1)`` (``docs/privacy/envelope.md#envelope-law``)."""

    def __init__(self, k: int) -> None:
        self.k = float(k)

    def w_cdf(self, y: np.ndarray) -> np.ndarray:
        return special.gammainc(self.k / 2.0, self.k * y / 2.0)

    def atoms(self) -> tuple[tuple[float, float], ...]:
        k = self.k
        return ((1.0, float(special.gammaincc(k / 2.0, k / 2.0))),)

    def logsf(self, s: np.ndarray) -> np.ndarray:
        # P(S > s) = P(chi2_k < k / s^2)
        k = self.k
        y = 1.0 / (s * s)
        with np.errstate(divide="ignore"):
            return np.log(special.gammainc(k / 2.0, k * y / 2.0))

    def cdf(self, s: np.ndarray) -> np.ndarray:
        k = self.k
        y = 1.0 / (s * s)
        return special.gammaincc(k / 2.0, k * y / 2.0)

    def logpdf(self, s: np.ndarray) -> np.ndarray:
        k = self.k
        x = k * (1.0 / (s * s))
        logf = (
            (k / 2.0 - 1.0) * np.log(x)
            - x / 2.0
            - (k / 2.0) * math.log(2.0)
            - special.gammaln(k / 2.0)
        )
        return math.log(2.0 * k) - 3.0 * np.log(s) + logf

    def isf(self, p: np.ndarray) -> np.ndarray:
        k = self.k
        top = 1.0 - self.atoms()[0][1]  # P(S > 1)
        x = special.gammaincinv(k / 2.0, np.minimum(p, top))  # = k / (2 s^2)
        return np.where(p >= top, 1.0, np.sqrt(k / (2.0 * x)))

    def breaks(self) -> tuple[float, ...]:
        return ()

    def mean(self, y_top: float = 1.0) -> float:
        """``E[S; W < y_top] + P(W >= y_top)`` with ``S = W^{-1/2}``, ``W = chi2_k / k``."""
        k = self.k
        log_ratio = special.gammaln((k - 1) / 2.0) - special.gammaln(k / 2.0)
        cont = (
            math.sqrt(k / 2.0)
            * math.exp(log_ratio)
            * special.gammainc((k - 1) / 2.0, k * y_top / 2.0)
        )
        return float(cont + (self.atoms()[0][1] if y_top == 1.0 else 0.0))
