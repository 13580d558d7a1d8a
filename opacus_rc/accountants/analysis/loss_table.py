"""Tables of one step's privacy loss: quintic Hermite splines of the laws ``A`` and ``B``.

For one ``(q, sigma, k, envelope, threat model)``, :class:`LossTable` tabulates the P-law ``A``
and the Q-law ``B`` of the coordinate ``z`` (:mod:`~opacus_rc.accountants.analysis.threat_models`)
at the knots of the threat model's grid, with their first two derivatives in ``z``, and
interpolates them by quintic Hermite splines (the cdf below the median knot, the survival
function above it, so both keep full relative precision); points outside the table are evaluated
exactly. This replaces the reference recipe of docs/privacy/prv.md#prv-tables (cubic Hermite root
inversion on a ``2e-3 sigma`` grid) by an equivalent, faster one: the spline error against exact
evaluation is below ``1e-13`` (tested). Tables are cached per configuration (:func:`loss_table`).

Pure numpy/scipy; no Opacus import.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import interpolate

from opacus_rc.accountants.analysis.envelope import DEFAULT_ETA, SensitivityEnvelope
from opacus_rc.accountants.analysis.threat_models import (
    THREAT_MODEL_CLASSES,
    LossValues,
    is_sorted,
    u_of_z,
    z_of_u,
)

__all__ = ["LossTable", "loss_table", "loss_table_cache_clear"]

_GL5 = np.polynomial.legendre.leggauss(5)


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


class LossTable:
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
        self.model = THREAT_MODEL_CLASSES[mode](q, sigma, self.quad)
        vals = self.model.knots(self.model.default_step if step is None else step)
        z = vals.z
        if not np.all(np.diff(z) > 0.0):
            raise RuntimeError(
                f"loss table knots are not increasing (q={q}, sigma={sigma}, k={sketch_dim}, "
                f"mode={mode}); the configuration is outside the tabulated range"
            )
        self.z = z
        self.u = u_of_z(q, z)
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

    def exact(self, z: np.ndarray) -> LossValues:
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
        if not is_sorted(z):
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
        zs = z_of_u(self.q, np.array([u1, u2], dtype=float))
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
            total += float(np.sum(wts * dens * u_of_z(self.q, nodes)))
        if z1 < self.z[0]:
            top = min(self.z[0], z2)
            c = self.law(name, np.array([z1, top]))[0]
            total += float(c[1] - c[0]) * float(u_of_z(self.q, np.array(top)))
        if z2 > self.z[-1]:
            bot = max(self.z[-1], z1)
            sfv = self.law(name, np.array([bot, z2]))[1]
            total += float(sfv[0] - sfv[1]) * float(u_of_z(self.q, np.array(bot)))
        return total


@functools.lru_cache(maxsize=32)
def loss_table(
    q: float,
    sigma: float,
    sketch_dim: int | None,
    envelope: str,
    mode: str,
    eta: float = DEFAULT_ETA,
) -> LossTable:
    """The cached :class:`LossTable` of ``(q, sigma, k, envelope, threat model, eta)``."""
    return LossTable(q, sigma, sketch_dim, envelope, mode, eta=eta)


def loss_table_cache_clear() -> None:
    """Empty the per-``(q, sigma, k, envelope, mode, eta)`` table cache (for benchmarks)."""
    loss_table.cache_clear()
