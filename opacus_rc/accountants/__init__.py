"""Privacy accounting for DP-SGD with randomized clipping.

:class:`RCAccountant` is an Opacus ``IAccountant`` (mechanism ``"rc"``) that composes the privacy
loss random variables of THEORY.md section C in both adjacency directions.
:func:`get_noise_multiplier` finds the noise for a target epsilon with it, and :func:`register`
puts it in Opacus' accountant registry (``opacus_rc`` calls it on import).
"""

from opacus_rc.accountants.analysis.compose import EpsilonReport
from opacus_rc.accountants.analysis.errors import EpsilonOutOfRangeError
from opacus_rc.accountants.rc import RCAccountant, get_noise_multiplier, register

__all__ = [
    "EpsilonOutOfRangeError",
    "EpsilonReport",
    "RCAccountant",
    "get_noise_multiplier",
    "register",
]
