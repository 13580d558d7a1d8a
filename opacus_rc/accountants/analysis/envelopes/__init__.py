"""The envelope laws, one module per family, and their registry and quadrature.

* :mod:`.law`: the interface :class:`~.law.EnvelopeLaw` and the registry
  :data:`~.law.ENVELOPE_LAWS` (:func:`~.law.register_envelope`).
* :mod:`.quadrature`: Gauss-Legendre rules in ``log s`` and
  :class:`~.quadrature.EnvelopeQuadrature` (docs/privacy/prv.md#prv-quadrature).
* :mod:`.chi2`, :mod:`.schur`, :mod:`.chernoff`: the three envelopes
  (docs/privacy/envelope.md), registered in this order (``"chi2"`` is the default).

The public entry point is :class:`opacus_rc.accountants.analysis.envelope.SensitivityEnvelope`.
"""

# The order of these imports is the registration order, hence the order of ``ENVELOPES`` in
# every message and CLI choice list: the default first, then the proved fallback, then the check.
# isort: off
from opacus_rc.accountants.analysis.envelopes import chi2 as _chi2  # noqa: F401
from opacus_rc.accountants.analysis.envelopes import schur as _schur  # noqa: F401
from opacus_rc.accountants.analysis.envelopes import chernoff as _chernoff  # noqa: F401

# isort: on
from opacus_rc.accountants.analysis.envelopes.law import (
    ENVELOPE_LAWS,
    EnvelopeLaw,
    register_envelope,
)
from opacus_rc.accountants.analysis.envelopes.quadrature import DEFAULT_ETA, EnvelopeQuadrature

__all__ = [
    "DEFAULT_ETA",
    "ENVELOPE_LAWS",
    "EnvelopeLaw",
    "EnvelopeQuadrature",
    "register_envelope",
]
