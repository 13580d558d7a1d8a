"""Privacy-loss models of one DP-SGD-RC step: the ``hidden`` and ``revealed`` threat models.

One step of DP-SGD-RC, in units where the clipping bound is ``C = 1`` and the noise standard
deviation is the noise multiplier ``sigma``, is dominated by the one-dimensional pair
(docs/privacy/threat_models.md#threat-models)

* ``"hidden"`` threat model: ``P = N(0, sigma^2)`` versus
  ``Q = (1 - q) N(0, sigma^2) + q E_S N(S, sigma^2)``;
* ``"revealed"`` threat model (the paper's): ``(S, N(0, sigma^2))`` versus
  ``(S, (1 - q) N(0, sigma^2) + q N(S, sigma^2))``,

where ``S >= 1`` follows the envelope law of :mod:`~opacus_rc.accountants.analysis.envelope`.

Both threat models share one representation. Write ``U = log L`` for the log-likelihood ratio
``L = dQ/dP`` and ``z = log((e^u - (1 - q)) / q)``, so that ``u = log(1 - q + q e^z)``
(:func:`u_of_z`, :func:`z_of_u`):

* hidden (docs/privacy/prv.md#prv-hidden): ``z = log m(x)`` with ``m(x) = E_S exp((S x - S^2/2) /
  sigma^2)``;
* revealed (docs/privacy/prv.md#prv-revealed): ``z = (S x - S^2/2) / sigma^2`` (the per-``S``
  Gaussian log-likelihood).

Let ``A(z) = P(Z <= z)`` under ``P`` and ``B(z) = P(Z <= z)`` under ``Q``. Every model
implements :class:`PrivacyLossModel`: exact values of ``A``, ``B``, their survival functions
(computed directly, not as ``1 - cdf``) and their first two ``z``-derivatives
(:class:`LossValues`), at any ``z`` and at the knots of a table grid that resolves them. The
laws satisfy ``dB = L dA`` (a PRV identity, used as a test). Models are looked up by name in
:data:`THREAT_MODEL_CLASSES`.

Pure numpy/scipy; no Opacus import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from scipy import optimize, special

from opacus_rc.accountants.analysis.envelope import EnvelopeQuadrature

__all__ = [
    "THREAT_MODELS",
    "THREAT_MODEL_CLASSES",
    "HiddenLossModel",
    "LossValues",
    "PrivacyLossModel",
    "RevealedLossModel",
    "is_sorted",
    "u_of_z",
    "z_of_u",
]

# Table resolution. Hidden: uniform x-grid with step _X_STEP * sigma on [-12 sigma, x_hi].
# Revealed: z-grid with step _Z_STEP * max(1, s*) / sigma, where s* is the smallest active
# sensitivity at |z| (components with |sigma' z +- 1/(2 sigma')| > 12 are saturated at 0 or 1).
# Quintic Hermite interpolation at these steps is accurate to < 1e-13 absolute (tested against
# exact evaluation in tests/accountants/test_loss_table.py).
_X_STEP = 0.02
_Z_STEP = 0.02
_SAT = 12.0  # Phi(-12) = 1.8e-33: arguments beyond +-12 are saturated in double precision
#: Tabulate ``U`` up to at least this value (above the largest cap, 200).
U_TOP = 201.0
_Z_RES = 1e-12  # revealed: tabulate z only where u - log(1 - q) > _Z_RES * (1 - q)
_CHUNK = 1 << 19  # matrix entries per vectorised block (memory bound)


# =====================================================================================
# Coordinates u <-> z
# =====================================================================================
def u_of_z(q: float, z: np.ndarray) -> np.ndarray:
    """``u = log(1 - q + q e^z)`` (the log-likelihood ratio as a function of ``z``)."""
    return np.logaddexp(math.log1p(-q) if q < 1.0 else -np.inf, math.log(q) + z)


def is_sorted(x: np.ndarray) -> bool:
    return x.ndim == 1 and x.size > 1 and bool(np.all(x[1:] >= x[:-1]))


def z_of_u(q: float, u: np.ndarray) -> np.ndarray:
    """Inverse of :func:`u_of_z`; ``-inf`` for ``u <= log(1 - q)``."""
    u = np.asarray(u, dtype=float)
    if q == 1.0:
        return u.copy()
    logq = math.log(q)
    out = np.empty(u.shape)
    if is_sorted(u):  # fast path for the discretisation grid: contiguous slices, no masks
        i0 = int(np.searchsorted(u, 0.0, side="right"))
        val = np.expm1(u[:i0]) + q
        np.log(val, out=out[:i0], where=val > 0.0)
        out[:i0][val <= 0.0] = -np.inf
        out[:i0] -= logq
        up = u[i0:]
        out[i0:] = up + np.log1p(-(1.0 - q) * np.exp(-up)) - logq
        return out
    out.fill(-np.inf)
    pos = u > 0.0
    up = u[pos]
    out[pos] = up + np.log1p(-(1.0 - q) * np.exp(-up)) - logq
    neg = u <= 0.0
    val = np.expm1(u[neg]) + q
    good = val > 0.0
    res = np.full(val.shape, -np.inf)
    res[good] = np.log(val[good]) - logq
    out[neg] = res
    out[np.isnan(u)] = np.nan
    return out


# =====================================================================================
# Exact evaluation of A, B and their z-derivatives
# =====================================================================================
@dataclass(frozen=True)
class LossValues:
    """``A, 1 - A, B, 1 - B`` and the first two ``z``-derivatives of ``A`` and ``B`` at ``z``."""

    z: np.ndarray
    A: np.ndarray
    Abar: np.ndarray
    B: np.ndarray
    Bbar: np.ndarray
    da: np.ndarray
    d2a: np.ndarray
    db: np.ndarray
    d2b: np.ndarray


class PrivacyLossModel(Protocol):
    """Common interface of the threat models: the laws ``A`` (under ``P``) and ``B`` (under
    ``Q``) of the coordinate ``z`` of one step's log-likelihood ratio ``u = log(1 - q + q e^z)``.

    Attributes:
        q: Poisson sampling probability.
        sigma: Noise multiplier.
        quad: Quadrature of the envelope law of ``S`` (the mass above ``s_max`` is not in it).
        default_step: Table resolution used when none is given (model units).
        saturated: After :meth:`knots`: whether both laws are 0 (below the first knot) and 1
            (above the last knot) to within ``Phi(-12)``, for the lower and the upper end.
    """

    q: float
    sigma: float
    quad: EnvelopeQuadrature
    default_step: float
    saturated: tuple[bool, bool]

    def __init__(self, q: float, sigma: float, quad: EnvelopeQuadrature) -> None: ...

    def values_z(self, z: np.ndarray) -> LossValues:
        """Exact values at ``z`` (any order), shape ``(n,)`` in every field."""
        ...

    def knots(self, step: float) -> LossValues:
        """Exact values at the knots of a table with resolution ``step``; ``z`` increasing."""
        ...


def _split_phi(y: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(sum_j v_j Phi(y_ij), sum_j v_j Phi(-y_ij))`` over rows, both to full relative precision.

    Each entry uses one ``ndtr`` of ``-|y|``; the cdf part of positive arguments is
    ``v - v Phi(-y)`` summed separately, so neither sum suffers cancellation.
    """
    small = special.ndtr(-np.abs(y))
    pos = y >= 0.0
    vs = small * v
    low = np.where(pos, 0.0, vs).sum(axis=1)  # sum_{y<0} v Phi(y)
    high = np.where(pos, vs, 0.0).sum(axis=1)  # sum_{y>=0} v Phi(-y)
    w_pos = np.where(pos, v, 0.0).sum(axis=1)
    w_neg = v.sum() - w_pos
    cdf = low + (w_pos - high)
    sf = (w_neg - low) + high
    return cdf, sf


