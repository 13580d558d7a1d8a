"""Discretised privacy losses: exponentially tilted vectors on a grid and what is done to them.

The pieces of :mod:`~opacus_rc.accountants.analysis.compose` (docs/privacy/error_budget.md has the
argument): the cell-centred, mean-preserving discretisation of one step (:func:`discretise`,
with the pessimistic moves of its tails), the law of a sum of independent copies by one
circular FFT on a Chernoff-sized window (:func:`product`), the unbiased re-discretisation of a
block on a coarser mesh (:func:`coarsen`), and the bounds on the log-MGF of a discretised step
that size the windows (:class:`StepMgf`, :class:`MgfBound`). Every vector is stored tilted,
``p_i = v_i e^{K(lambda) - lambda t_i}``, so that tails keep relative precision.

Pure numpy/scipy; no Opacus import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import fft as sp_fft
from scipy import special

from opacus_rc.accountants.analysis.errors import NumericalLimitError
from opacus_rc.accountants.analysis.prv import RandomizedClippingPRV

__all__ = [
    "MAX_FFT_POINTS",
    "STEP_TAIL",
    "WINDOW_TAIL",
    "MgfBound",
    "StepMgf",
    "TiltedPmf",
    "chernoff_window",
    "coarsen",
    "discretise",
    "lower_end",
    "product",
    "upper_end",
]

#: Largest FFT length of one composition (points); beyond it :class:`NumericalLimitError`.
MAX_FFT_POINTS = 2**24
#: Tail mass (of the tilted laws) that a composition window may cut, per side.
WINDOW_TAIL = 1e-13
#: Largest mass of each tail of a step moved to the window's ends (the lower one up to the
#: lower end, the upper one to ``+inf``, item 1); :func:`compose_prvs` uses
#: ``min(STEP_TAIL, 1e-4 delta_error / steps)``.
STEP_TAIL = 1e-12
_THETA = np.geomspace(1e-4, 1e6, 101)  # Chernoff exponents (1 / loss units)
_BINS = 1024  # bins of the compressed log-MGF of a step


def _lse(x: np.ndarray) -> np.ndarray:
    """``log sum exp`` over the last axis (rows of ``-inf`` give ``-inf``)."""
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.sum(np.exp(x - m), axis=-1)) + m[..., 0]


# =====================================================================================
# Log-MGF bounds of a discretised step (for windows and the tilt)
# =====================================================================================
@dataclass(frozen=True)
class StepMgf:
    """Bounds on ``K(theta) = log E[e^{theta Y~}; Y~ finite]`` of a discretised step.

    The cells are grouped into at most ``_BINS`` bins of mass ``m_b``, mass-weighted centre
    ``c_b`` and width ``w_b``. Within a bin ``Y~ - c_b`` has mean zero and range ``w_b``, so
    Hoeffding's lemma gives ``K(theta) <= log sum_b m_b e^{theta c_b + theta^2 w_b^2 / 8}``
    (:meth:`upper`) and Jensen's inequality ``K(theta) >= log sum_b m_b e^{theta c_b}``
    (:meth:`lower`).
    """

    log_mass: np.ndarray  # (nbins,)
    centre: np.ndarray  # (nbins,)
    width: np.ndarray  # (nbins,)

    @classmethod
    def from_pmf(cls, log_mass: np.ndarray, positions: np.ndarray) -> StepMgf:
        n = log_mass.size
        per = max(1, int(math.ceil(n / _BINS)))
        pad = (-n) % per
        lm = np.concatenate([log_mass, np.full(pad, -np.inf)]).reshape(-1, per)
        pos = np.concatenate([positions, np.full(pad, positions[-1])]).reshape(-1, per)
        blm = special.logsumexp(lm, axis=1)
        keep = np.isfinite(blm)
        w = np.exp(lm[keep] - blm[keep, None])
        centre = (w * pos[keep]).sum(axis=1)
        width = pos[keep, -1] - pos[keep, 0]
        return cls(blm[keep], centre, width)

    def upper(self, theta: np.ndarray) -> np.ndarray:
        theta = np.atleast_1d(np.asarray(theta, dtype=float))[:, None]
        e = self.log_mass + theta * self.centre + theta**2 * self.width**2 / 8.0
        return _lse(e)

    def lower(self, theta: np.ndarray) -> np.ndarray:
        theta = np.atleast_1d(np.asarray(theta, dtype=float))[:, None]
        return _lse(self.log_mass + theta * self.centre)

    def moments(self, lam: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Approximate ``(K, K', K'')`` at ``lam`` (bin centres; for choosing the tilt only)."""
        lam = np.atleast_1d(np.asarray(lam, dtype=float))
        c = self.centre
        e = self.log_mass[None, :] + lam[:, None] * c[None, :]
        k = _lse(e)
        w = np.exp(e - k[:, None])
        m1 = (w * c).sum(axis=1)
        m2 = (w * (c - m1[:, None]) ** 2).sum(axis=1)
        return k, m1, np.maximum(m2, 1e-300)


