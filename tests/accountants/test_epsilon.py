"""The epsilon of a history: budgets, both directions, heterogeneous segments
(docs/privacy/prv.md#prv)."""

from __future__ import annotations

import math

import pytest
from scipy import optimize, special

from opacus_rc.accountants import RCAccountant
from opacus_rc.accountants.analysis.epsilon import EpsilonReport, Segment, compute_epsilon
from opacus_rc.accountants.analysis.errors import EpsilonOutOfRangeError
from tests.accountants import lattice_oracle


def test_gaussian_mechanism_closed_form_both_directions() -> None:
    """q = 1, k = None is the Gaussian mechanism with mu = sqrt(T) / sigma, whose exact
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) (Balle and Wang 2018) holds in
    both directions: the guaranteed bracket (lower, upper) of each direction contains it."""
    sigma, steps, delta = 2.0, 10, 1e-5
    mu = math.sqrt(steps) / sigma

    def exact_delta(eps: float) -> float:
        return special.ndtr(-eps / mu + mu / 2) - math.exp(eps) * special.ndtr(-eps / mu - mu / 2)

    eps_exact = optimize.brentq(lambda e: exact_delta(e) - delta, 0.0, 50.0, xtol=1e-12)
    rep = compute_epsilon([Segment(sigma, 1.0, steps)], delta=delta)
    for lower, est, upper in (rep.remove, rep.add):
        assert lower <= eps_exact <= upper
        assert abs(est - eps_exact) < 2e-3


def test_revealed_mode_is_symmetric_at_q1() -> None:
    """With q = 1 and S revealed, each conditional pair is a Gaussian mechanism, whose remove and
    add PRVs have the same law: both directions give the same epsilon (from different tables)."""
    rep = compute_epsilon([Segment(1.0, 1.0, 5, 32, "revealed")], delta=1e-5)
    assert rep.remove[1] == pytest.approx(rep.add[1], abs=2e-3)


def test_heterogeneous_composition() -> None:
    """Segments compose regardless of order; identical segments merge; a mixed history lies
    between its pure extremes."""
    a = Segment(1.0, 0.01, 500, None)
    b = Segment(1.0, 0.01, 500, 32)
    ab = compute_epsilon([a, b], delta=1e-5)
    ba = compute_epsilon([b, a], delta=1e-5)
    assert ab.remove == pytest.approx(ba.remove, abs=1e-9)
    exact = compute_epsilon([Segment(1.0, 0.01, 1000, None)], delta=1e-5)
    rc = compute_epsilon([Segment(1.0, 0.01, 500, 32), Segment(1.0, 0.01, 500, 32)], delta=1e-5)
    assert rc.remove == compute_epsilon([Segment(1.0, 0.01, 1000, 32)], delta=1e-5).remove
    assert exact.estimate + 0.05 < ab.estimate < rc.estimate - 0.05
    assert compute_epsilon([], delta=1e-5).upper == 0.0


def test_report_takes_the_max_over_directions() -> None:
    rep = EpsilonReport(remove=(0.9, 1.0, 1.1), add=(1.9, 2.0, 2.1), delta=1e-5)
    assert rep.upper == 2.1 and rep.estimate == 2.0 and rep.dominant_direction == "add"


def test_too_heavy_tails_raise_instead_of_a_small_number() -> None:
    """k = 1 at sigma = 0.5 puts far more than delta above every cap: an error, not a number."""
    with pytest.raises(EpsilonOutOfRangeError, match="mass at infinity"):
        compute_epsilon([Segment(0.5, 0.01, 1000, 1)], delta=1e-5)


