"""The envelope law of the worst-case sensitivity S (THEORY.md B.3, C.3 item 1)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, stats

from opacus_rc.accountants.analysis.envelope import SensitivityEnvelope, envelope_cdf


def _reference():  # tests/reference/theory_tables.py, loaded by path (pytest uses importlib mode)
    path = Path(__file__).resolve().parents[1] / "reference" / "theory_tables.py"
    spec = importlib.util.spec_from_file_location("_opacus_rc_theory_tables", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REF = _reference()
ENVELOPE_CDF, S_ENV, S_ENV_LEVELS, S_MAX = REF.ENVELOPE_CDF, REF.S_ENV, REF.S_ENV_LEVELS, REF.S_MAX


def _half_ulp(printed: str) -> float:
    """Half a unit in the last printed digit of ``printed`` (e.g. "1.4287654e-1" -> 5e-9)."""
    mant, _, exp = printed.lower().partition("e")
    decimals = len(mant.split(".")[1]) if "." in mant else 0
    return 0.5 * 10.0 ** (-decimals + (int(exp) if exp else 0))


@pytest.mark.parametrize("k", sorted(ENVELOPE_CDF))
def test_envelope_cdf_table_b3(k: int) -> None:
    """F_env(y): chi2 and Chernoff columns of the B.3 table, to half a unit of the last digit."""
    for y, (chi2_ref, chern_ref) in ENVELOPE_CDF[k].items():
        chi2 = float(envelope_cdf(y, sketch_dim=k, envelope="chi2"))
        chern = float(envelope_cdf(y, sketch_dim=k, envelope="chernoff"))
        assert abs(chi2 - float(chi2_ref)) <= _half_ulp(chi2_ref) + 1e-15, (k, y, chi2)
        assert abs(chern - float(chern_ref)) <= _half_ulp(chern_ref) + 1e-15, (k, y, chern)


def test_envelope_cdf_edges_and_validation() -> None:
    y = np.array([-1.0, 0.0, 1.0, 1.5])
    np.testing.assert_array_equal(envelope_cdf(y, sketch_dim=8), [0.0, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="envelope must be one of"):
        envelope_cdf(0.5, sketch_dim=8, envelope="gauss")
    with pytest.raises(ValueError, match="sketch_dim must be >= 1"):
        envelope_cdf(0.5, sketch_dim=0)


@pytest.mark.parametrize("k", sorted(S_ENV))
def test_s_env_atom_mean_and_quantiles_table_b3(k: int) -> None:
    env = SensitivityEnvelope(sketch_dim=k)
    for level, printed in zip(S_ENV_LEVELS, S_ENV[k]):
        if level == "atom":
            got = env.atom()
        elif level == "mean":
            got = env.mean()
        else:
            got = float(env.ppf(level))
        assert abs(got - float(printed)) <= _half_ulp(printed) + 1e-12, (k, level, got)


@pytest.mark.parametrize("k", sorted(S_MAX))
def test_s_max_table_c3(k: int) -> None:
    printed = S_MAX[k]
    assert abs(SensitivityEnvelope(sketch_dim=k).s_max(1e-15) - float(printed)) <= _half_ulp(
        printed
    )


@pytest.mark.parametrize("envelope", ["chi2", "chernoff"])
@pytest.mark.parametrize("k", [1, 2, 8, 32, 4096])
def test_law_is_consistent(k: int, envelope: str) -> None:
    """cdf + sf = 1, isf inverts sf, the density integrates to 1 - atom, chi2 law matches scipy."""
    env = SensitivityEnvelope(sketch_dim=k, envelope=envelope)
    s = np.array([0.5, 1.0, 1.001, 1.1, 1.5, 3.0, 10.0])
    np.testing.assert_allclose(env.cdf(s) + env.sf(s), 1.0, rtol=0, atol=1e-14)
    p = np.array([1e-12, 1e-6, 0.01, 0.3])
    p = p[p < 1.0 - env.atom()]
    np.testing.assert_allclose(env.sf(env.isf(p)), p, rtol=1e-9)
    cont, _ = integrate.quad(lambda u: float(env.pdf(u)), 1.0, np.inf, limit=400, epsabs=1e-13)
    assert abs(cont + env.atom() - 1.0) < 1e-8
    if envelope == "chi2":
        # S = max(1, (chi2_k / k)^(-1/2)):  P(S > s) = P(chi2_k < k / s^2)
        np.testing.assert_allclose(env.sf(s[s > 1]), stats.chi2.cdf(k / s[s > 1] ** 2, k))
    else:
        assert env.atom() == 0.0


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 512), s=st.floats(1.0, 1e3))
def test_chernoff_envelope_dominates_chi2(k: int, s: float) -> None:
    """The Chernoff law is stochastically larger (B.3 item 5 bounds item 2), hence more
    conservative in every direction (B.4)."""
    chi2 = SensitivityEnvelope(sketch_dim=k, envelope="chi2")
    chern = SensitivityEnvelope(sketch_dim=k, envelope="chernoff")
    assert float(chern.sf(s)) >= float(chi2.sf(s)) * (1 - 1e-12)


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 256), s=st.floats(1.0, 50.0))
def test_more_columns_give_a_stochastically_smaller_s(k: int, s: float) -> None:
    """P(S > s) is nonincreasing in k (for the chi2 envelope): why epsilon decreases in k."""
    a = SensitivityEnvelope(sketch_dim=k)
    b = SensitivityEnvelope(sketch_dim=2 * k)
    assert float(b.sf(s)) <= float(a.sf(s)) * (1 + 1e-12) + 1e-300


@pytest.mark.parametrize("envelope", ["chi2", "chernoff"])
@pytest.mark.parametrize("k", [8, 32, 64])
def test_quadrature_c3(k: int, envelope: str) -> None:
    """Weights sum to 1 - eta to 1e-9 (C.3 item 1); they reproduce E S (up to the capped part,
    at most eta * E[S | S > s_max] ~ 1e-13) and an exponential moment of the kind used by the
    hidden PRV, against adaptive quadrature of the density."""
    env = SensitivityEnvelope(sketch_dim=k, envelope=envelope)
    quad = env.quadrature()
    assert quad.tail_mass == 1e-15
    assert abs(quad.weights.sum() - (1 - 1e-15)) < 1e-9
    assert quad.nodes.min() >= 1.0 and quad.nodes.max() <= quad.s_max
    assert abs(float(np.dot(quad.weights, quad.nodes)) - env.mean()) < 1e-12
    x = 2.0  # E exp(S x - S^2 / 2) on [1, s_max], sigma = 1

    def f(s: float) -> float:
        return math.exp(s * x - s * s / 2.0)

    ref, _ = integrate.quad(
        lambda s: f(s) * float(env.pdf(s)), 1.0, quad.s_max, epsabs=0, epsrel=1e-13, limit=500
    )
    ref += env.atom() * f(1.0)
    got = float(np.dot(quad.weights, np.exp(quad.nodes * x - quad.nodes**2 / 2.0)))
    assert abs(got / ref - 1.0) < 1e-12


def test_exact_clipping_is_a_point_mass() -> None:
    env = SensitivityEnvelope()
    assert env.exact and env.atom() == 1.0 and env.mean() == 1.0
    quad = env.quadrature()
    assert quad.nodes.tolist() == [1.0] and quad.weights.tolist() == [1.0]
    assert quad.tail_mass == 0.0


def test_k1_has_infinite_mean() -> None:
    assert SensitivityEnvelope(sketch_dim=1).mean() == math.inf


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sketch_dim": 0}, ValueError, "sketch_dim must be >= 1"),
        ({"sketch_dim": -3}, ValueError, "sketch_dim must be >= 1"),
        ({"sketch_dim": 2.5}, TypeError, "sketch_dim must be an int"),
        ({"sketch_dim": True}, TypeError, "sketch_dim must be an int"),
        ({"sketch_dim": 8, "envelope": "normal"}, ValueError, "envelope must be one of"),
    ],
)
def test_invalid_envelopes_are_rejected(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        SensitivityEnvelope(**kwargs)


def test_quadrature_argument_validation() -> None:
    env = SensitivityEnvelope(sketch_dim=8)
    with pytest.raises(ValueError, match="eta must be in"):
        env.quadrature(eta=0.1)
    with pytest.raises(ValueError, match="panels"):
        env.quadrature(panels=0)