@dataclass(frozen=True)
class MgfBound:
    """Bounds on the log-MGF of a composed object: ``sum_j counts[j] K_j +- |theta| slack``."""

    counts: tuple[float, ...]
    slack: float = 0.0

    def __add__(self, other: MgfBound) -> MgfBound:
        return MgfBound(
            tuple(a + b for a, b in zip(self.counts, other.counts)), self.slack + other.slack
        )

    def times(self, n: int) -> MgfBound:
        return MgfBound(tuple(n * a for a in self.counts), n * self.slack)

    def coarsened(self, mesh: float) -> MgfBound:
        return MgfBound(self.counts, self.slack + mesh)

    def bound(self, steps: Sequence[StepMgf], theta: np.ndarray, up: bool) -> np.ndarray:
        out = np.zeros(np.shape(theta))
        for c, s in zip(self.counts, steps):
            if c:
                out = out + c * (s.upper(theta) if up else s.lower(theta))
        return out + (1.0 if up else -1.0) * np.abs(theta) * self.slack


def chernoff_window(
    mgf: MgfBound, steps: Sequence[StepMgf], lam: float, log_tail: float
) -> tuple[float, float]:
    """``(lo, hi)`` with tilted mass ``<= e^{-log_tail}`` below ``lo`` and above ``hi``.

    Under the law tilted by ``lam``, ``P(X >= hi) <= exp(K(lam + th) - K(lam) - th hi)`` and
    ``P(X <= lo) <= exp(K(lam - th) - K(lam) + th lo)`` for every ``th > 0``, with ``K`` bounded
    above in the numerator and below in the denominator (:class:`MgfBound`).
    """
    k0 = float(mgf.bound(steps, np.array([lam]), up=False)[0])
    up = mgf.bound(steps, lam + _THETA, up=True) - k0
    down = mgf.bound(steps, lam - _THETA, up=True) - k0
    hi = float(np.min((up + log_tail) / _THETA))
    lo = float(np.max(-(down + log_tail) / _THETA))
    return lo, hi


# =====================================================================================
# Tilted sub-probability vectors on a grid
# =====================================================================================
@dataclass
class TiltedPmf:
    """A sub-probability on ``offset + mesh * arange(n)``, stored tilted by ``lam``.

    The mass at ``t_i`` is ``v[i] exp(log_mgf - lam t_i)``; ``sum(v) = 1`` and ``log_mgf`` is
    ``log sum_i p_i e^{lam t_i}``. ``p_inf`` is the mass at ``+inf``, ``nu2`` the sum of the
    squared widths of the rounding errors inside, ``misplaced`` a bound on the tilted mass
    (total variation) that windows have moved, ``mgf`` the log-MGF bounds.
    """

    v: np.ndarray
    offset: float
    mesh: float
    lam: float
    log_mgf: float
    p_inf: float
    nu2: float
    mgf: MgfBound
    misplaced: float = 0.0
    ops: float = 0.0  # FFT stages behind it, with multiplicity (round-off allowance)

    @property
    def top(self) -> float:
        return self.offset + self.mesh * (self.v.size - 1)


_PROBE = np.concatenate([-np.geomspace(1e4, 1e-8, 97), [0.0], np.geomspace(1e-8, 1e4, 97)])


def lower_end(prv: RandomizedClippingPRV, tail: float = STEP_TAIL) -> float:
    """A point ``a`` with ``P(Y < a) <= tail``; the mass below is moved up to it
    (docs/privacy/error_budget.md section 2).

    Any ``a`` keeps the bound valid; this one (found on a probe grid, then refined twice)
    keeps the moved mass negligible.
    """
    q = prv.sample_rate
    if prv.direction == "remove" and q < 1.0:
        return math.log1p(-q)  # the remove PRV lives on (log(1 - q), inf)
    pts = _PROBE
    for _ in range(3):
        c = prv.cdf(pts)
        below = np.nonzero(c <= tail)[0]
        if below.size == 0:
            return float(pts[0])
        i = int(below[-1])
        lo, hi = float(pts[i]), float(pts[min(i + 1, pts.size - 1)])
        pts = np.linspace(lo, hi, 65)
    return lo


