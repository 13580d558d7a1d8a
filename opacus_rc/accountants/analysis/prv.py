"""Privacy loss random variables (PRVs) of DP-SGD with randomized clipping, for ``prv_accountant``.

One step of DP-SGD-RC, in units where the clipping bound is ``C = 1`` and the noise standard
deviation is the noise multiplier ``sigma``, is dominated by the one-dimensional pair
(THEORY.md B.1-B.2)

* ``"hidden"`` threat model: ``P = N(0, sigma^2)`` versus
  ``Q = (1 - q) N(0, sigma^2) + q E_S N(S, sigma^2)``;
* ``"revealed"`` threat model (the paper's): ``(S, N(0, sigma^2))`` versus
  ``(S, (1 - q) N(0, sigma^2) + q N(S, sigma^2))``,

where ``S >= 1`` follows the envelope law of :mod:`~opacus_rc.accountants.analysis.envelope`.
Under add/remove adjacency with Poisson subsampling both ordered pairs are needed
(THEORY.md B.5, Zhu, Dong and Wang 2022): the *remove* PRV ``Y_R = log(dQ/dP)(X)``, ``X ~ Q``,
and the *add* PRV ``Y_A = log(dP/dQ)(X)``, ``X ~ P``. The reported epsilon is the larger one.

Both threat models share one representation. Write ``U = log L`` for the log-likelihood ratio
``L = dQ/dP`` and ``z = log((e^u - (1 - q)) / q)``, so that ``u = log(1 - q + q e^z)``:

* hidden (C.1): ``z = log m(x)`` with ``m(x) = E_S exp((S x - S^2/2) / sigma^2)``;
* revealed (C.2): ``z = (S x - S^2/2) / sigma^2`` (the per-``S`` Gaussian log-likelihood).

Let ``A(z) = P(Z <= z)`` under ``P`` and ``B(z) = P(Z <= z)`` under ``Q``. Then the remove CDF is
``F_R(t) = B(z(t))`` and the add CDF is ``F_A(t) = 1 - A(z(-t))``; the laws satisfy
``dB = L dA`` (a PRV identity, used as a test). ``A`` and ``B`` (and their survival functions,
computed directly, not as ``1 - cdf``) are tabulated once per ``(q, sigma, k, envelope, mode)``
with their first two derivatives in ``z`` and interpolated by quintic Hermite splines; points
outside the table are evaluated exactly. This replaces the reference recipe of THEORY.md C.3
item 3 (cubic Hermite root inversion on a ``2e-3 sigma`` grid) by an equivalent, faster one: the
spline error against exact evaluation is below ``1e-13`` (tested).

Heavy tail (THEORY.md B.6, C.3 items 1 and 4): the mass ``eta`` of ``S > s_max`` is a fully
revealing event (``pm_inf = eta`` in both directions), and the PRV is capped at ``t_cap``, the
smallest value in ``{2, 2.5, ..., 200}`` with ``steps * P(Y > t_cap) <= 1e-3 delta`` (200 if
none qualifies), the mass above it moved to ``pm_inf``. Moving loss mass up to ``+inf`` can only increase
``E(1 - e^{eps - sum Y})_+``, so both steps keep the bound valid. ``rdp`` is a finite upper bound
of the capped PRV's moment generating function, used only to size the discretisation domain; the
true RDP is infinite and is never reported.

Composition (:func:`compose_epsilon`) follows ``prv_accountant.PRVAccountant`` (Gopi, Lee and
Wutschitz 2021, arXiv:2106.02848): safe domain from the RDP bound, mesh of Theorem 5.5,
cell-centred discretisation with mean correction, FFT self-composition, and
``(lower, estimate, upper)`` bounds. Differences, all for speed and none changing the result
beyond 1e-6 (tested against ``PRVAccountant`` itself): the truncated PRV's mean is integrated
from the spline (not ``scipy.integrate.quad`` on scalar calls), the CDF is evaluated once per
cell edge, and the domain is widened to an FFT-friendly length.

Pure numpy/scipy and ``prv_accountant``; no Opacus import.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from prv_accountant.accountant import compute_safe_domain_size
from prv_accountant.composers import Heterogeneous
from prv_accountant.discrete_privacy_random_variable import DiscretePrivacyRandomVariable
from prv_accountant.domain import Domain
from prv_accountant.privacy_random_variables import PrivacyRandomVariable
from scipy import fft as sp_fft
from scipy import interpolate, optimize, special

from opacus_rc.accountants.analysis.envelope import (
    DEFAULT_ETA,
    ENVELOPES,
    EnvelopeQuadrature,
    SensitivityEnvelope,
)

__all__ = [
    "CAP_GRID",
    "DIRECTIONS",
    "THREAT_MODELS",
    "EpsilonOutOfRangeError",
    "EpsilonReport",
    "RandomizedClippingPRV",
    "Segment",
    "compose_epsilon",
    "compute_epsilon",
    "choose_t_cap",
]

#: Threat models (THEORY.md B.2).
THREAT_MODELS = ("hidden", "revealed")
#: Adjacency directions (THEORY.md B.5).
DIRECTIONS = ("remove", "add")
#: Candidate caps of the privacy loss (THEORY.md C.3 item 4): {2, 2.5, ..., 200}.
CAP_GRID = np.arange(2.0, 200.0 + 0.25, 0.5)
#: Tail mass moved to ``pm_inf`` by the cap, as a fraction of delta (THEORY.md C.3 item 4).
CAP_DELTA_FRACTION = 1e-3
#: Largest discretisation domain (number of points) composed before giving up.
MAX_DOMAIN_POINTS = 2**25

# Table resolution. Hidden: uniform x-grid with step _X_STEP * sigma on [-12 sigma, x_hi].
# Revealed: z-grid with step _Z_STEP * max(1, s*) / sigma, where s* is the smallest active
# sensitivity at |z| (components with |sigma' z +- 1/(2 sigma')| > 12 are saturated at 0 or 1).
# Quintic Hermite interpolation at these steps is accurate to < 1e-13 absolute (tested against
# exact evaluation in tests/accountants/test_prv.py).
_X_STEP = 0.02
_Z_STEP = 0.02
_SAT = 12.0  # Phi(-12) = 1.8e-33: arguments beyond +-12 are saturated in double precision
_U_TOP = 201.0  # tabulate U up to at least this value (above the largest cap, 200)
_Z_RES = 1e-12  # revealed: tabulate z only where u - log(1 - q) > _Z_RES * (1 - q)
_CHUNK = 1 << 19  # matrix entries per vectorised block (memory bound)
# Orders at which prv_accountant's RDP accountant evaluates ``rdp`` (other_accountants.RDP).
_RDP_ORDERS = tuple([1.0 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)])
_GL5 = np.polynomial.legendre.leggauss(5)


class EpsilonOutOfRangeError(RuntimeError):
    """The epsilon of a configuration exceeds what the PRV accountant can represent.

    Raised instead of returning a number that could be too small: the mass at infinity (the
    capped envelope tail ``eta`` plus the loss above the largest cap, 200) reaches delta, the
    discretisation domain would be too large, or prv_accountant cannot locate epsilon. Increase
    the noise multiplier, the sketch dimension or delta.
    """


# =====================================================================================
# Validation helpers
# =====================================================================================
def _check_sigma(noise_multiplier: float) -> float:
    try:
        sigma = float(noise_multiplier)
    except (TypeError, ValueError):
        raise TypeError(f"noise_multiplier must be a number, got {noise_multiplier!r}") from None
    if not (sigma > 0.0 and math.isfinite(sigma)):
        raise ValueError(
            f"noise_multiplier must be a finite number > 0 (noise std / clipping bound), got "
            f"{noise_multiplier!r}"
        )
    return sigma


def _check_q(sample_rate: float) -> float:
    try:
        q = float(sample_rate)
    except (TypeError, ValueError):
        raise TypeError(f"sample_rate must be a number, got {sample_rate!r}") from None
    if not 0.0 < q <= 1.0:
        raise ValueError(
            f"sample_rate must be in (0, 1] (Poisson sampling probability), got {sample_rate!r}"
        )
    return q


def _check_delta(delta: float) -> float:
    try:
        d = float(delta)
    except (TypeError, ValueError):
        raise TypeError(f"delta must be a number, got {delta!r}") from None
    if not 0.0 < d < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return d


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


# =====================================================================================
# Coordinates u <-> z
# =====================================================================================
def _u_of_z(q: float, z: np.ndarray) -> np.ndarray:
    """``u = log(1 - q + q e^z)`` (the log-likelihood ratio as a function of ``z``)."""
    return np.logaddexp(math.log1p(-q) if q < 1.0 else -np.inf, math.log(q) + z)


def _is_sorted(x: np.ndarray) -> bool:
    return x.ndim == 1 and x.size > 1 and bool(np.all(x[1:] >= x[:-1]))


def _z_of_u(q: float, u: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_u_of_z`; ``-inf`` for ``u <= log(1 - q)``."""
    u = np.asarray(u, dtype=float)
    if q == 1.0:
        return u.copy()
    logq = math.log(q)
    out = np.empty(u.shape)
    if _is_sorted(u):  # fast path for the discretisation grid: contiguous slices, no masks
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
class _Vals:
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


