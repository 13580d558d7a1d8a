"""References for the accountant's edge cases, independent of its composition: the exact
composition of the Poisson-subsampled Gaussian by one float64 FFT on a fine lattice with every
cell's mass at its upper (lower) end, which bounds the true epsilon from above (below), under
add/remove and replace-one adjacency.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import fft, special


# ----------------------------------------------------------------------------- the oracle
def lattice_epsilon(
    log_cdf_pair, *, lo: float, hi: float, mesh: float, steps: int, delta: float, side: str
) -> float:
    """Epsilon at ``delta`` of ``steps`` i.i.d. copies of a privacy loss ``Y`` with CDF ``F``.

    ``F`` is given by ``log_cdf_pair(y) -> F(y)`` on ``[lo, hi]`` (no mass outside). Each cell
    ``(e_i, e_{i+1}]`` of the lattice ``lo + mesh Z`` puts its mass at ``e_{i+1}``
    (``side="up"``: a stochastically larger loss, so ``delta(eps)`` and the epsilon found are
    upper bounds) or at ``e_i`` (``"down"``: lower bounds). The sum's law is one FFT power;
    its round-off (about 1e-16 of the peak) is far below ``delta``; ``delta(eps) =
    E(1 - e^{eps - L})_+`` is solved by bisection to 1e-9.
    """
    edges = lo + mesh * np.arange(int(math.ceil((hi - lo) / mesh)) + 2)
    cdf = log_cdf_pair(edges)
    mass = np.diff(cdf)
    mass[0] += cdf[0]
    first = lo + mesh if side == "up" else lo
    size = fft.next_fast_len(steps * mass.size)
    law = np.maximum(fft.irfft(fft.rfft(mass, size) ** steps, size), 0.0)
    t = steps * first + mesh * np.arange(size)

    def delta_of(eps: float) -> float:
        keep = t >= eps
        return float(np.sum(law[keep] * -np.expm1(eps - t[keep])))

    a, b = 0.0, float(t[-1])
    while b - a > 1e-9 * max(1.0, b):
        mid = 0.5 * (a + b)
        a, b = (mid, b) if delta_of(mid) > delta else (a, mid)
    return b


def remove_cdf(q: float, sigma: float):
    """CDF of the remove-direction loss of the Poisson-subsampled Gaussian (exact clipping):
    ``Y = log(1 - q + q e^{(2X - 1) / (2 sigma^2)})``, ``X ~ (1 - q) N(0, s^2) + q N(1, s^2)``,
    increasing in ``X``, so ``P(Y <= y) = P(X <= x(y))`` with ``x(y)`` in closed form."""

    def cdf(y: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            inner = y + np.log1p(-(1.0 - q) * np.exp(-y)) - math.log(q)
        x = np.where(y > math.log1p(-q), sigma**2 * inner + 0.5, -np.inf)
        return (1.0 - q) * special.ndtr(x / sigma) + q * special.ndtr((x - 1.0) / sigma)

    return cdf


# ----------------------------------------------------------------------------- item 5
def replace_one_cdf(q: float, sigma: float):
    """CDF of the replace-one loss of exact clipping with Poisson sampling: the pair
    ``P = (1 - q) N(0, s^2) + q N(1, s^2)`` against ``Q = (1 - q) N(0, s^2) + q N(-1, s^2)``
    (the replaced record's clipped gradient g against g' = -g, both of norm 1, the worst
    case), ``Y = log(dP/dQ)(X)``, ``X ~ P``, increasing in ``X``: ``x(y)`` by bisection to
    2^-60 of [-60, 60]; the pair is symmetric, so one direction suffices."""

    def loss(x: np.ndarray) -> np.ndarray:
        base = math.log1p(-q)
        up = np.logaddexp(base, math.log(q) + (2.0 * x - 1.0) / (2.0 * sigma**2))
        down = np.logaddexp(base, math.log(q) + (-2.0 * x - 1.0) / (2.0 * sigma**2))
        return up - down

    def cdf(y: np.ndarray) -> np.ndarray:
        lo, hi = np.full_like(y, -60.0), np.full_like(y, 60.0)
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            above = loss(mid) > y
            lo, hi = np.where(above, lo, mid), np.where(above, mid, hi)
        x = 0.5 * (lo + hi)
        return (1.0 - q) * special.ndtr(x / sigma) + q * special.ndtr((x - 1.0) / sigma)

    return cdf


def circular_lattice_epsilon(cdf, *, lo: float, hi: float, side: str) -> float:
    """:func:`lattice_epsilon` for 1000 steps at mesh 6e-5 on a circular window of 2^20
    points (63 nats, centred on 0): the 1000-step loss has mean ~0.05 and standard deviation
    ~0.45, and a single step's loss exceeds 5 nats with probability below 1e-19, so the mass
    that wraps around is negligible against delta = 1e-5. The bracket is 1000 x 6e-5 = 0.06
    wide."""
    mesh, steps, size = 6e-5, 1000, 2**20
    edges = lo + mesh * np.arange(int(math.ceil((hi - lo) / mesh)) + 2)
    c = cdf(edges)
    mass = np.diff(c)
    mass[0] += c[0]
    first = lo + mesh if side == "up" else lo
    law = np.maximum(fft.irfft(fft.rfft(mass, size) ** steps, size), 0.0)
    width = size * mesh
    t = (steps * first + mesh * np.arange(size) + width / 2) % width - width / 2

    def delta_of(eps: float) -> float:
        keep = t >= eps
        return float(np.sum(law[keep] * -np.expm1(eps - t[keep])))

    a, b = 0.0, width / 2
    while b - a > 1e-9:
        mid = 0.5 * (a + b)
        a, b = (mid, b) if delta_of(mid) > 1e-5 else (a, mid)
    return b
