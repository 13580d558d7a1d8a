"""The interface of an envelope law and the registry of envelopes by name.

An envelope is an upper bound ``F_env(y) >= sup P(W <= y)`` on the law of the sketch ratio
``W = n_hat / n`` below 1 (``docs/privacy/envelope.md``); its *law* is that of the sensitivity
``S = W_env^{-1/2}`` in units of the clipping bound. Each law is defined for a fixed ``k`` and
handles the interior of its domain only: ``w_cdf`` gets ``y`` in ``(0, 1)``, the ``s`` methods get
``s >= 1`` (``logpdf``: ``s > 1``);
:class:`~opacus_rc.accountants.analysis.envelope.SensitivityEnvelope` does the
edges, the validation and exact clipping. A law is registered by name with
:func:`register_envelope` (docs/architecture.md#architecture-add-envelope); the names are the
values accepted wherever an ``envelope`` argument appears.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from scipy import integrate

from opacus_rc.accountants.analysis.envelopes.quadrature import log_s_quadrature
from opacus_rc.registry import Registry

__all__ = ["ENVELOPE_LAWS", "EnvelopeLaw", "register_envelope"]

#: Envelope name -> law class (constructed as ``law(k)``), in registration order.
ENVELOPE_LAWS: Registry[type] = Registry("envelope")


def register_envelope(name: str) -> Callable[[type], type]:
    """Class decorator: make an :class:`EnvelopeLaw` subclass available as ``envelope=name``.

    Raises:
        TypeError: If ``name`` is not a non-empty string.
        ValueError: If ``name`` is already registered.
    """
    return ENVELOPE_LAWS.register(name)


class EnvelopeLaw:
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
        s, w = log_s_quadrature(self, 1.0, s_max, panels, order)
        for loc, mass in self.atoms():
            at = int(np.searchsorted(s, loc))
            s, w = np.insert(s, at, loc), np.insert(w, at, mass)
        return s, w

    # Every law implements: w_cdf(y), atoms(), logsf(s), cdf(s), logpdf(s), isf(p), breaks().