class _HiddenModel:
    """Hidden threat model (THEORY.md C.1), parameterised by ``x`` (the 1-D output)."""

    def __init__(self, q: float, sigma: float, quad: EnvelopeQuadrature) -> None:
        self.q, self.sigma, self.quad = q, sigma, quad
        s, w = quad.nodes, quad.weights
        self.s = s
        self.w = w
        self.logw = np.log(w)
        self.mass_q = 1.0 - q * quad.tail_mass  # total finite mass of Q' (THEORY.md C.3 item 1)
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

    def values_x(self, x: np.ndarray) -> _Vals:
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
        return _Vals(lm, A, Abar, B, Bbar, da, d2a, db, d2b)

    def values_z(self, z: np.ndarray) -> _Vals:
        z = np.atleast_1d(np.asarray(z, dtype=float))
        vals = self.values_x(self.x_of_z(z))
        return _Vals(
            z, *(getattr(vals, f) for f in ("A", "Abar", "B", "Bbar", "da", "d2a", "db", "d2b"))
        )

    def grid(self, step: float) -> np.ndarray:
        """The table's knots in ``x``: ``[-12 sigma, x_hi]`` with step ``step * sigma``.

        Above ``x_hi = min(s_max + 12 sigma, x*(z_top))`` both laws are saturated (``B = 1`` to
        ``1e-33``) or ``u`` exceeds every cap; ``z_top`` is where ``u = 201`` (and at least 150,
        where ``A = 1``: ``log m(x) <= x^2 / (2 sigma^2)`` gives ``x >= 17 sigma``).
        """
        sigma, q = self.sigma, self.q
        z_top = max(150.0, _U_TOP - math.log(q))
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


