"""Privacy-loss models of one step: the hidden and revealed threat models
(docs/privacy/threat_models.md#threat-models, docs/privacy/prv.md#prv-hidden,
docs/privacy/prv.md#prv-revealed)."""

from __future__ import annotations

import math

import numpy as np

from opacus_rc.accountants.analysis.envelope import SensitivityEnvelope
from opacus_rc.accountants.analysis.prv import RandomizedClippingPRV
from opacus_rc.accountants.analysis.threat_models import (
    THREAT_MODEL_CLASSES,
    THREAT_MODELS,
    u_of_z,
    z_of_u,
)


def prv(**kw) -> RandomizedClippingPRV:
    kw.setdefault("noise_multiplier", 1.0)
    kw.setdefault("sample_rate", 0.01)
    return RandomizedClippingPRV(**kw)


def test_hidden_root_inversion_residual_g4() -> None:
    """|log L(x*(t)) - t| < 5e-14 for the exact root used outside the tables
    (docs/privacy/reference_numbers.md#reference-tail)."""
    q = 0.01
    model = prv(sketch_dim=32)._table.model
    for t in (0.0, 0.5, 1.0, 5.0):
        z = math.log((math.exp(t) - (1 - q)) / q)
        x = model.x_of_z(np.array([z]))
        logm = model.logm(x)[0][0]
        assert abs(math.log(1 - q + q * math.exp(logm)) - t) < 5e-14


def test_registry_holds_both_threat_models_behind_one_interface() -> None:
    """Both models are registered under their names, in the order THREAT_MODELS lists, and
    each answers the common interface: increasing knots whose values agree with values_z."""
    assert THREAT_MODELS == ("hidden", "revealed")
    quad = SensitivityEnvelope(sketch_dim=16).quadrature()
    for name in THREAT_MODELS:
        model = THREAT_MODEL_CLASSES[name](0.01, 1.0, quad)
        knots = model.knots(model.default_step)
        assert np.all(np.diff(knots.z) > 0.0) and len(model.saturated) == 2
        pick = knots.z[:: max(1, knots.z.size // 50)]
        again = model.values_z(pick)
        idx = np.searchsorted(knots.z, pick)
        np.testing.assert_allclose(again.B, knots.B[idx], rtol=0, atol=1e-13)
        np.testing.assert_allclose(again.Abar, knots.Abar[idx], rtol=0, atol=1e-13)


def test_u_and_z_are_inverse_coordinates() -> None:
    """u = log(1 - q + q e^z) and its inverse, both branches (u <= 0, u > 0) and q = 1."""
    z = np.linspace(-30.0, 30.0, 601)
    for q in (0.001, 0.01, 0.5, 1.0):
        u = u_of_z(q, z)
        back = z_of_u(q, u)
        keep = u - (math.log1p(-q) if q < 1 else -np.inf) > 1e-9
        np.testing.assert_allclose(back[keep], z[keep], rtol=0, atol=1e-6)
        np.testing.assert_allclose(z_of_u(q, u[::-1])[::-1][keep], z[keep], rtol=0, atol=1e-6)