class HiddenLossModel:
    """Hidden threat model (docs/privacy/prv.md#prv-hidden), parameterised by ``x`` (the 1-D
    output)."""

    default_step = _X_STEP

    def __init__(self, q: float, sigma: float, quad: EnvelopeQuadrature) -> None:
        self.q, self.sigma, self.quad = q, sigma, quad
        s, w = quad.nodes, quad.weights
        self.s = s
        self.w = w
        self.logw = np.log(w)
        self.mass_q = (
            1.0 - q * quad.tail_mass
        )  # total finite mass of Q' (docs/privacy/prv.md#prv-quadrature)
        v = w / w.sum()
        self.mu1 = float((v * s).sum())
        self.mu2 = float((v * s * s).sum())

    def logm(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(log m(x), g = (log m)'(x), g' = (log m)''(x))`` by log-sum-exp over the nodes."""
        x = np.atleast_1d(np.asarray(x, dtype=float))
        s2 = self.sigma**2
        out_l, out_g, out_h = (np.empty_like(x) for _ in range(3))
        rows = max(1, _CHUNK // self.s.size)
        for i in range(0, x.size, rows):
            xi = x[i : i + rows, None]
            e = (self.s * xi - 0.5 * self.s**2) / s2 + self.logw
            mx = e.max(axis=1, keepdims=True)
            p = np.exp(e - mx)
            p0 = p.sum(axis=1)
            m1 = (p * self.s).sum(axis=1) / p0
            m2 = (p * self.s**2).sum(axis=1) / p0
            out_l[i : i + rows] = mx[:, 0] + np.log(p0)
            out_g[i : i + rows] = m1 / s2
            out_h[i : i + rows] = np.maximum(m2 - m1 * m1, 0.0) / s2**2
        return out_l, out_g, out_h

    def x_of_z(self, z: np.ndarray) -> np.ndarray:
        """Root ``x*(z)`` of ``log m(x) = z`` by Newton's method from the right.

        ``log m`` is convex and increasing, and the start (Jensen's inequality,
        ``log m(x) >= log(1 - eta) + (mu1 x - mu2 / 2) / sigma^2``) lies right of the root, so
        the iterates decrease monotonically to it.
        """
        z = np.atleast_1d(np.asarray(z, dtype=float))
        s2 = self.sigma**2
        log_fin = math.log(float(self.w.sum()))
        x = (s2 * (z - log_fin) + 0.5 * self.mu2) / self.mu1
        polish = False
        for _ in range(200):
            lm, g, _ = self.logm(x)
            step = (lm - z) / g
            x = x - step
            if polish:
                break
            # quadratic convergence: once steps are 1e-10, one more step reaches rounding level
            polish = bool(np.all(np.abs(step) <= 1e-10 * (1.0 + np.abs(x))))
        return x

    def values_x(self, x: np.ndarray) -> LossValues:
        """Exact ``A, B`` and ``z``-derivatives at outputs ``x`` (``z = log m(x)``)."""
        x = np.atleast_1d(np.asarray(x, dtype=float))
        q, sigma = self.q, self.sigma
        lm, g, gp = self.logm(x)
        xs = x / sigma
        A = special.ndtr(xs)
        Abar = special.ndtr(-xs)
        q1c = np.empty_like(x)
        q1s = np.empty_like(x)
        rows = max(1, _CHUNK // self.s.size)
        for i in range(0, x.size, rows):
            y = (x[i : i + rows, None] - self.s) / sigma
            q1c[i : i + rows], q1s[i : i + rows] = _split_phi(y, self.w)
        B = ((1.0 - q) * A + q * q1c) / self.mass_q
        Bbar = ((1.0 - q) * Abar + q * q1s) / self.mass_q
        # densities in x: alpha = phi(x/sigma)/sigma, beta = alpha L / mass_q
        log_alpha = -0.5 * xs * xs - math.log(sigma * math.sqrt(2.0 * math.pi))
        logL = np.logaddexp(math.log1p(-q) if q < 1.0 else -np.inf, math.log(q) + lm)
        alpha = np.exp(log_alpha)
        beta = np.exp(log_alpha + logL) / self.mass_q
        dalpha = -x / sigma**2 * alpha
        r = np.exp(math.log(q) + lm - logL)  # q m / L
        dbeta = beta * (-x / sigma**2 + r * g)
        da = alpha / g
        db = beta / g
        d2a = (dalpha * g - alpha * gp) / g**3
        d2b = (dbeta * g - beta * gp) / g**3
        return LossValues(lm, A, Abar, B, Bbar, da, d2a, db, d2b)

    def values_z(self, z: np.ndarray) -> LossValues:
        z = np.atleast_1d(np.asarray(z, dtype=float))
        vals = self.values_x(self.x_of_z(z))
        return LossValues(
            z, *(getattr(vals, f) for f in ("A", "Abar", "B", "Bbar", "da", "d2a", "db", "d2b"))
        )

    def knots(self, step: float) -> LossValues:
        """Exact values at the x-grid knots of :meth:`grid` (``z = log m(x)``)."""
        return self.values_x(self.grid(step))

    def grid(self, step: float) -> np.ndarray:
        """The table's knots in ``x``: ``[-12 sigma, x_hi]`` with step ``step * sigma``.

        Above ``x_hi = min(s_max + 12 sigma, x*(z_top))`` both laws are saturated (``B = 1`` to
        ``1e-33``) or ``u`` exceeds every cap; ``z_top`` is where ``u = 201`` (and at least 150,
        where ``A = 1``: ``log m(x) <= x^2 / (2 sigma^2)`` gives ``x >= 17 sigma``).
        """
        sigma, q = self.sigma, self.q
        z_top = max(150.0, U_TOP - math.log(q))
        x_sat = self.quad.s_max + _SAT * sigma
        x_hi = x_sat
        if self.logm(np.array([x_sat]))[0][0] > z_top:
            f = lambda xx: self.logm(np.array([xx]))[0][0] - z_top  # noqa: E731
            x_hi = optimize.brentq(f, -_SAT * sigma, x_sat, xtol=1e-12 * sigma)
        x_lo = -_SAT * sigma
        n = int(math.ceil((x_hi - x_lo) / (step * sigma))) + 1
        # below x_lo: A, B <= Phi(-12); above x_sat: A, B >= 1 - Phi(-12)
        self.saturated = (True, x_hi == x_sat)
        return np.linspace(x_lo, x_hi, max(n, 8))


class RevealedLossModel:
    """Revealed threat model (docs/privacy/prv.md#prv-revealed), parameterised by the per-``S``
    log-likelihood ``z``."""

    default_step = _Z_STEP

    def __init__(self, q: float, sigma: float, quad: EnvelopeQuadrature) -> None:
        self.q, self.sigma, self.quad = q, sigma, quad
        self.s = quad.nodes
        self.v = quad.weights / quad.weights.sum()  # law of S conditioned on S <= s_max
        self.sp = sigma / self.s  # sigma' = sigma / s

    def _radius(self, s: float) -> float:
        """Saturation radius: component ``s`` is 0 or 1 (to 1e-33) for ``|z| > R(s)``."""
        return _SAT * s / self.sigma + s * s / (2.0 * self.sigma**2)

    def values_z(self, z: np.ndarray) -> LossValues:
        z = np.atleast_1d(np.asarray(z, dtype=float))
        q = self.q
        n = z.size
        A, Abar, Q1, Q1bar, da, d2a = (np.empty(n) for _ in range(6))
        rows = max(1, _CHUNK // self.s.size)
        sp, v = self.sp, self.v
        for i in range(0, n, rows):
            zi = z[i : i + rows, None]
            yp = sp * zi + 0.5 / sp
            ym = sp * zi - 0.5 / sp
            A[i : i + rows], Abar[i : i + rows] = _split_phi(yp, v)
            Q1[i : i + rows], Q1bar[i : i + rows] = _split_phi(ym, v)
            ph = np.exp(-0.5 * yp * yp) / math.sqrt(2.0 * math.pi) * v
            da[i : i + rows] = (ph * sp).sum(axis=1)
            d2a[i : i + rows] = -(ph * sp * sp * yp).sum(axis=1)
        B = (1.0 - q) * A + q * Q1
        Bbar = (1.0 - q) * Abar + q * Q1bar
        with np.errstate(over="ignore"):
            L = np.exp(u_of_z(q, z))
            qez = q * np.exp(z)
        db = L * da
        d2b = L * d2a + qez * da
        return LossValues(z, A, Abar, B, Bbar, da, d2a, db, d2b)

    def knots(self, step: float) -> LossValues:
        """Exact values at the z-grid knots of :meth:`grid`."""
        return self.values_z(self.grid(step))

    def grid(self, step: float) -> np.ndarray:
        """Knots in ``z``: step ``step * max(1, s*) / sigma`` in bands of doubling ``s*``.

        ``s*(|z|)`` is the smallest sensitivity whose component is not saturated at ``|z|``;
        component ``s`` varies on the scale ``s / sigma`` in ``z``. The range is
        ``[max(-R(s_max), z_res, -201), min(R(s_max), z(u = 201))]``; ``z_res`` is where
        ``u - log(1 - q)`` falls to ``1e-12 (1 - q)`` (below, all points lie in the first
        discretisation cell and are evaluated exactly).
        """
        q, sigma = self.q, self.sigma
        r_max = self._radius(self.quad.s_max)
        z_res = math.log(_Z_RES * (1.0 - q) / q) if q < 1.0 else -np.inf
        z_lo = max(-r_max, z_res, -U_TOP)
        z_hi = min(r_max, U_TOP - math.log(q))
        pieces = []
        for sign, end in ((1.0, z_hi), (-1.0, -z_lo)):
            if end <= 0.0:
                continue
            start, m = 0.0, 0
            while start < end:
                band_end = min(end, self._radius(2.0 ** (m + 1))) if m < 60 else end
                h = step * (2.0**m) / sigma
                cnt = max(1, int(math.ceil((band_end - start) / h)))
                pieces.append(sign * np.linspace(start, band_end, cnt + 1))
                start, m = band_end, m + 1
        grid = np.unique(np.concatenate(pieces + [np.array([0.0])]))
        grid = grid[(grid >= z_lo) & (grid <= z_hi)]
        # every component is saturated below -R(s_max) and above R(s_max)
        self.saturated = (grid[0] <= -r_max, grid[-1] >= r_max)
        return grid


#: Threat model name -> its :class:`PrivacyLossModel` class.
THREAT_MODEL_CLASSES: dict[str, type[PrivacyLossModel]] = {
    "hidden": HiddenLossModel,
    "revealed": RevealedLossModel,
}

#: Threat models (docs/privacy/threat_models.md#threat-models).
THREAT_MODELS = tuple(THREAT_MODEL_CLASSES)
