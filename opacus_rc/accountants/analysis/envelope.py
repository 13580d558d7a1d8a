"""Law of the worst-case per-sample sensitivity ``S`` of randomized clipping (the "envelope").

Randomized clipping scales sample ``i`` by ``c_i = min(1, C / sqrt(n_hat_i))`` where
``n_hat_i = n_i W_i`` is a Gaussian sketch (Hutchinson, ``k`` columns) of the squared gradient
norm ``n_i``. The contribution of the differing record has norm at most ``S = C W^{-1/2}``
(``docs/privacy/mechanism.md#mechanism-sensitivity``), so the sensitivity is a random
variable. Its law depends on the (unknown) spectrum of the per-sample gradient; this module
implements upper bounds ``F_env(y)`` on ``sup P(W <= y)`` over all spectra, the *envelopes*,
and the law of ``S = W_env^{-1/2}`` they induce, in units of the clipping bound ``C``
(definitions and proofs: ``docs/privacy/envelope.md``). Every envelope is 1 for ``y >= 1``
(``#envelope-above-one``). Below 1:

* ``envelope="chi2"`` (default): ``F_env(y) = P(chi2_k <= k y)``, the exact supremum, attained
  by rank-one gradients ("Claim L"). **Proved for k >= 2**
  (``docs/privacy/envelope.md#envelope-claim-l``). At ``k = 1`` the proof does not apply
  (``#envelope-k1``): the law is still computed, but its accounting uses (:meth:`quadrature`,
  :func:`envelope_cdf`) raise a :class:`UserWarning` saying so; ``"schur"`` and ``"chernoff"``
  are proved at ``k = 1``. Law: an atom ``P(S = 1) = P(chi2_k >= k)`` and the density
  ``rho(s) = (2k / s^3) f_{chi2_k}(k / s^2)`` on ``s > 1``; ``P(S > s) = P(chi2_k < k / s^2)``.
* ``envelope="schur"`` (the proved fallback, ``docs/privacy/envelope.md#envelope-schur``):
  ``P(chi2_k <= k y)`` for ``y < y0 = 1 - 2/k`` (the Schur-convexity region, ``k >= 3``; empty
  for ``k <= 2``) and, on ``[y0, 1)``, the convex-order hinge bound
  ``h(y) = inf_{c > y} E(c - Y)_+ / (c - y)`` with ``Y = chi2_k / k``, which never exceeds the
  Chernoff bound. ``h(y) = P(Y <= c*)`` where ``c*`` solves ``E[Y | Y <= c*] = y``, i.e.
  ``P(chi2_{k+2} <= k c*) = y P(chi2_k <= k c*)``. Law: no atom at 1, an atom at
  ``s* = y0^{-1/2}`` of mass ``h(y0) - P(chi2_k <= k y0)``, the ``"chi2"`` density above ``s*``.
* ``envelope="chernoff"`` (proved for every ``k``, ``docs/privacy/envelope.md#envelope-chernoff``;
  the independent cross-check): no atom, ``P(S > s) = (s^{-2} e^{1 - s^{-2}})^{k/2}`` for
  ``s >= 1``.
* ``sketch_dim=None`` is exact clipping: ``S = 1`` almost surely.

Assumptions, stated first as in the monotone-loss classes this module imitates: ``S >= 1``
always; a stochastically larger ``S`` is a worse mechanism in both threat models and both
adjacency directions (``docs/privacy/dominance.md``), which is what makes an envelope (a
pointwise upper bound on ``P(S > s)``) a valid replacement for the true, spectrum-dependent law.
The right tail is polynomial, ``P(S > s) ~ c_k s^{-k}`` (``docs/privacy/heavy_tails.md``), so
every Renyi divergence is infinite.

Pure numpy/scipy; no Opacus import.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import numpy as np
from scipy import integrate, special

from opacus_rc.registry import Registry
from opacus_rc.validation import validate_sketch_dim

__all__ = [
    "ENVELOPES",
    "EnvelopeQuadrature",
    "SensitivityEnvelope",
    "envelope_cdf",
]

#: Default capped tail mass of the quadrature (``docs/privacy/prv.md#prv-quadrature``).
DEFAULT_ETA = 1e-15


# =============================================================================================
# The laws, one class per envelope (a registry, not if/elif chains)
# =============================================================================================
# Each law is defined for a fixed k and handles the interior of its domain only: ``w_cdf`` gets
# y in (0, 1), the ``s`` methods get s >= 1 (``logpdf``: s > 1). SensitivityEnvelope does the
# edges, the validation and exact clipping.


class _Law:
    """Shared parts of the laws: the default quadrature (``docs/privacy/prv.md#prv-quadrature``)
    and the mean."""

    def mean(self) -> float:
        """``E S = 1 + integral_1^inf P(S > s) ds`` by adaptive quadrature."""
        sf = lambda s: float(np.exp(self.logsf(np.array([s]))[0]))  # noqa: E731
        val, _ = integrate.quad(sf, 1.0, np.inf, epsabs=1e-14, limit=200)
        return 1.0 + val

    def quadrature(self, s_max: float, eta: float, panels: int, order: int):
        """Nodes (increasing) and weights on ``[1, s_max]``: Gauss-Legendre in ``log s`` over
        the continuous part, each atom a node of its own."""
        s, w = _log_s_quadrature(self, 1.0, s_max, panels, order)
        for loc, mass in self.atoms():
            at = int(np.searchsorted(s, loc))
            s, w = np.insert(s, at, loc), np.insert(w, at, mass)
        return s, w


class _Chi2Law(_Law):
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


class _ChernoffLaw(_Law):
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


def _gauss_legendre(lo: float, hi: float, panels: int, order: int) -> tuple[np.ndarray, ...]:
    """Composite Gauss-Legendre nodes and weights on ``[lo, hi]`` (``panels`` equal panels)."""
    gl_x, gl_w = np.polynomial.legendre.leggauss(order)
    edges = np.linspace(lo, hi, panels + 1)
    half = np.diff(edges)[:, None] / 2.0
    mid = (edges[:-1] + edges[1:])[:, None] / 2.0
    return (mid + half * gl_x[None, :]).ravel(), (half * gl_w[None, :]).ravel()


def _log_s_quadrature(law, s_lo: float, s_hi: float, panels: int, order: int):
    """Nodes and weights of the continuous part of ``S`` on ``[s_lo, s_hi]``, Gauss-Legendre
    in ``u = log s`` with weight ``rho(s) s du`` (``docs/privacy/prv.md#prv-quadrature``)."""
    u, du = _gauss_legendre(math.log(s_lo), math.log(s_hi), panels, order)
    s = np.exp(u)
    return s, np.exp(law.logpdf(s) + u) * du


class _SchurLaw(_Law):
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
        self._chi2 = _Chi2Law(k)

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
        v, dv = _gauss_legendre(math.log(c_lo), math.log(c_hi), parts, order)
        c = np.exp(v)
        log_fy = math.log(a) + (a - 1.0) * np.log(a * c) - a * c - special.gammaln(a)
        s = [1.0 / np.sqrt(_conditional_mean(c[::-1], a))]
        w = [(np.exp(log_fy + v) * dv)[::-1]]
        s.insert(0, [1.0 / math.sqrt(float(_conditional_mean(np.array([c_hi]), a)[0]))])
        w.insert(0, [float(special.gammaincc(a, a * c_hi))])
        for loc, mass in self.atoms():
            s.append([loc])
            w.append([mass])
            s_c, w_c = _log_s_quadrature(self._chi2, loc, s_max, parts, order)
            s.append(s_c)
            w.append(w_c)
        return np.concatenate(s), np.concatenate(w)


#: Registry of envelope laws, by the name accepted wherever an ``envelope`` argument appears.
_LAWS: Registry[type] = Registry("envelope")
for _name, _cls in (("chi2", _Chi2Law), ("schur", _SchurLaw), ("chernoff", _ChernoffLaw)):
    _LAWS.register(_name, _cls)

#: Envelope names accepted everywhere an ``envelope`` argument appears.
ENVELOPES = tuple(_LAWS)


def _validate_envelope(envelope: str) -> None:
    if envelope not in ENVELOPES:
        raise ValueError(f"envelope must be one of {ENVELOPES}, got {envelope!r}")


def _warn_if_unproved(sketch_dim: int | None, envelope: str) -> None:
    if envelope == "chi2" and sketch_dim == 1:
        warnings.warn(
            "envelope='chi2' is proved for sketch_dim >= 2 only (docs/privacy/envelope.md, "
            "section 'Why k = 1 is not covered'); at sketch_dim=1 it is a numerically checked "
            "bound, not a proved one. Pass envelope='schur' or envelope='chernoff' for a proved "
            "bound, or use sketch_dim >= 2.",
            UserWarning,
            stacklevel=3,
        )


def envelope_cdf(y: float | np.ndarray, *, sketch_dim: int, envelope: str = "chi2") -> np.ndarray:
    """The envelope ``F_env(y) >= sup_W P(W <= y)`` of the ratio ``W = n_hat / n``.

    ``docs/privacy/envelope.md`` (definitions and proofs): ``F_env(y) = 1`` for ``y >= 1``
    (docs/privacy/envelope.md#envelope-above-one); for ``y < 1`` it is ``P(chi2_k <= k y)``
    ("chi2", proved for ``k >= 2``: then it is the supremum itself,
    docs/privacy/envelope.md#envelope-claim-l), the Schur/hinge fallback ("schur",
    docs/privacy/envelope.md#envelope-schur) or the Chernoff bound ``(y e^{1-y})^{k/2}``
    ("chernoff", docs/privacy/envelope.md#envelope-chernoff).

    Args:
        y: Ratio of estimated to true squared norm (dimensionless), any shape.
        sketch_dim: ``k``, the number of Gaussian sketch columns (>= 1).
        envelope: A name in :data:`ENVELOPES` (``"chi2"``, ``"schur"`` or ``"chernoff"``).

    Returns:
        Array of the same shape as ``y`` with values in ``[0, 1]``.

    Raises:
        ValueError: if ``sketch_dim < 1`` or ``envelope`` is unknown.
    """
    _validate_envelope(envelope)
    validate_sketch_dim(sketch_dim, allow_none=True)
    if sketch_dim is None:
        raise ValueError("envelope_cdf needs a sketch_dim; exact clipping has W = 1")
    _warn_if_unproved(sketch_dim, envelope)
    y = np.asarray(y, dtype=float)
    inside = (y > 0.0) & (y < 1.0)
    val = _LAWS[envelope](int(sketch_dim)).w_cdf(np.where(inside, y, 0.5))
    return np.where(y >= 1.0, 1.0, np.where(y <= 0.0, 0.0, val))


@dataclass(frozen=True)
class EnvelopeQuadrature:
    """Riemann-Stieltjes quadrature of the envelope law on ``[1, s_max]``.

    ``docs/privacy/prv.md#prv-quadrature``.

    ``integral f dF_S ~= sum_j weights[j] f(nodes[j])`` for ``S <= s_max``; the mass above
    ``s_max``, ``tail_mass``, is not represented by any node: the accountant treats it as a
    fully revealing event (``pm_inf``).

    Attributes:
        nodes: Sensitivities ``s_j`` in units of ``C``, increasing, shape ``(n,)``. Atoms of the
            law (``s = 1`` for "chi2", ``s*`` for "schur") are nodes of their own.
        weights: Probability weights, shape ``(n,)``; ``weights.sum() = 1 - tail_mass``.
        tail_mass: ``eta = P(S > s_max)`` (0 for exact clipping).
        s_max: Upper end of the represented range (units of ``C``).
    """

    nodes: np.ndarray
    weights: np.ndarray
    tail_mass: float
    s_max: float


@dataclass(frozen=True)
class SensitivityEnvelope:
    """Worst-case law of the sensitivity ``S`` (units of ``C``) of randomized clipping.

    Parameter domains: ``sketch_dim`` in ``{1, 2, ...}`` or ``None`` (exact clipping, ``S = 1``);
    ``envelope`` in :data:`ENVELOPES`. For Hutch++ pass the number of *tail* columns
    (``docs/privacy/hutchpp.md#hutchpp-theorem-h``). ``"chi2"`` is proved for ``k >= 2``; at
    ``k = 1`` it warns (see
    the module docstring) and ``"schur"`` or ``"chernoff"`` give proved bounds.

    Example:
        >>> env = SensitivityEnvelope(sketch_dim=32)
        >>> round(env.atom(), 10)
        0.4667448914
        >>> round(float(env.isf(1e-6)), 6)
        2.130958

    Attributes:
        sketch_dim: ``k``, the Gaussian columns of the (tail) sketch, or ``None``.
        envelope: ``"chi2"`` (default), ``"schur"`` or ``"chernoff"``.
    """

    sketch_dim: int | None = None
    envelope: str = "chi2"

    def __post_init__(self) -> None:
        validate_sketch_dim(self.sketch_dim, allow_none=True)
        _validate_envelope(self.envelope)
        if self.sketch_dim is not None:
            object.__setattr__(self, "sketch_dim", int(self.sketch_dim))

    @property
    def exact(self) -> bool:
        """``True`` for exact clipping (``S = 1`` almost surely)."""
        return self.sketch_dim is None

    @property
    def _law(self):
        return _law(self.sketch_dim, self.envelope)

    # ------------------------------------------------------------------ law of S
    def atom(self) -> float:
        """``P(S = 1)``: ``P(chi2_k >= k)`` for "chi2", 0 for "schur" and "chernoff", 1 if exact."""
        return dict(self.atoms()).get(1.0, 0.0)

    def atoms(self) -> tuple[tuple[float, float], ...]:
        """All atoms ``(s, P(S = s))`` of the law, in increasing ``s``.

        "chi2": ``((1, P(chi2_k >= k)),)``; "schur" (``k >= 3``): ``((s*, mass),)`` with
        ``s* = (1 - 2/k)^{-1/2}``; "chernoff": none; exact clipping: ``((1, 1),)``.
        """
        if self.exact:
            return ((1.0, 1.0),)
        return self._law.atoms()

    def logsf(self, s: float | np.ndarray) -> np.ndarray:
        """``log P(S > s)`` for ``s`` in units of ``C`` (``docs/privacy/envelope.md``)."""
        s = np.asarray(s, dtype=float)
        if self.exact:
            return np.where(s < 1.0, 0.0, -np.inf)
        val = self._law.logsf(np.maximum(s, 1.0))
        return np.where(s < 1.0, 0.0, val)

    def sf(self, s: float | np.ndarray) -> np.ndarray:
        """``P(S > s)`` (survival function; computed directly, not as ``1 - cdf``)."""
        return np.exp(self.logsf(s))

    def cdf(self, s: float | np.ndarray) -> np.ndarray:
        """``P(S <= s)``."""
        s = np.asarray(s, dtype=float)
        if self.exact:
            return np.where(s < 1.0, 0.0, 1.0)
        val = self._law.cdf(np.maximum(s, 1.0))
        return np.where(s < 1.0, 0.0, val)

    def logpdf(self, s: float | np.ndarray) -> np.ndarray:
        """Log density of the continuous part of ``S`` on ``s > 1`` (``-inf`` elsewhere).

        "chi2": ``rho(s) = (2k / s^3) f_{chi2_k}(k / s^2)`` (``#envelope-law``). "chernoff":
        ``rho(s) = (k / s)(1 - s^{-2})(s^{-2} e^{1 - s^{-2}})^{k/2}``, the derivative of the
        Chernoff survival function. "schur": ``(2 / s^3) b'(s^{-2})`` on ``(1, s*)`` (``b`` the
        hinge bound, ``b' = b / (c* - y)``), the "chi2" density above ``s*``.
        """
        s = np.asarray(s, dtype=float)
        if self.exact:
            return np.full_like(s, -np.inf)
        inside = s > 1.0
        val = self._law.logpdf(np.where(inside, s, 2.0))
        return np.where(inside, val, -np.inf)

    def pdf(self, s: float | np.ndarray) -> np.ndarray:
        """Density of the continuous part of ``S`` (see :meth:`logpdf`)."""
        return np.exp(self.logpdf(s))

    def isf(self, p: float | np.ndarray) -> np.ndarray:
        """Inverse survival function: the smallest ``s`` with ``P(S > s) <= p``.

        Returns 1 where ``p >= P(S > 1)`` (the atom). Closed forms: "chi2"
        ``s = sqrt(k / (2 gammaincinv(k/2, p)))``; "chernoff" ``s = y^{-1/2}`` with
        ``y = -W_0(-p^{2/k} / e)`` (Lambert W, principal branch); "schur" the "chi2" form
        below ``P(chi2_k < k y0)``, ``s*`` up to ``b(y0)``, and above it ``s = y^{-1/2}`` with
        ``y = max(E[Y | Y <= F_Y^{-1}(p)], chernoff^{-1}(p))``.

        Args:
            p: Tail probability in ``(0, 1]``.

        Raises:
            ValueError: if some ``p`` is outside ``(0, 1]``.
        """
        p = np.asarray(p, dtype=float)
        if np.any((p <= 0.0) | (p > 1.0)):
            raise ValueError("isf needs tail probabilities in (0, 1]")
        if self.exact:
            return np.ones_like(p)
        return self._law.isf(p)

    def ppf(self, p: float | np.ndarray) -> np.ndarray:
        """Quantile function: the smallest ``s`` with ``P(S <= s) >= p``, ``p`` in ``[0, 1)``."""
        p = np.asarray(p, dtype=float)
        if np.any((p < 0.0) | (p >= 1.0)):
            raise ValueError("ppf needs probabilities in [0, 1)")
        return self.isf(1.0 - p)

    def mean(self) -> float:
        """``E S`` (units of ``C``); infinite for ``k = 1``.

        "chi2": ``P(chi2_k >= k) + sqrt(k/2) Gamma((k-1)/2) / Gamma(k/2) P(chi2_{k-1} < k)``,
        from ``x^{-1/2} f_{chi2_k}(x) = f_{chi2_{k-1}}(x) Gamma((k-1)/2) / (sqrt 2 Gamma(k/2))``.
        "schur": the same closed form above ``s*``, ``s*`` times the atom, and
        ``integral E[Y | Y <= c]^{-1/2} f_Y(c) dc`` over ``c > c*(y0)`` by quadrature.
        "chernoff": ``1 + integral_1^inf P(S > s) ds`` by quadrature.
        """
        if self.exact:
            return 1.0
        if self.sketch_dim == 1:
            return math.inf
        return self._law.mean()

    def s_max(self, eta: float = DEFAULT_ETA) -> float:
        """The cap ``s_max`` with ``P(S > s_max) = eta``
        (``docs/privacy/prv.md#prv-quadrature``)."""
        if self.exact:
            return 1.0
        return float(self.isf(eta))

    # ------------------------------------------------------------------ quadrature
    def quadrature(
        self, *, eta: float = DEFAULT_ETA, panels: int = 40, order: int = 16
    ) -> EnvelopeQuadrature:
        """Quadrature nodes and weights of the law of ``S`` on ``[1, s_max]``.

        ``docs/privacy/prv.md#prv-quadrature``.

        Atoms are nodes of their own; the continuous part uses composite Gauss-Legendre in
        ``u = log s`` on ``[0, log s_max]``, ``panels`` panels of ``order`` nodes, weight
        ``rho(s) s du``. "schur" splits the range at its atom ``s*``: above it the same rule
        (``panels // 2`` panels), below it Gauss-Legendre in ``log c`` of the hinge
        parameterisation ``S = E[Y | Y <= c]^{-1/2}``, ``c ~ chi2_k / k``, whose integrand is
        smooth where the density of ``S`` is not (near ``s = 1``). The mass ``eta`` above
        ``s_max`` is left out (``tail_mass``). Results are cached. Warns once for "chi2" at
        ``k = 1`` (not proved there; see the module docstring).

        Args:
            eta: Capped tail mass ``P(S > s_max)``, in ``(0, 1e-6]``.
            panels: Number of Gauss-Legendre panels (>= 1).
            order: Nodes per panel (>= 2).

        Raises:
            ValueError: on out-of-range arguments.
            RuntimeError: if the weights do not sum to ``1 - eta`` within ``1e-9`` (a numerical
                failure of the quadrature, e.g. an extreme ``sketch_dim``).
        """
        if not 0.0 < eta <= 1e-6:
            raise ValueError(f"eta must be in (0, 1e-6], got {eta}")
        if panels < 1 or order < 2:
            raise ValueError(f"need panels >= 1 and order >= 2, got {panels}, {order}")
        _warn_if_unproved(self.sketch_dim, self.envelope)
        return _quadrature(self.sketch_dim, self.envelope, float(eta), int(panels), int(order))


@functools.lru_cache(maxsize=64)
def _law(sketch_dim: int, envelope: str):
    return _LAWS[envelope](sketch_dim)


@functools.lru_cache(maxsize=64)
def _quadrature(
    sketch_dim: int | None, envelope: str, eta: float, panels: int, order: int
) -> EnvelopeQuadrature:
    env = SensitivityEnvelope(sketch_dim=sketch_dim, envelope=envelope)
    if env.exact:
        one = np.ones(1)
        return EnvelopeQuadrature(nodes=one, weights=one.copy(), tail_mass=0.0, s_max=1.0)
    s_max = env.s_max(eta)
    s, w = env._law.quadrature(s_max, eta, panels, order)
    total = float(w.sum())
    if abs(total - (1.0 - eta)) > 1e-9:
        raise RuntimeError(
            f"envelope quadrature for k={sketch_dim} ({envelope}) sums to {total!r}, not "
            f"1 - eta = {1.0 - eta!r}; increase panels/order"
        )
    s.setflags(write=False)
    w.setflags(write=False)
    return EnvelopeQuadrature(nodes=s, weights=w, tail_mass=eta, s_max=s_max)
