"""The epsilon of a history: budgets, both directions, heterogeneous segments
(docs/privacy/prv.md#prv)."""

from __future__ import annotations

import math

import pytest
from scipy import optimize, special

from opacus_rc.accountants.analysis.epsilon import EpsilonReport, Segment, compute_epsilon
from opacus_rc.accountants.analysis.errors import EpsilonOutOfRangeError


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
