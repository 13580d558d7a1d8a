"""Discretisation and composition with an explicit error bound (compose.py;
docs/privacy/prv.md#prv-composition, docs/privacy/error_budget.md#error-budget)."""

from __future__ import annotations

import numpy as np
from prv_accountant import PRVAccountant

from opacus_rc.accountants.analysis.compose import compose_epsilon
from opacus_rc.accountants.analysis.prv import RandomizedClippingPRV, choose_t_cap


def prv(**kw) -> RandomizedClippingPRV:
    kw.setdefault("noise_multiplier", 1.0)
    kw.setdefault("sample_rate", 0.01)
    return RandomizedClippingPRV(**kw)


def test_pipeline_equals_prv_accountants_own() -> None:
    """compose_epsilon re-implements PRVAccountant's discretisation (one CDF evaluation per
    edge, spline mean, FFT-friendly domain): same (lower, estimate, upper) as prv_accountant's
    PRVAccountant run on the same capped PRV."""
    p = prv(sketch_dim=32)
    c = p.with_cap(choose_t_cap(p, steps=100, delta=1e-5))
    ref = PRVAccountant(prvs=[c], max_self_compositions=[100], eps_error=0.01, delta_error=1e-8)
    expected = ref.compute_epsilon(1e-5, [100])
    np.testing.assert_allclose(compose_epsilon([c], [100], delta=1e-5), expected, atol=1e-6)
