"""The quadrature of an envelope law: Gauss-Legendre rules in ``log s`` and the node table.

``docs/privacy/prv.md#prv-quadrature``: the law of the sensitivity ``S`` (units of the clipping
bound ``C``) on ``[1, s_max]`` is represented by nodes and weights, atoms as nodes of their own,
the mass above ``s_max`` (``eta``) left out and accounted as fully revealing. Pure numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["DEFAULT_ETA", "EnvelopeQuadrature", "gauss_legendre", "log_s_quadrature"]

#: Default capped tail mass of the quadrature (``docs/privacy/prv.md#prv-quadrature``).
DEFAULT_ETA = 1e-15


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


def gauss_legendre(lo: float, hi: float, panels: int, order: int) -> tuple[np.ndarray, ...]:
    """Composite Gauss-Legendre nodes and weights on ``[lo, hi]`` (``panels`` equal panels)."""
    gl_x, gl_w = np.polynomial.legendre.leggauss(order)
    edges = np.linspace(lo, hi, panels + 1)
    half = np.diff(edges)[:, None] / 2.0
    mid = (edges[:-1] + edges[1:])[:, None] / 2.0
    return (mid + half * gl_x[None, :]).ravel(), (half * gl_w[None, :]).ravel()


def log_s_quadrature(law, s_lo: float, s_hi: float, panels: int, order: int):
    """Nodes and weights of the continuous part of ``S`` on ``[s_lo, s_hi]``, Gauss-Legendre
    in ``u = log s`` with weight ``rho(s) s du`` (``docs/privacy/prv.md#prv-quadrature``)."""
    u, du = gauss_legendre(math.log(s_lo), math.log(s_hi), panels, order)
    s = np.exp(u)
    return s, np.exp(law.logpdf(s) + u) * du