def upper_end(prv: RandomizedClippingPRV, tail: float = STEP_TAIL) -> tuple[float, float]:
    """``(b, P(Y > b))``: a point at most the cap with ``P(Y > b) <= tail`` (if the cap does not
    stop it first). The mass above ``b`` is sent to ``+inf`` (item 1: it raises delta by at
    most ``tail`` per step)."""
    top = prv.t_cap if prv.t_cap is not None else 1e4
    probe = _PROBE
    pts = np.append(probe[probe < top], top)
    for _ in range(3):
        sf = prv.sf(pts)
        ok = np.nonzero(sf <= tail)[0]
        if ok.size == 0:
            return top, float(prv.sf(top))
        i = int(ok[0])
        hi, lo = float(pts[i]), float(pts[max(i - 1, 0)])
        pts = np.linspace(lo, hi, 65)
    return hi, float(prv.sf(hi))


def discretise(
    prv: RandomizedClippingPRV,
    mesh: float,
    lam: float,
    index: int,
    n_segments: int,
    lower_tail: float = STEP_TAIL,
    limit: bool = True,
) -> tuple[TiltedPmf, StepMgf]:
    """Cell-centred discretisation with mean correction (section 3), tilted by ``lam``.

    Cells ``[t_i - mesh/2, t_i + mesh/2)`` with ``t_i`` on the lattice ``mesh * Z``; the mass
    below the lower end is in the first cell, the cap is in the last one. The grid is then
    shifted by ``s = E[Y'] - sum_i m_i t_i`` (``|s| < mesh / 2``) so that the discrete mean is
    the mean of the clamped step ``Y' = max(Y, a)``; the rounding error then lies in
    ``[s - mesh/2, s + mesh/2]``, an interval of width ``mesh``.

    Raises:
        NumericalLimitError: if the step needs more than :data:`MAX_FFT_POINTS` cells or its
            mean cannot be matched within half a cell.
    """
    a = lower_end(prv, lower_tail)
    b, above = upper_end(prv, lower_tail)
    i0 = int(math.floor(a / mesh + 0.5))
    i1 = int(math.floor(b / mesh + 0.5))
    n = i1 - i0 + 1
    if limit and n > MAX_FFT_POINTS:
        raise NumericalLimitError(
            f"one step's privacy loss spans [{a:.4g}, {b:.4g}], which needs {n} cells at mesh "
            f"{mesh:.3g} (more than {MAX_FFT_POINTS}); increase eps_error (at least "
            f"{n / MAX_FFT_POINTS:.3g} times) or the sketch dimension (a lighter tail)",
            factor=n / MAX_FFT_POINTS,
        )
    mass = np.empty(n)
    if n == 1:
        mass[0] = 1.0
    else:
        edges = (i0 + np.arange(1, n) - 0.5) * mesh
        c, s = prv.cdf_sf(edges)
        mass[0] = c[0]
        mass[-1] = s[-1] - above  # the mass above b goes to +inf, not into the last cell
        mass[1:-1] = np.where(c[:-1] > 0.5, s[:-1] - s[1:], c[1:] - c[:-1])
    mass = np.maximum(mass, 0.0)
    total = float(mass.sum())
    if not total > 0.0:
        raise NumericalLimitError(f"{prv!r} has no finite mass on [{a}, {b}]")
    mass /= total
    centres = (i0 + np.arange(n)) * mesh
    # the mean of Y' = max(Y, a) given Y <= b (the finite part after the moves)
    mean = (prv.partial_expectation(a, b) + a * float(prv.cdf(a))) / (1.0 - above)
    shift = mean - float(np.dot(mass, centres))
    if not abs(shift) < mesh / 2.0:
        raise NumericalLimitError(
            f"the discrete mean of {prv!r} differs from its mean by {shift:.3g}, more than half "
            f"a cell ({mesh / 2:.3g}); increase eps_error"
        )
    p_inf = prv.pm_inf + (1.0 - prv.pm_inf) * above
    positions = centres + shift
    with np.errstate(divide="ignore"):
        log_mass = np.log(mass) + math.log1p(-p_inf)
    step_mgf = StepMgf.from_pmf(log_mass, positions)
    e = log_mass + lam * positions
    log_mgf = float(special.logsumexp(e))
    v = np.exp(e - log_mgf)
    counts = tuple(1.0 if j == index else 0.0 for j in range(n_segments))
    pmf = TiltedPmf(
        v=v,
        offset=float(positions[0]),
        mesh=mesh,
        lam=lam,
        log_mgf=log_mgf,
        p_inf=p_inf,
        nu2=mesh * mesh,
        mgf=MgfBound(counts),
    )
    return pmf, step_mgf


