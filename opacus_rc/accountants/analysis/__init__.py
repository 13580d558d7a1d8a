"""Pure math of the randomized-clipping accountant (no Opacus import).

* :mod:`.envelope`: law of the worst-case sensitivity ``S`` (THEORY.md B.3).
* :mod:`.prv`: privacy loss random variables for ``prv_accountant`` and their composition
  (THEORY.md C).
"""

from opacus_rc.accountants.analysis.envelope import (
    ENVELOPES,
    EnvelopeQuadrature,
    SensitivityEnvelope,
    envelope_cdf,
)
from opacus_rc.accountants.analysis.prv import (
    DIRECTIONS,
    THREAT_MODELS,
    EpsilonOutOfRangeError,
    EpsilonReport,
    RandomizedClippingPRV,
    Segment,
    choose_t_cap,
    compose_epsilon,
    compute_epsilon,
)

__all__ = [
    "DIRECTIONS",
    "ENVELOPES",
    "THREAT_MODELS",
    "EnvelopeQuadrature",
    "EpsilonOutOfRangeError",
    "EpsilonReport",
    "RandomizedClippingPRV",
    "Segment",
    "SensitivityEnvelope",
    "choose_t_cap",
    "compose_epsilon",
    "compute_epsilon",
    "envelope_cdf",
]
