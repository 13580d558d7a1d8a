"""Pure math of the randomized-clipping accountant (no Opacus import).

* :mod:`.envelope`: law of the worst-case sensitivity ``S``
  (docs/privacy/envelope.md#envelope-definition).
* :mod:`.threat_models`: the ``hidden`` and ``revealed`` privacy-loss models of one step, one
  interface (docs/privacy/threat_models.md#threat-models, docs/privacy/prv.md#prv-hidden,
  docs/privacy/prv.md#prv-revealed).
* :mod:`.loss_table`: splines of one step's privacy-loss laws (docs/privacy/prv.md#prv-tables).
* :mod:`.prv`: the per-step privacy loss random variable for ``prv_accountant``, capped
  (docs/privacy/prv.md#prv-numerics: the quadrature, the tail cap, the domain).
* :mod:`.compose`: discretisation and composition with an explicit error bound, long horizons
  (docs/privacy/prv.md#prv-composition; docs/privacy/error_budget.md).
* :mod:`.blocks`: the plan of levels and meshes of a long horizon, and the composition level
  by level (run by :mod:`.compose`).
* :mod:`.tilting`: the exponential tilt of a composition and the roots of ``delta(eps)`` on the
  tilted result (run by :mod:`.compose`).
* :mod:`.discrete`: tilted discrete laws on a grid: discretisation, FFT products,
  re-discretisation, Chernoff windows (the pieces of :mod:`.compose`).
* :mod:`.epsilon`: the epsilon of a history: budgets, both directions, the replace-one
  conversion.
* :mod:`.errors`: what the accountant raises when it cannot answer.
"""

from opacus_rc.accountants.analysis.compose import Composition, compose_epsilon, compose_prvs
from opacus_rc.accountants.analysis.envelope import (
    ENVELOPES,
    EnvelopeQuadrature,
    SensitivityEnvelope,
    envelope_cdf,
)
from opacus_rc.accountants.analysis.epsilon import (
    EpsilonReport,
    Segment,
    choose_eta,
    compute_epsilon,
)
from opacus_rc.accountants.analysis.errors import (
    AccountingError,
    EpsilonOutOfRangeError,
    NumericalLimitError,
)
from opacus_rc.accountants.analysis.prv import (
    DIRECTIONS,
    RandomizedClippingPRV,
    choose_t_cap,
)
from opacus_rc.accountants.analysis.threat_models import THREAT_MODELS

__all__ = [
    "AccountingError",
    "Composition",
    "DIRECTIONS",
    "ENVELOPES",
    "THREAT_MODELS",
    "EnvelopeQuadrature",
    "EpsilonOutOfRangeError",
    "EpsilonReport",
    "NumericalLimitError",
    "RandomizedClippingPRV",
    "Segment",
    "SensitivityEnvelope",
    "choose_eta",
    "choose_t_cap",
    "compose_prvs",
    "compose_epsilon",
    "compute_epsilon",
    "envelope_cdf",
]
