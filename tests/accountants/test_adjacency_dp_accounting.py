"""docs/privacy/adjacency.md: dp_accounting accounts replace-one under Poisson subsampling for
the Gaussian mechanism (issue 33 item 4 corrected the page, which said it did not)."""

from __future__ import annotations

import pytest

from opacus_rc.accountants import RCAccountant

pld = pytest.importorskip("dp_accounting.pld.privacy_loss_distribution")
dp_accounting = pytest.importorskip("dp_accounting")


def _epsilon(relation: object) -> float:
    dist = pld.from_gaussian_mechanism(
        standard_deviation=1.0,
        sampling_prob=0.01,
        neighboring_relation=relation,
        value_discretization_interval=1e-3,
    )
    return dist.self_compose(1000).get_epsilon_for_delta(1e-5)


def test_dp_accounting_replace_one_is_the_exact_pair() -> None:
    """q = 0.01, sigma = 1, T = 1000, delta = 1e-5, exact clipping: the page's exact
    replace-one epsilon 2.84 (an independent lattice composition,
    test_rc.py) is dp_accounting's REPLACE_ONE figure; add/remove is 1.83-1.84, and
    RCAccountant's replace-one conversion (valid, not tight: 3.55) is above the exact one."""
    relation = dp_accounting.NeighboringRelation
    replace_one = _epsilon(relation.REPLACE_ONE)
    assert replace_one == pytest.approx(2.84, abs=0.01)
    assert _epsilon(relation.ADD_OR_REMOVE_ONE) == pytest.approx(1.84, abs=0.015)
    acc = RCAccountant()
    acc.history = [(1.0, 0.01, 1000)]
    conversion = acc.get_epsilon_replace_one(1e-5)
    assert conversion == pytest.approx(3.55, abs=0.02) and conversion > replace_one
