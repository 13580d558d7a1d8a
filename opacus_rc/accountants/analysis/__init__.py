"""Pure math of the randomized-clipping accountant (no Opacus import).

* :mod:`.envelope`: law of the worst-case sensitivity ``S`` (THEORY.md B.3).
* :mod:`.threat_models`: the ``hidden`` and ``revealed`` privacy-loss models of one step, one
  interface (THEORY.md B.2, C.1-C.2).
* :mod:`.loss_table`: splines of one step's privacy-loss laws (THEORY.md C.3 item 3).
* :mod:`.prv`: the per-step privacy loss random variable for ``prv_accountant``, capped
  (THEORY.md C.3 items 1, 4, 5).
* :mod:`.compose`: discretisation and composition (THEORY.md C.3 item 6).
* :mod:`.errors`: what the accountant raises when it cannot answer.
"""

from opacus_rc.accountants.analysis.compose import (
    EpsilonReport,
    Segment,
    compose_epsilon,
    compute_epsilon,
)
from opacus_rc.accountants.analysis.envelope import (
    ENVELOPES,
    EnvelopeQuadrature,
    SensitivityEnvelope,
    envelope_cdf,
)
from opacus_rc.accountants.analysis.errors import EpsilonOutOfRangeError
from opacus_rc.accountants.analysis.prv import (
    DIRECTIONS,
    RandomizedClippingPRV,
    choose_t_cap,
)
from opacus_rc.accountants.analysis.threat_models import THREAT_MODELS

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