class _RevealedModel:
    """Revealed threat model (THEORY.md C.2), parameterised by the per-``S`` log-likelihood ``z``."""

    def __init__(self, q: float, sigma: float, quad: EnvelopeQuadrature) -> None:
        self.q, self.sigma, self.quad = q, sigma, quad
        self.s = quad.nodes
        self.v = quad.weights / quad.weights.sum()  # law of S conditioned on S <= s_max
        self.sp = sigma / self.s  # sigma' = sigma / s

    def _radius(self, s: float) -> float:
        """Saturation radius: component ``s`` is 0 or 1 (to 1e-33) for ``|z| > R(s)``."""
        return _SAT * s / self.sigma + s * s / (2.0 * self.sigma**2)

    def values_z(self, z: np.ndarray) -> _Vals:
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
            L = np.exp(_u_of_z(q, z))
            qez = q * np.exp(z)
        db = L * da
        d2b = L * d2a + qez * da
        return _Vals(z, A, Abar, B, Bbar, da, d2a, db, d2b)

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
        z_lo = max(-r_max, z_res, -_U_TOP)
        z_hi = min(r_max, _U_TOP - math.log(q))
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


def _quintic_ppoly(
    x: np.ndarray, y: np.ndarray, d1: np.ndarray, d2: np.ndarray
) -> interpolate.PPoly:
    """Quintic Hermite interpolant matching values and first two derivatives at the knots."""
    h = np.diff(x)
    y0, y1 = y[:-1], y[1:]
    a0, a1 = d1[:-1], d1[1:]
    b0, b1 = d2[:-1], d2[1:]
    D = y1 - y0 - a0 * h - 0.5 * b0 * h * h
    Dp = a1 - a0 - b0 * h
    Dpp = b1 - b0
    c3 = (10.0 * D - 4.0 * Dp * h + 0.5 * Dpp * h * h) / h**3
    c4 = (-15.0 * D + 7.0 * Dp * h - Dpp * h * h) / h**4
    c5 = (6.0 * D - 3.0 * Dp * h + 0.5 * Dpp * h * h) / h**5
    c = np.stack([c5, c4, c3, 0.5 * b0, a0, y0])
    return interpolate.PPoly(c, x, extrapolate=False)


