"""Privacy accounting for DP-SGD with randomized clipping.

:class:`RCAccountant` is an Opacus ``IAccountant`` (mechanism ``"rc"``) that composes the privacy
loss random variables of docs/privacy/prv.md#prv in both adjacency directions.
:func:`get_noise_multiplier` finds the noise for a target epsilon with it, and :func:`register`
puts it in Opacus' accountant registry (``import opacus_rc`` calls it when torch or Opacus is
already imported). Importing this package imports neither PyTorch nor Opacus; only
:func:`register` does.
"""

from opacus_rc.accountants.analysis.epsilon import EpsilonReport
from opacus_rc.accountants.analysis.errors import (
    AccountingError,
    EpsilonOutOfRangeError,
    NumericalLimitError,
)
from opacus_rc.accountants.noise_search import get_noise_multiplier
from opacus_rc.accountants.rc import RCAccountant, register

__all__ = [
    "AccountingError",
    "EpsilonOutOfRangeError",
    "NumericalLimitError",
    "EpsilonReport",
    "RCAccountant",
    "get_noise_multiplier",
    "register",
]
