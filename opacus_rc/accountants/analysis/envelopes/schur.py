"""The proved fallback envelope ``"schur"`` (``docs/privacy/envelope.md#envelope-schur``).

``P(chi2_k <= k y)`` for ``y < y0 = 1 - 2/k`` (the Schur-convexity region, ``k >= 3``; empty for
``k <= 2``) and, on ``[y0, 1)``, the convex-order hinge bound
``h(y) = inf_{c > y} E(c - Y)_+ / (c - y)`` with ``Y = chi2_k / k``, which never exceeds the
Chernoff bound. ``h(y) = P(Y <= c*)`` where ``c*`` solves ``E[Y | Y <= c*] = y``. Law of ``S``:
no atom at 1, an atom at ``s* = y0^{-1/2}`` of mass ``h(y0) - P(chi2_k <= k y0)``, the
``"chi2"`` density above ``s*``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import integrate, special

from opacus_rc.accountants.analysis.envelopes.chi2 import Chi2Law
from opacus_rc.accountants.analysis.envelopes.law import EnvelopeLaw, register_envelope
from opacus_rc.accountants.analysis.envelopes.quadrature import gauss_legendre, log_s_quadrature

__all__ = ["SchurLaw"]


def _conditional_mean(c: np.ndarray, a: float) -> np.ndarray:
    """``E[Y | Y <= c]`` for ``Y = chi2_k / k`` (``a = k/2``).

    Size bias: ``y f_Y(y)`` is the density of ``chi2_{k+2} / k``, so
    ``E[Y; Y <= c] = P(chi2_{k+2} <= k c)``.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        return special.gammainc(a + 1.0, a * c) / special.gammainc(a, a * c)


def _hinge_root(y: np.ndarray, a: float) -> np.ndarray:
    """The minimiser ``c*(y) > y`` of ``E(c - Y)_+ / (c - y)``: the root of ``E[Y|Y<=c] = y``.

    ``c -> E[Y | Y <= c]`` increases from 0 to 1, so for ``y`` in ``(0, 1)`` the root is unique;
    it is found by bisection in ``log c`` (vectorised; 90 halvings of a bracket at most ~80
    nats wide reach the double-precision resolution of ``c``).
    """
    lo = np.log(y)  # E[Y | Y <= y] < y
    hi = np.log(np.maximum(2.0 * y * (a + 1.0) / a, 2.0))
    for _ in range(64):  # widen until E[Y | Y <= e^hi] >= y (or rounding makes it 1)
        short = _conditional_mean(np.exp(hi), a) < y
        if not np.any(short):
            break
        hi = np.where(short, hi + math.log(2.0), hi)
    for _ in range(90):
        mid = 0.5 * (lo + hi)
        below = _conditional_mean(np.exp(mid), a) < y
        lo = np.where(below, mid, lo)
        hi = np.where(below, hi, mid)
    return np.exp(hi)