class _LossTable:
    """Tabulated ``A, B`` (P- and Q-laws of ``z``) for one ``(q, sigma, k, envelope, mode)``."""

    def __init__(
        self,
        q: float,
        sigma: float,
        sketch_dim: int | None,
        envelope: str,
        mode: str,
        *,
        eta: float = DEFAULT_ETA,
        step: float | None = None,
    ) -> None:
        self.q, self.sigma, self.sketch_dim, self.envelope, self.mode = (
            q,
            sigma,
            sketch_dim,
            envelope,
            mode,
        )
        env = SensitivityEnvelope(sketch_dim=sketch_dim, envelope=envelope)
        self.quad = env.quadrature(eta=eta)
        self.eta = self.quad.tail_mass
        self.t0 = math.log1p(-q) if q < 1.0 else -math.inf  # lower edge of U
        if mode == "hidden":
            self.model = _HiddenModel(q, sigma, self.quad)
            xs = self.model.grid(_X_STEP if step is None else step)
            vals = self.model.values_x(xs)
        else:
            self.model = _RevealedModel(q, sigma, self.quad)
            zs = self.model.grid(_Z_STEP if step is None else step)
            vals = self.model.values_z(zs)
        z = vals.z
        if not np.all(np.diff(z) > 0.0):
            raise RuntimeError(
                f"loss table knots are not increasing (q={q}, sigma={sigma}, k={sketch_dim}, "
                f"mode={mode}); the configuration is outside the tabulated range"
            )
        self.z = z
        self.u = _u_of_z(q, z)
        # (below the first knot, above the last knot): 0 or 1 there to within Phi(-12). The P-law
        # is also 1 above z = 150: hidden, log m(x) <= x^2 / (2 sigma^2) gives x >= 17 sigma;
        # revealed, sigma' z + 1 / (2 sigma') >= sqrt(2 z) >= 17 (AM-GM).
        sat_lo, sat_hi = self.model.saturated
        self._saturated = {"A": (sat_lo, sat_hi or z[-1] >= 150.0), "B": (sat_lo, sat_hi)}
        self.vals = vals
        self._spl = {
            "A": _quintic_ppoly(z, vals.A, vals.da, vals.d2a),
            "Abar": _quintic_ppoly(z, vals.Abar, -vals.da, -vals.d2a),
            "B": _quintic_ppoly(z, vals.B, vals.db, vals.d2b),
            "Bbar": _quintic_ppoly(z, vals.Bbar, -vals.db, -vals.d2b),
        }
        self._dens = {"A": self._spl["A"].derivative(), "B": self._spl["B"].derivative()}
        # first knot where the cdf exceeds 1/2: splines of the cdf below, of the sf above
        self._split = {
            name: float(z[min(int(np.searchsorted(getattr(vals, name), 0.5)), z.size - 1)])
            for name in ("A", "B")
        }

    @property
    def size(self) -> int:
        return int(self.z.size)

    def exact(self, z: np.ndarray) -> _Vals:
        """Exact (untabulated) values at ``z``; slow, for out-of-table points and tests."""
        return self.model.values_z(z)

    def law(self, name: str, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(cdf, sf)`` of the P-law (``name="A"``) or Q-law (``"B"``) of ``z`` at ``z``.

        Inside the knots: the quintic spline of the cdf below the median knot and of the
        survival function above it (the other is one minus it, so both keep full relative
        precision). Outside: exact evaluation. ``z = -inf`` gives ``(0, 1)``, ``+inf`` ``(1, 0)``.
        """
        z = np.asarray(z, dtype=float)
        shape = z.shape
        z = z.ravel()
        if not _is_sorted(z):
            cdf, sf = self._law_general(name, z)
        else:  # fast path for sorted grids (the discretisation): contiguous slices, no masks
            cdf = np.empty_like(z)
            sf = np.empty_like(z)
            i_lo = int(np.searchsorted(z, self.z[0], side="left"))
            i_split = max(i_lo, int(np.searchsorted(z, self._split[name], side="left")))
            i_hi = max(i_split, int(np.searchsorted(z, self.z[-1], side="right")))
            c = self._spl[name](z[i_lo:i_split])
            cdf[i_lo:i_split], sf[i_lo:i_split] = c, 1.0 - c
            c = self._spl[name + "bar"](z[i_split:i_hi])
            cdf[i_split:i_hi], sf[i_split:i_hi] = 1.0 - c, c
            for sl in (slice(0, i_lo), slice(i_hi, z.size)):
                if sl.stop > sl.start:
                    cdf[sl], sf[sl] = self._law_general(name, z[sl])
        return np.clip(cdf, 0.0, 1.0).reshape(shape), np.clip(sf, 0.0, 1.0).reshape(shape)

    def _law_general(self, name: str, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`law` for a flat array in any order (masks; exact evaluation off the table)."""
        cdf = np.empty_like(z)
        sf = np.empty_like(z)
        split = self._split[name]
        low = (z >= self.z[0]) & (z < split)
        high = (z >= split) & (z <= self.z[-1])
        if low.any():
            c = self._spl[name](z[low])
            cdf[low], sf[low] = c, 1.0 - c
        if high.any():
            c = self._spl[name + "bar"](z[high])
            cdf[high], sf[high] = 1.0 - c, c
        # beyond a saturated end the laws are 0 or 1 to within Phi(-12) = 1.8e-33
        sat_lo, sat_hi = self._saturated[name]
        lo_inf = (z == -np.inf) | ((z < self.z[0]) & sat_lo)
        hi_inf = (z == np.inf) | ((z > self.z[-1]) & sat_hi)
        cdf[lo_inf], sf[lo_inf] = 0.0, 1.0
        cdf[hi_inf], sf[hi_inf] = 1.0, 0.0
        nan = np.isnan(z)
        rest = ~low & ~high & ~lo_inf & ~hi_inf & ~nan
        if rest.any():
            ex = self.exact(z[rest])
            cdf[rest] = getattr(ex, name)
            sf[rest] = getattr(ex, name + "bar")
        cdf[nan] = np.nan
        sf[nan] = np.nan
        return cdf, sf

    def partial_moment(self, name: str, u1: float, u2: float) -> float:
        """``E[U 1{u1 < U <= u2}]`` under the P-law (``"A"``) or Q-law (``"B"``) of ``U``.

        Inside the knots: 5-point Gauss-Legendre per knot interval of ``u(z) dF(z)`` with the
        spline density. Outside (mass below ``1e-12`` wide in ``u`` or saturated): mass times the
        nearest knot's ``u``.
        """
        zs = _z_of_u(self.q, np.array([u1, u2], dtype=float))
        z1, z2 = float(zs[0]), float(zs[1])
        if not z2 > z1:
            return 0.0
        total = 0.0
        lo, hi = max(z1, self.z[0]), min(z2, self.z[-1])
        if hi > lo:
            k = self.z[(self.z > lo) & (self.z < hi)]
            pts = np.concatenate([[lo], k, [hi]])
            a, b = pts[:-1, None], pts[1:, None]
            gx, gw = _GL5
            nodes = (0.5 * (a + b) + 0.5 * (b - a) * gx).ravel()
            wts = (0.5 * (b - a) * gw).ravel()
            dens = self._dens[name](nodes)
            total += float(np.sum(wts * dens * _u_of_z(self.q, nodes)))
        if z1 < self.z[0]:
            top = min(self.z[0], z2)
            c = self.law(name, np.array([z1, top]))[0]
            total += float(c[1] - c[0]) * float(_u_of_z(self.q, np.array(top)))
        if z2 > self.z[-1]:
            bot = max(self.z[-1], z1)
            sfv = self.law(name, np.array([bot, z2]))[1]
            total += float(sfv[0] - sfv[1]) * float(_u_of_z(self.q, np.array(bot)))
        return total


@functools.lru_cache(maxsize=24)
def _loss_table(
    q: float, sigma: float, sketch_dim: int | None, envelope: str, mode: str
) -> _LossTable:
    return _LossTable(q, sigma, sketch_dim, envelope, mode)


def loss_table_cache_clear() -> None:
    """Empty the per-``(q, sigma, k, envelope, mode)`` table cache (for benchmarks)."""
    _loss_table.cache_clear()


# =====================================================================================
# The PRV
# =====================================================================================
class RandomizedClippingPRV(PrivacyRandomVariable):
    """Per-step privacy loss random variable of DP-SGD-RC (THEORY.md C.1-C.3).

    ``cdf`` is the CDF *conditioned on a finite value*, as ``prv_accountant`` expects; the mass at
    ``+inf`` is :attr:`pm_inf`. With ``t_cap`` set, the loss is capped (C.3 item 4):
    ``cdf(t) = F(min(t, t_cap)) / F(t_cap)`` and ``pm_inf = eta + (1 - eta)(1 - F(t_cap))``.
    Tables are cached per ``(q, sigma, k, envelope, mode)`` and shared by both directions.

    Args:
        noise_multiplier: ``sigma``, noise std in units of the clipping bound (> 0).
        sample_rate: ``q``, Poisson sampling probability, in ``(0, 1]``.
        sketch_dim: ``k`` of the envelope (tail columns for Hutch++), or ``None`` for exact
            clipping.
        envelope: ``"chi2"`` or ``"chernoff"`` (THEORY.md B.3).
        threat_model: ``"hidden"`` (per-sample secret sketches) or ``"revealed"`` (B.2).
        direction: ``"remove"`` (``Y_R``) or ``"add"`` (``Y_A``) (B.5).
        t_cap: Cap of the loss, or ``None`` for the uncapped PRV.

    Raises:
        ValueError: on out-of-range parameters.
    """

    def __init__(
        self,
        *,
        noise_multiplier: float,
        sample_rate: float,
        sketch_dim: int | None = None,
        envelope: str = "chi2",
        threat_model: str = "hidden",
        direction: str = "remove",
        t_cap: float | None = None,
    ) -> None:
        sigma = _check_sigma(noise_multiplier)
        q = _check_q(sample_rate)
        _check_choice("envelope", envelope, ENVELOPES)
        _check_choice("threat_model", threat_model, THREAT_MODELS)
        _check_choice("direction", direction, DIRECTIONS)
        SensitivityEnvelope(sketch_dim=sketch_dim, envelope=envelope)  # validates sketch_dim
        if sketch_dim is None:
            envelope, threat_model = "chi2", "hidden"  # S = 1: one law, share the table
        self.noise_multiplier = sigma
        self.sample_rate = q
        self.sketch_dim = sketch_dim
        self.envelope = envelope
        self.threat_model = threat_model
        self.direction = direction
        self._table = _loss_table(q, sigma, sketch_dim, envelope, threat_model)
        self.t_cap = None if t_cap is None else float(t_cap)
        if self.t_cap is not None:
            f, fb = self._uncapped(np.array([self.t_cap]))
            self._f_cap, self._fbar_cap = float(f[0]), float(fb[0])
            if not self._f_cap > 0.0:
                raise ValueError(f"t_cap={t_cap} leaves no finite mass")
        self._rdp_cache: dict[float, float] = {}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(noise_multiplier={self.noise_multiplier}, "
            f"sample_rate={self.sample_rate}, sketch_dim={self.sketch_dim}, "
            f"envelope={self.envelope!r}, threat_model={self.threat_model!r}, "
            f"direction={self.direction!r}, t_cap={self.t_cap})"
        )

    @property
    def eta(self) -> float:
        """Mass of ``S > s_max`` treated as fully revealing."""
        return self._table.eta

    def with_cap(self, t_cap: float | None) -> RandomizedClippingPRV:
        """The same PRV with another cap (shares the cached table)."""
        return RandomizedClippingPRV(
            noise_multiplier=self.noise_multiplier,
            sample_rate=self.sample_rate,
            sketch_dim=self.sketch_dim,
            envelope=self.envelope,
            threat_model=self.threat_model,
            direction=self.direction,
            t_cap=t_cap,
        )

    # ------------------------------------------------------------------ distribution
    def _uncapped(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(P(Y <= t), P(Y > t))`` of the uncapped finite PRV."""
        t = np.asarray(t, dtype=float)
        if self.direction == "remove":
            return self._table.law("B", _z_of_u(self.sample_rate, t))
        a, abar = self._table.law("A", _z_of_u(self.sample_rate, -t))
        return abar, a

    def cdf_sf(self, t: float | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(cdf(t), 1 - cdf(t))``, the second computed directly (full relative precision)."""
        t = np.asarray(t, dtype=np.float64)
        if self.t_cap is None:
            return self._uncapped(t)
        tc = np.minimum(t, self.t_cap)
        f, fb = self._uncapped(tc)
        cdf = np.where(t >= self.t_cap, 1.0, f / self._f_cap)
        sf = np.where(t >= self.t_cap, 0.0, np.maximum(fb - self._fbar_cap, 0.0) / self._f_cap)
        return np.minimum(cdf, 1.0), sf

    def cdf(self, t):
        """CDF of the finite part (vectorised; accepts floats and ``longdouble`` arrays)."""
        c = self.cdf_sf(t)[0]
        return c if c.ndim else float(c)

    def sf(self, t):
        """``1 - cdf(t)``, computed directly."""
        s = self.cdf_sf(t)[1]
        return s if s.ndim else float(s)

    def probability(self, a, b):
        """``P(a < Y <= b)`` of the finite part, from the survival function in the upper half."""
        ca, sa = self.cdf_sf(a)
        cb, sb = self.cdf_sf(b)
        p = np.where(ca > 0.5, sa - sb, cb - ca)
        return np.maximum(p, 0.0)

    @property
    def pm_inf(self) -> float:
        """Mass at ``+inf``: ``eta`` plus, if capped, the finite mass above ``t_cap``."""
        if self.t_cap is None:
            return self.eta
        return self.eta + (1.0 - self.eta) * self._fbar_cap

    def partial_expectation(self, a: float, b: float) -> float:
        """``E[Y 1{a < Y <= b}]`` of the finite (capped, conditioned) PRV."""
        a, b = float(a), float(b)
        if self.t_cap is not None:
            b = min(b, self.t_cap)
            if not b > a:
                return 0.0
        if self.direction == "remove":
            val = self._table.partial_moment("B", a, b)
        else:
            # Y = -U with U ~ A-law: a < Y <= b  <=>  -b <= U < -a
            val = -self._table.partial_moment("A", -b, -a)
        return val / (self._f_cap if self.t_cap is not None else 1.0)

    def mean(self) -> float:
        """Mean of the finite PRV (the capped one if ``t_cap`` is set)."""
        return self.partial_expectation(-np.inf, np.inf)

    # ------------------------------------------------------------------ RDP (domain sizing)
    def rdp(self, alpha: float) -> float:
        """A finite upper bound on the Renyi divergence of order ``alpha`` of the *capped* PRV.

        ``(1 / (alpha - 1)) log E[e^{(alpha - 1) Y}]`` with the mass of every knot interval
        moved to its upper end (THEORY.md C.3 item 5). Used only by
        ``compute_safe_domain_size`` to size the discretisation domain: the RDP of randomized
        clipping itself is infinite (B.6).

        Raises:
            ValueError: if the PRV is uncapped and heavy-tailed (the bound would be infinite).
        """
        alpha = float(alpha)
        if alpha not in self._rdp_cache:
            orders = np.array(sorted(set(_RDP_ORDERS) | {alpha}))
            vals = self._rdp_vector(orders)
            self._rdp_cache.update(dict(zip(orders.tolist(), vals.tolist())))
        return self._rdp_cache[alpha]

    def _rdp_vector(self, orders: np.ndarray) -> np.ndarray:
        tab = self._table
        remove = self.direction == "remove"
        # largest finite value of Y: the cap, and for the add direction also -log(1 - q)
        y_max = math.inf if self.t_cap is None else self.t_cap
        if not remove:
            y_max = min(y_max, -tab.t0)
        if not math.isfinite(y_max):
            raise ValueError(
                f"{self!r}: the rdp of an uncapped randomized-clipping PRV is infinite; cap it"
            )
        # Y-values of the knots (increasing) below y_max, then 64 exactly evaluated points up
        # to y_max, so that no mass is moved far beyond where it lies
        ys = np.sort(tab.u if remove else -tab.u)
        ys = ys[ys < y_max]
        last = ys[-1] if ys.size else y_max - 1.0
        ys = np.concatenate([ys, np.linspace(last, y_max, 65)[1:]])
        c, s = self.cdf_sf(ys)
        mass = np.empty_like(ys)
        mass[0] = c[0]
        mass[1:] = np.where(c[:-1] > 0.5, s[:-1] - s[1:], c[1:] - c[:-1])
        keep = mass > 0.0
        lm, yk = np.log(mass[keep]), ys[keep]
        a1 = orders - 1.0
        logmgf = special.logsumexp(lm[None, :] + a1[:, None] * yk[None, :], axis=1)
        return np.maximum(logmgf, 0.0) / a1


def choose_t_cap(
    prv: RandomizedClippingPRV,
    *,
    steps: int,
    delta: float,
    fraction: float = CAP_DELTA_FRACTION,
) -> float:
    """Smallest cap in :data:`CAP_GRID` with ``steps * P(Y > t_cap) <= fraction * delta``.

    THEORY.md C.3 item 4; ``steps`` is the total number of composed steps. If no cap up to 200
    qualifies, 200 is returned: capping is valid at any level (the mass above the cap goes to
    ``pm_inf``), it only spends more of delta, and :func:`compose_epsilon` raises
    :class:`EpsilonOutOfRangeError` if the mass at infinity reaches delta.
    """
    base = prv.with_cap(None) if prv.t_cap is not None else prv
    sf = base.sf(CAP_GRID)
    ok = np.nonzero(steps * sf <= fraction * delta)[0]
    return float(CAP_GRID[ok[0]] if ok.size else CAP_GRID[-1])


# =====================================================================================
# Composition
# =====================================================================================
def _fast_domain(L: float, mesh: float) -> Domain:
    """``Domain.create_aligned(-L', L', mesh)`` with ``L' >= L`` chosen so that the number of
    points is an even FFT-friendly (5-smooth) length. A wider domain is always safe."""
    c = int(math.ceil(L / mesh))
    m = sp_fft.next_fast_len(2 * c + 2, real=True)
    while m % 2:
        m = sp_fft.next_fast_len(m + 1, real=True)
    c2 = (m - 2) // 2
    return Domain.create_aligned(-(c2 - 0.5) * mesh, (c2 - 0.5) * mesh, mesh)


def _discretise(prv: RandomizedClippingPRV, domain: Domain) -> DiscretePrivacyRandomVariable:
    """Cell-centred discretisation of ``prv`` truncated to ``domain``.

    Equivalent to ``prv_accountant``'s ``CellCentred().discretise(
    PrivacyRandomVariableTruncated(prv, t_min, t_max), domain)``: cell masses on
    ``[t - dt/2, t + dt/2]`` clipped to ``[t_min, t_max]`` and renormalised, then the grid is
    shifted so that the discrete mean equals the continuous (truncated) mean. Differences: the
    CDF is evaluated once per cell edge (with survival differences in the upper half), the mean
    is integrated from the spline, and ``log(1 - pm_inf)`` uses ``log1p``.

    Raises:
        RuntimeError: if the mean shift is not below half a cell (as prv_accountant).
    """
    t_min, t_max, dt, n = domain.t_min(), domain.t_max(), domain.dt(), len(domain)
    edges = np.clip(t_min - dt / 2.0 + dt * np.arange(n + 1, dtype=np.float64), t_min, t_max)
    c, s = prv.cdf_sf(edges)
    f = np.where(c[:-1] > 0.5, s[:-1] - s[1:], c[1:] - c[:-1])
    f = np.maximum(f, 0.0)
    remaining = float(prv.probability(t_min, t_max))
    if not remaining > 0.0:
        raise EpsilonOutOfRangeError(f"{prv!r} has no mass on the domain [{t_min}, {t_max}]")
    f = f / remaining
    mean_d = np.dot(domain.ts(), f)
    mean_c = prv.partial_expectation(t_min, t_max) / remaining
    shift = mean_c - mean_d
    if not abs(shift) < dt / 2.0:
        raise RuntimeError(
            f"discrete mean of {prv!r} differs from its continuous mean by {float(shift):.3g} "
            f"(more than half a cell, {dt / 2:.3g}); try a smaller eps_error"
        )
    return DiscretePrivacyRandomVariable(
        f, domain.shift_right(shift), log_pmc_inf=math.log1p(-prv.pm_inf)
    )


def compose_epsilon(
    prvs: Sequence[RandomizedClippingPRV],
    steps: Sequence[int],
    *,
    delta: float,
    eps_error: float = 0.01,
    delta_error: float | None = None,
) -> tuple[float, float, float]:
    """``(lower, estimate, upper)`` epsilon of the composition of ``prvs[i]`` ``steps[i]`` times.

    The pipeline of ``prv_accountant.PRVAccountant`` (Gopi et al. 2021): domain half-width
    ``L`` from ``compute_safe_domain_size`` (RDP of the capped PRVs), mesh
    ``eps_error / sqrt(sum(steps) / 2 * log(12 / delta_error))`` (Theorem 5.5 of
    arXiv:2106.02848), cell-centred discretisation with mean correction, FFT composition.

    Args:
        prvs: Capped PRVs (one per distinct step configuration).
        steps: Number of steps of each, >= 1.
        delta: Target delta in (0, 1).
        eps_error: Epsilon error of the discretisation (> 0).
        delta_error: Delta error; default ``delta / 1000``.

    Raises:
        EpsilonOutOfRangeError: if epsilon cannot be represented (mass at infinity >= delta,
            domain too large, or prv_accountant cannot locate epsilon).
    """
    delta = _check_delta(delta)
    if not eps_error > 0.0:
        raise ValueError(f"eps_error must be > 0, got {eps_error}")
    delta_error = delta / 1000.0 if delta_error is None else float(delta_error)
    if not 0.0 < delta_error < delta:
        raise ValueError(f"delta_error must be in (0, delta), got {delta_error}")
    steps = [int(n) for n in steps]
    if len(steps) != len(prvs) or not prvs or min(steps) < 1:
        raise ValueError("compose_epsilon needs one positive step count per PRV")
    total = sum(steps)
    pm_inf_total = -math.expm1(sum(n * math.log1p(-p.pm_inf) for p, n in zip(prvs, steps)))
    if pm_inf_total >= delta - delta_error:
        raise EpsilonOutOfRangeError(
            f"the mass at infinity of the composed privacy loss ({pm_inf_total:.3g}) is not "
            f"below delta - delta_error ({delta - delta_error:.3g}): epsilon is infinite at this "
            "delta. Increase delta, noise_multiplier or sketch_dim."
        )
    L = compute_safe_domain_size(list(prvs), steps, eps_error=eps_error, delta_error=delta_error)
    mesh = eps_error / math.sqrt(total / 2.0 * math.log(12.0 / delta_error))
    if not math.isfinite(L) or 2.0 * L / mesh > MAX_DOMAIN_POINTS:
        raise EpsilonOutOfRangeError(
            f"the discretisation domain [-{L:.4g}, {L:.4g}] at mesh {mesh:.3g} needs more than "
            f"{MAX_DOMAIN_POINTS} points: epsilon exceeds what the PRV accountant supports. "
            "Increase noise_multiplier or eps_error."
        )
    domain = _fast_domain(L, mesh)
    dprvs = [_discretise(p, domain) for p in prvs]
    composed = Heterogeneous(dprvs).compute_composition(steps)
    try:
        lower, est, upper = composed.compute_epsilon(delta, delta_error, eps_error)
    except (RuntimeError, ValueError) as err:
        raise EpsilonOutOfRangeError(
            f"prv_accountant could not locate epsilon ({err}); the configuration is outside the "
            "supported range"
        ) from err
    if not math.isfinite(upper) or upper >= domain.t_max():
        raise EpsilonOutOfRangeError(
            f"epsilon ({upper}) reaches the edge of the discretisation domain ({domain.t_max():.4g})"
        )
    return float(lower), float(est), float(upper)


@dataclass(frozen=True)
class Segment:
    """A run of identical steps: ``steps`` steps of noise ``sigma`` and rate ``q`` with sketch ``k``.

    Attributes:
        noise_multiplier: ``sigma`` (noise std / clipping bound), > 0.
        sample_rate: ``q`` in ``(0, 1]``.
        steps: Number of steps, >= 0.
        sketch_dim: ``k`` of the envelope, or ``None`` for exact clipping.
        threat_model: ``"hidden"`` or ``"revealed"`` for this run of steps.
    """

    noise_multiplier: float
    sample_rate: float
    steps: int
    sketch_dim: int | None = None
    threat_model: str = "hidden"

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", _check_sigma(self.noise_multiplier))
        object.__setattr__(self, "sample_rate", _check_q(self.sample_rate))
        if isinstance(self.steps, bool) or int(self.steps) != self.steps or self.steps < 0:
            raise ValueError(f"steps must be an integer >= 0, got {self.steps!r}")
        object.__setattr__(self, "steps", int(self.steps))
        SensitivityEnvelope(sketch_dim=self.sketch_dim)  # validates
        _check_choice("threat_model", self.threat_model, THREAT_MODELS)
        if self.sketch_dim is None:
            object.__setattr__(self, "threat_model", "hidden")  # S = 1: both models coincide
        else:
            object.__setattr__(self, "sketch_dim", int(self.sketch_dim))

    @property
    def key(self) -> tuple:
        return (self.noise_multiplier, self.sample_rate, self.sketch_dim, self.threat_model)


@dataclass(frozen=True)
class EpsilonReport:
    """Epsilon bounds of a composition in both adjacency directions.

    Attributes:
        remove: ``(lower, estimate, upper)`` for the remove direction.
        add: ``(lower, estimate, upper)`` for the add direction.
        delta: The delta the bounds are for.
    """

    remove: tuple[float, float, float]
    add: tuple[float, float, float]
    delta: float

    @property
    def upper(self) -> float:
        """The guaranteed epsilon: max over directions of the upper bounds."""
        return max(self.remove[2], self.add[2])

    @property
    def estimate(self) -> float:
        """Max over directions of the estimates (what THEORY.md C.6 tabulates)."""
        return max(self.remove[1], self.add[1])

    @property
    def dominant_direction(self) -> str:
        """``"remove"`` or ``"add"``, whichever gives the larger upper bound."""
        return "remove" if self.remove[2] >= self.add[2] else "add"


def compute_epsilon(
    segments: Sequence[Segment],
    *,
    delta: float,
    envelope: str = "chi2",
    eps_error: float = 0.01,
    delta_error: float | None = None,
) -> EpsilonReport:
    """Epsilon of a (possibly heterogeneous) history of DP-SGD-RC steps, both directions.

    Identical segments are merged (composition is commutative); each distinct configuration
    gets one PRV per direction, capped by :func:`choose_t_cap` with the total step count.

    Args:
        segments: The runs of steps.
        delta: Target delta in (0, 1).
        envelope: ``"chi2"`` or ``"chernoff"``.
        eps_error: Epsilon error of the discretisation.
        delta_error: Delta error; default ``delta / 1000``.

    Returns:
        An :class:`EpsilonReport`; all zeros for an empty history.

    Raises:
        EpsilonOutOfRangeError: if epsilon exceeds what the PRV accountant supports.
    """
    delta = _check_delta(delta)
    _check_choice("envelope", envelope, ENVELOPES)
    grouped: dict[tuple, int] = {}
    for seg in segments:
        if seg.steps:
            grouped[seg.key] = grouped.get(seg.key, 0) + seg.steps
    if not grouped:
        zero = (0.0, 0.0, 0.0)
        return EpsilonReport(remove=zero, add=zero, delta=delta)
    total = sum(grouped.values())
    prvs: dict[str, list[RandomizedClippingPRV]] = {d: [] for d in DIRECTIONS}
    for sigma, q, k, mode in grouped:
        for direction in DIRECTIONS:  # consecutive: both directions share one cached table
            prv = RandomizedClippingPRV(
                noise_multiplier=sigma,
                sample_rate=q,
                sketch_dim=k,
                envelope=envelope,
                threat_model=mode,
                direction=direction,
            )
            prvs[direction].append(prv.with_cap(choose_t_cap(prv, steps=total, delta=delta)))
    out = {
        direction: compose_epsilon(
            prvs[direction],
            list(grouped.values()),
            delta=delta,
            eps_error=eps_error,
            delta_error=delta_error,
        )
        for direction in DIRECTIONS
    }
    return EpsilonReport(remove=out["remove"], add=out["add"], delta=delta)
