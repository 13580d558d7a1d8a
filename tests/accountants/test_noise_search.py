"""The search for the noise multiplier of a target epsilon
(``opacus_rc.accountants.get_noise_multiplier``): its arguments are checked by name with their
range, and a large target is reached (issue 24).
"""

from __future__ import annotations

import math

import pytest

from opacus_rc.accountants import (
    RCAccountant,
    get_noise_multiplier,
)


# ----------------------------------------------------------------------------- item 4
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": math.inf}, r"steps must be a finite integer >= 1, got inf"),
        ({"steps": math.nan}, r"steps must be a finite integer >= 1, got nan"),
        ({"steps": 0}, r"steps must be a finite integer >= 1, got 0"),
        ({"epochs": math.inf}, r"epochs must be a finite number > 0, got inf"),
        ({"epochs": 0.001}, r"gives int\(epochs / sample_rate\) = 0 steps"),
        (
            {"steps": 100, "target_epsilon": math.inf},
            r"target_epsilon must be a finite number > 0, got inf",
        ),
        ({"steps": 100, "epsilon_tolerance": math.nan}, r"epsilon_tolerance must be a finite"),
    ],
)
def test_noise_search_names_the_argument_and_its_range(kwargs: dict, match: str) -> None:
    """Issue 24, item 4: steps = inf, epochs = inf and target_epsilon = inf raised a bare
    ``OverflowError: cannot convert float infinity to integer`` (or, for the target, a
    NumericalLimitError about sigma = 0.0078 whose advice did not apply), steps = nan
    ``cannot convert float NaN to integer``. Each is now a ValueError naming the argument and
    its valid range, raised before any accounting."""
    args = {"target_epsilon": 1.0, "target_delta": 1e-5, "sample_rate": 0.01, **kwargs}
    with pytest.raises(ValueError, match=match):
        get_noise_multiplier(**args)


def test_noise_search_reaches_a_large_target_epsilon() -> None:
    """Issue 24, item 1 through the search: target epsilon 1e3 (q = 0.5, 100 steps) raised
    ``OverflowError: math range error`` inside the accountant. Now it returns a sigma whose
    epsilon, recomputed by the accountant, is within the tolerance below the target; for
    sigma / 1.01 it is above (so the answer is not a needlessly large sigma). The search
    stops at MIN_SIGMA, the smallest positive sigma the accountant computes."""
    from opacus_rc.accountants.noise_search import MIN_SIGMA

    sigma = get_noise_multiplier(target_epsilon=1e3, target_delta=1e-5, sample_rate=0.5, steps=100)
    assert MIN_SIGMA == 0.01 and sigma > MIN_SIGMA

    def eps(s: float) -> float:
        acc = RCAccountant()
        acc.history = [(s, 0.5, 100)]
        return acc.get_epsilon(1e-5)

    assert 1e3 - 0.01 <= eps(sigma) <= 1e3
    assert eps(sigma / 1.01) > 1e3