@register_envelope("schur")
class SchurLaw(EnvelopeLaw):
    """The fallback envelope "schur" (``docs/privacy/envelope.md#envelope-schur``).

    With ``y0 = 1 - 2/k`` (0 for ``k <= 2``) and the hinge bound ``h``: ``F_env(y) =
    P(chi2_k <= k y)`` for ``y < y0`` and ``h(y)`` on ``[y0, 1)``. It is non-decreasing and
    right-continuous, with an upward jump at ``y0``. The hinge part is best parameterised by
    ``c = c*(y)``: ``y = E[Y | Y <= c]`` and ``h = F_Y(c)``, so on ``(1, s*)`` the law of ``S`` is
    that of ``E[Y | Y <= c]^{-1/2}`` with ``c ~ Y`` restricted to ``c > c*(y0)``.
    """

    def __init__(self, k: int) -> None:
        self.k = float(k)
        self.a = self.k / 2.0
        self.y0 = 1.0 - 2.0 / self.k if k >= 3 else 0.0
        self.s_star = self.y0**-0.5 if self.y0 > 0.0 else math.inf
        self._chi2 = Chi2Law(k)

    def _hinge(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(h(y), 1 - h(y), h'(y))`` for ``y`` in ``(0, 1)``.

        ``h = P(Y <= c*)``; envelope theorem: ``h' = h / (c* - y)``.
        """
        c = _hinge_root(y, self.a)
        h = special.gammainc(self.a, self.a * c)
        return h, special.gammaincc(self.a, self.a * c), h / (c - y)

    def _fill(self) -> float:
        return 0.5 * (1.0 + self.y0)  # a harmless argument for masked-out entries

    def w_cdf(self, y: np.ndarray) -> np.ndarray:
        up = y >= self.y0
        return np.where(up, self._hinge(np.where(up, y, self._fill()))[0], self._chi2.w_cdf(y))

    def atoms(self) -> tuple[tuple[float, float], ...]:
        if self.y0 <= 0.0:
            return ()
        y0 = np.array([self.y0])
        return ((self.s_star, float(self._hinge(y0)[0][0] - self._chi2.w_cdf(y0)[0])),)

    def logsf(self, s: np.ndarray) -> np.ndarray:
        # P(S > s) = F_env(s^{-2}-): h(s^{-2}) on (1, s*), the chi2 law from s* on
        mid = (s > 1.0) & (s < self.s_star)
        h = self._hinge(np.where(mid, 1.0 / (s * s), self._fill()))[0]
        with np.errstate(divide="ignore"):
            return np.where(s <= 1.0, 0.0, np.where(mid, np.log(h), self._chi2.logsf(s)))

    def cdf(self, s: np.ndarray) -> np.ndarray:
        mid = (s > 1.0) & (s < self.s_star)
        one_minus_h = self._hinge(np.where(mid, 1.0 / (s * s), self._fill()))[1]
        return np.where(s <= 1.0, 0.0, np.where(mid, one_minus_h, self._chi2.cdf(s)))

    def logpdf(self, s: np.ndarray) -> np.ndarray:
        mid = s < self.s_star
        slope = self._hinge(np.where(mid, 1.0 / (s * s), self._fill()))[2]
        with np.errstate(divide="ignore"):
            upper = np.log(slope) + math.log(2.0) - 3.0 * np.log(s)  # -d/ds h(s^{-2})
        return np.where(mid, upper, self._chi2.logpdf(s))

    def isf(self, p: np.ndarray) -> np.ndarray:
        # p <= P(chi2_k < k y0): the chi2 tail (s >= s*); up to h(y0): the atom s*; above:
        # s = y^{-1/2} with y = h^{-1}(p) = E[Y | Y <= F_Y^{-1}(p)]
        tail, top = 0.0, 0.0
        if self.y0 > 0.0:
            y0 = np.array([self.y0])
            tail, top = float(self._chi2.w_cdf(y0)[0]), float(self._hinge(y0)[0][0])
        pp = np.clip(p, max(top, np.finfo(float).tiny), 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            y = _conditional_mean(special.gammaincinv(self.a, pp) / self.a, self.a)
            s_up = np.where(pp >= 1.0, 1.0, 1.0 / np.sqrt(y))
        # k <= 2: no chi2 part
        s_tail = self._chi2.isf(np.minimum(p, tail)) if tail > 0.0 else np.full_like(p, math.inf)
        return np.where(p <= tail, s_tail, np.where(p <= top, self.s_star, s_up))

    def breaks(self) -> tuple[float, ...]:
        return (self.s_star,) if self.y0 > 0.0 else ()

    def mean(self) -> float:
        a = self.a
        c_lo = float(_hinge_root(np.array([self.y0]), a)[0]) if self.y0 > 0.0 else 0.0

        def integrand(v: float) -> float:  # in v = log c: E[Y|Y<=c]^{-1/2} f_Y(c) c
            c = math.exp(v)
            log_fy = math.log(a) + (a - 1.0) * math.log(a * c) - a * c - special.gammaln(a)
            m = float(_conditional_mean(np.array([c]), a)[0])
            return math.exp(log_fy + v) / math.sqrt(m)

        v_lo = math.log(c_lo) if c_lo > 0.0 else math.log(float(special.gammaincinv(a, 1e-30)) / a)
        v_hi = math.log(float(special.gammainccinv(a, 1e-30)) / a)
        hinge, _ = integrate.quad(integrand, v_lo, v_hi, epsabs=0.0, epsrel=1e-13, limit=200)
        if self.y0 <= 0.0:
            return hinge
        ((s_star, mass),) = self.atoms()
        return hinge + s_star * mass + self._chi2.mean(self.y0)

    def quadrature(self, s_max: float, eta: float, panels: int, order: int):
        """Nodes (increasing) and weights on ``[1, s_max]``, in up to three parts.

        * Hinge part, ``S`` in ``(1, s*)``: ``S = E[Y | Y <= c]^{-1/2}`` with ``c ~ Y`` on
          ``(c_lo, inf)``, where ``c_lo = c*(y0)`` (``k >= 3``) or ``F_Y^{-1}(eta)``
          (``k <= 2``, the hinge part then reaches ``s_max``). Gauss-Legendre in ``log c`` on
          ``[c_lo, c_hi]``, weight ``f_Y(c) c d(log c)``: smooth, unlike the density of ``S``
          near 1. The mass ``P(Y > c_hi) = 1e-17`` (``S`` in ``(1, E[Y | Y <= c_hi]^{-1/2})``)
          sits at that interval's top, which can only be conservative
          (``docs/privacy/dominance.md``).
        * The atom at ``s*``.
        * The "chi2" part on ``[s*, s_max]``, Gauss-Legendre in ``log s``.

        Each continuous part gets ``panels // 2`` panels (all of them for ``k <= 2``).
        """
        a = self.a
        if self.y0 > 0.0:
            parts = max(1, panels // 2)
            c_lo = float(_hinge_root(np.array([self.y0]), a)[0])
        else:
            parts = panels
            c_lo = float(special.gammaincinv(a, eta)) / a
        c_hi = float(special.gammainccinv(a, 1e-17)) / a
        v, dv = gauss_legendre(math.log(c_lo), math.log(c_hi), parts, order)
        c = np.exp(v)
        log_fy = math.log(a) + (a - 1.0) * np.log(a * c) - a * c - special.gammaln(a)
        s = [1.0 / np.sqrt(_conditional_mean(c[::-1], a))]
        w = [(np.exp(log_fy + v) * dv)[::-1]]
        s.insert(0, [1.0 / math.sqrt(float(_conditional_mean(np.array([c_hi]), a)[0]))])
        w.insert(0, [float(special.gammaincc(a, a * c_hi))])
        for loc, mass in self.atoms():
            s.append([loc])
            w.append([mass])
            s_c, w_c = log_s_quadrature(self._chi2, loc, s_max, parts, order)
            s.append(s_c)
            w.append(w_c)
        return np.concatenate(s), np.concatenate(w)
