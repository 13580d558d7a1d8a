"""Spline tables of one step's privacy-loss laws against exact evaluation
(docs/privacy/prv.md#prv-tables)."""

from __future__ import annotations

import numpy as np
import pytest

from opacus_rc.accountants.analysis.prv import RandomizedClippingPRV


def prv(**kw) -> RandomizedClippingPRV:
    kw.setdefault("noise_multiplier", 1.0)
    kw.setdefault("sample_rate", 0.01)
    return RandomizedClippingPRV(**kw)


@pytest.mark.parametrize(
    ("sigma", "k", "mode"),
    [
        (1.0, None, "hidden"),
        (1.0, 32, "hidden"),
        (0.5, 8, "hidden"),
        (4.0, 64, "hidden"),
        (1.0, 32, "revealed"),
        (0.5, 8, "revealed"),
        (4.0, 64, "revealed"),
    ],
)
def test_tables_match_exact_evaluation(sigma: float, k: int | None, mode: str) -> None:
    """The quintic Hermite tables of A, B (cdf and survival) are within 1e-13 of exact
    evaluation (hidden: Newton root of log m(x) = z, then closed forms) at random points."""
    table = prv(noise_multiplier=sigma, sketch_dim=k, threat_model=mode)._table
    z = np.random.default_rng(0).uniform(table.z[0], table.z[-1], 500)
    exact = table.exact(z)
    for name in ("A", "B"):
        cdf, sf = table.law(name, z)
        np.testing.assert_allclose(cdf, getattr(exact, name), rtol=0, atol=1e-13)
        np.testing.assert_allclose(sf, getattr(exact, name + "bar"), rtol=0, atol=1e-13)