def test_delta_below_the_former_revealing_mass_is_reached() -> None:
    """eta = 1e-15 per step used to make delta = 1e-13 unreachable in 1000 steps (refused as
    "epsilon is infinite"). The revealing tail is now budgeted from delta (T eta <= 1e-4
    delta, tests/accountants/test_edges.py), so it is a finite bound above delta = 1e-12's."""
    rep = compute_epsilon([Segment(1.0, 0.01, 1000, 32)], delta=1e-13)
    assert math.isfinite(rep.upper)
    assert rep.upper > compute_epsilon([Segment(1.0, 0.01, 1000, 32)], delta=1e-12).upper


def test_bad_segments_and_deltas() -> None:
    with pytest.raises(ValueError, match="steps must be an integer >= 0"):
        Segment(1.0, 0.01, -1)
    for delta in (0.0, 1.0, 2.0, -1e-5):
        with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
            compute_epsilon([Segment(1.0, 0.01, 10)], delta=delta)


# ----------------------------------------------------------------------------- item 1
def test_a_large_epsilon_is_computed_not_an_overflow() -> None:
    """Issue 24, item 1: sigma = 0.1, q = 0.5, 100 steps, delta = 1e-5 raised a bare
    ``OverflowError: math range error`` (``math.exp(eps - reference)`` in the solver, epsilon
    being more than 700 nats above the tilted mean). The solver now never forms a factor
    above 1. The remove direction dominates; the lattice oracle at mesh 0.004 brackets the
    truth in [3541.31, 3541.71] (its width, 100 steps x 0.004, is the oracle's own error):
    the bracket (lower, upper) of the accountant must meet it, upper must be above the oracle's
    lower bound and at most its upper one plus the accountant's eps_error 0.01 either side.
    The add direction's loss is at most log(1 / (1 - q)) per step, so its epsilon is at most
    100 log 2 = 69.31."""
    acc = RCAccountant()
    acc.history = [(0.1, 0.5, 100)]
    rep = acc.get_epsilon_report(1e-5)
    kw = {"lo": math.log1p(-0.5), "hi": 250.0, "mesh": 0.004, "steps": 100, "delta": 1e-5}
    below = lattice_oracle.lattice_epsilon(lattice_oracle.remove_cdf(0.5, 0.1), side="down", **kw)
    above = lattice_oracle.lattice_epsilon(lattice_oracle.remove_cdf(0.5, 0.1), side="up", **kw)
    assert 3541.2 < below < above < below + 0.41
    lower, estimate, upper = rep.remove
    assert below <= upper <= above + 0.02 and lower <= above
    assert lower <= estimate <= upper and upper - lower < 0.2
    assert rep.upper == upper and rep.add[2] <= 100 * math.log(2.0) + 0.011


def test_all_mass_at_infinity_is_out_of_range_not_a_math_error() -> None:
    """sigma = 0.02, q = 1, one step: every step's loss lies above the largest cap (200), so
    its mass at infinity is 1; ``math.log1p(-1)`` raised ``ValueError: math domain error``.
    Now the privacy answer, which says which epsilon (direction, delta) is not certified."""
    with pytest.raises(EpsilonOutOfRangeError, match=r"remove direction .*delta=1e-05"):
        compute_epsilon([Segment(0.02, 1.0, 1)], delta=1e-5)


def test_out_of_range_error_says_which_epsilon() -> None:
    """Issue 24, item 4: EpsilonOutOfRangeError said "epsilon exceeds every value this
    accountant certifies at this delta" without saying which. Now it names the direction,
    the number of steps, the delta and the cap of the per-step loss (k = 1, sigma = 0.5,
    q = 0.01, 1000 steps: the revealing tail of the envelope exceeds delta)."""
    with pytest.raises(EpsilonOutOfRangeError) as info:
        compute_epsilon([Segment(0.5, 0.01, 1000, 1)], delta=1e-5)
    msg = str(info.value)
    assert msg.startswith("remove direction (docs/privacy/adjacency.md), 1000 steps: epsilon")
    assert "at delta=1e-05 is not finite for this analysis" in msg
    assert "per step at most 200 nats" in msg and "Increase noise_multiplier" in msg