def product(
    factors: Sequence[tuple[TiltedPmf, int]], steps: Sequence[StepMgf], log_tail: float
) -> TiltedPmf:
    """The law of ``sum_j (n_j iid copies of factors[j])`` by one circular FFT (section 6).

    The window is the intersection of the exact support and the Chernoff window of the tilted
    law; every cut tail adds its bound to ``misplaced``.

    Raises:
        NumericalLimitError: if the window needs more than :data:`MAX_FFT_POINTS` points.
    """
    factors = [(f, int(n)) for f, n in factors if n > 0]
    first = factors[0][0]
    mesh, lam = first.mesh, first.lam
    if len(factors) == 1 and factors[0][1] == 1:
        return first
    origin = sum(n * f.offset for f, n in factors)
    top = sum(n * f.top for f, n in factors)
    mgf = factors[0][0].mgf.times(factors[0][1])
    for f, n in factors[1:]:
        mgf = mgf + f.mgf.times(n)
    lo_c, hi_c = chernoff_window(mgf, steps, lam, log_tail)
    misplaced = sum(n * f.misplaced for f, n in factors)
    lo, hi = origin, top
    if lo_c > lo:
        lo = lo_c
        misplaced += math.exp(-log_tail)
    if hi_c < hi:
        hi = hi_c
        misplaced += math.exp(-log_tail)
    k0 = int(math.floor((lo - origin) / mesh + 1e-9))
    width = int(math.ceil((hi - origin) / mesh - 1e-9)) - k0 + 1
    longest = max(f.v.size for f, _ in factors)
    if max(width, longest) > MAX_FFT_POINTS:
        raise NumericalLimitError(
            f"composing {sum(n for _, n in factors)} copies needs a window of "
            f"{max(width, longest)} points at mesh {mesh:.3g} (more than {MAX_FFT_POINTS}); "
            f"increase eps_error (at least {max(width, longest) / MAX_FFT_POINTS:.3g} times)",
            factor=max(width, longest) / MAX_FFT_POINTS,
        )
    size = sp_fft.next_fast_len(max(width, longest, 2), real=True)
    spec = np.ones(size // 2 + 1, dtype=complex)
    for f, n in factors:
        spec *= sp_fft.rfft(f.v, size) ** n
    out = np.roll(sp_fft.irfft(spec, size), -k0)
    total = float(out.sum())
    ops = sum(n * f.ops for f, n in factors) + 1.0  # each factor's error counts n times
    return TiltedPmf(
        v=out / total,
        offset=origin + k0 * mesh,
        mesh=mesh,
        lam=lam,
        log_mgf=sum(n * f.log_mgf for f, n in factors) + math.log(total),
        p_inf=-math.expm1(sum(n * math.log1p(-f.p_inf) for f, n in factors)),
        nu2=sum(n * f.nu2 for f, n in factors),
        mgf=mgf,
        misplaced=misplaced,
        ops=ops,
    )


def coarsen(pmf: TiltedPmf, mesh: float) -> TiltedPmf:
    """Re-discretise on ``mesh * Z`` by unbiased rounding to the two neighbours (section 4).

    A point ``t`` between ``g_k <= t < g_{k+1}`` sends ``(g_{k+1} - t) / mesh`` of its mass to
    ``g_k`` and the rest to ``g_{k+1}``: the error has mean zero given ``t`` and lies in
    ``[g_k - t, g_{k+1} - t]``, width ``mesh``. Tilted weights pick up ``e^{lam (g - t)}``.
    """
    lam = pmf.lam
    t = pmf.offset + pmf.mesh * np.arange(pmf.v.size)
    k0 = int(math.floor(t[0] / mesh))
    pos = t / mesh - k0
    k = np.floor(pos).astype(np.int64)
    frac = pos - k
    w_lo = pmf.v * (1.0 - frac) * np.exp(-lam * frac * mesh)
    w_hi = pmf.v * frac * np.exp(lam * (1.0 - frac) * mesh)
    size = int(k[-1]) + 2
    out = np.bincount(k, w_lo, minlength=size) + np.bincount(k + 1, w_hi, minlength=size)
    total = float(out.sum())
    return TiltedPmf(
        v=out / total,
        offset=k0 * mesh,
        mesh=mesh,
        lam=lam,
        log_mgf=pmf.log_mgf + math.log(total),
        p_inf=pmf.p_inf,
        nu2=pmf.nu2 + mesh * mesh,
        mgf=pmf.mgf.coarsened(mesh),
        misplaced=pmf.misplaced * math.exp(2.0 * lam * mesh),
        ops=pmf.ops,
    )
