"""Numerical checks of the mechanism-level claims of docs/privacy/ (reduction, threat models,
stochastic order, heavy tails, Hutch++), each against an independent computation."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import integrate, special, stats

from opacus_rc.accountants.analysis import SensitivityEnvelope, envelope_cdf
from opacus_rc.sketching import hutchinson_sqnorm, hutchpp_sqnorm


def _load(name: str):
    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_opacus_rc_docs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GS = _load("gamma_sums")


def test_likelihood_ratio_depends_only_on_the_gradient_direction() -> None:
    """Theorem B (docs/privacy/mechanism.md): for Q_d = (1-q) N(0, s^2 I) + q E_S N(S u, s^2 I)
    against P_d = N(0, s^2 I) in d = 5 dimensions, computed with scipy's multivariate normal,
    dQ_d/dP_d(x) equals the one-dimensional ratio of the pair (N(0, s^2), (1-q) N(0, s^2) +
    q E_S N(S, s^2)) at the projection u.x (any law of S; here three atoms), to rounding."""
    rng = np.random.default_rng(0)
    d, q, sigma = 5, 0.1, 1.3
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    s_atoms, s_probs = np.array([1.0, 1.7, 4.0]), np.array([0.5, 0.4, 0.1])
    p_d = stats.multivariate_normal(np.zeros(d), sigma**2 * np.eye(d))
    comps = [stats.multivariate_normal(s * u, sigma**2 * np.eye(d)) for s in s_atoms]
    for x in rng.standard_normal((20, d)) * 3.0:
        log_q = special.logsumexp(
            [math.log(1 - q) + p_d.logpdf(x)]
            + [math.log(q * w) + c.logpdf(x) for w, c in zip(s_probs, comps)]
        )
        t = float(u @ x)
        one_d = special.logsumexp(
            [math.log(1 - q) + stats.norm.logpdf(t, 0, sigma)]
            + [math.log(q * w) + stats.norm.logpdf(t, s, sigma) for w, s in zip(s_probs, s_atoms)]
        ) - stats.norm.logpdf(t, 0, sigma)
        assert log_q - p_d.logpdf(x) == pytest.approx(one_d, abs=1e-10)


def test_shared_sketch_gives_canaries_the_ratio_of_the_record() -> None:
    """docs/privacy/threat_models.md: with one sketch for the batch, canaries with
    M_z = M_x R_j (R_j isometries onto disjoint blocks) get n_hat_z = n_hat_x exactly, while
    their gradients are orthogonal to g_x; with per-sample sketches the ratios differ."""
    gen = torch.Generator().manual_seed(0)
    T, p, d, k, blocks = 6, 3, 12, 4, 3
    A_x = torch.zeros(T, d, dtype=torch.float64)
    A_x[:, :4] = torch.randn(T, 4, generator=gen, dtype=torch.float64)
    G = torch.randn(T, p, generator=gen, dtype=torch.float64)
    A = [A_x]
    for j in range(1, blocks):  # R_j moves coordinates 0..3 to the block 4j..4j+3
        A_z = torch.zeros_like(A_x)
        A_z[:, 4 * j : 4 * j + 4] = A_x[:, :4]
        A.append(A_z)
    A = torch.stack(A)
    Gb = G.expand(blocks, T, p)
    grads = torch.einsum("btp,btd->bpd", Gb, A).reshape(blocks, -1)
    gram = grads @ grads.T
    assert torch.allclose(gram - torch.diag(torch.diag(gram)), torch.zeros_like(gram))
    shared = torch.randn(p, k, generator=gen, dtype=torch.float64) / math.sqrt(k)
    est = hutchinson_sqnorm(A, Gb, sketch_dim=k, probes=shared, side="output")
    assert torch.allclose(est, est[0].expand(blocks), rtol=1e-13, atol=0)
    own = hutchinson_sqnorm(A, Gb, sketch_dim=k, generator=gen, side="output")
    assert not torch.allclose(own, own[0].expand(blocks), rtol=1e-3)


def _beta(env: SensitivityEnvelope, tau: float, q: float, sigma: float) -> float:
    """Type II error (1-q) Phi(tau/s) + q E Phi((tau - S)/s) of the threshold test, with
    E Phi((tau - S)/s) = Phi((tau - 1)/s) - int_1^inf phi((tau - s')/s)/s P(S > s') ds'
    (integration by parts with the survival function; independent of the quadrature)."""
    cuts = [1.0, *[a for a, _ in env.atoms()], 50.0]
    sf_part = sum(
        integrate.quad(
            lambda s: stats.norm.pdf((tau - s) / sigma) / sigma * float(env.sf(s)),
            lo,
            hi,
            limit=400,
            epsabs=1e-14,
        )[0]
        for lo, hi in zip(cuts, cuts[1:])
    )  # beyond 50: phi((tau - s)/sigma) < 1e-200
    return (1 - q) * stats.norm.cdf(tau / sigma) + q * (stats.norm.cdf((tau - 1) / sigma) - sf_part)


def test_hidden_tradeoff_is_ordered_by_the_stochastic_order() -> None:
    """docs/privacy/dominance.md: at equal type I error (same threshold), a stochastically
    larger S has a smaller type II error: exact <= ... ordering
    beta(chernoff) <= beta(schur) <= beta(chi2, k=32) <= beta(exact), beta(chi2, k=8) <=
    beta(chi2, k=32); and the likelihood ratio is non-decreasing in x."""
    q, sigma = 0.05, 1.0
    laws = {
        "chernoff": SensitivityEnvelope(sketch_dim=32, envelope="chernoff"),
        "schur": SensitivityEnvelope(sketch_dim=32, envelope="schur"),
        "chi2": SensitivityEnvelope(sketch_dim=32),
        "k8": SensitivityEnvelope(sketch_dim=8),
    }
    for tau in (-1.0, 0.5, 1.5, 3.0):
        b = {name: _beta(env, tau, q, sigma) for name, env in laws.items()}
        exact = (1 - q) * stats.norm.cdf(tau / sigma) + q * stats.norm.cdf((tau - 1) / sigma)
        assert b["chernoff"] < b["schur"] < b["chi2"] < exact, (tau, b)
        assert b["k8"] < b["chi2"]
    quad = laws["chi2"].quadrature()
    x = np.linspace(-5, 8, 200)
    logm = special.logsumexp(
        (quad.nodes[None, :] * x[:, None] - quad.nodes**2 / 2) / sigma**2, b=quad.weights, axis=1
    )
    assert np.all(np.diff(logm) > 0)


def test_garbling_kernel_maps_the_revealed_pairs() -> None:
    """docs/privacy/dominance.md: x -> r x + s sqrt(1 - r^2) xi maps N(mu, s^2) to
    N(r mu, s^2) (numerical convolution), so it maps N(0, s^2) to itself and N(s1, s^2) to
    N(eta(s1), s^2) with r = eta(s1)/s1."""
    sigma, s1, eta = 0.8, 2.0, 1.3
    r = eta / s1
    noise = sigma * math.sqrt(1 - r * r)
    for mu, target in ((0.0, 0.0), (s1, eta)):
        for z in (-1.0, 0.4, 1.3, 3.0):
            dens = integrate.quad(
                lambda x, mu=mu, z=z: (
                    stats.norm.pdf(x, mu, sigma) * stats.norm.pdf(z, r * x, noise)
                ),
                -np.inf,
                np.inf,
                epsabs=1e-14,
            )[0]
            assert dens == pytest.approx(stats.norm.pdf(z, target, sigma), rel=1e-9)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_sensitivity_tail_is_polynomial(k: int) -> None:
    """docs/privacy/heavy_tails.md: P(S > s) s^k -> c_k = (k/2)^(k/2) / Gamma(k/2 + 1), with
    relative error O(s^-2) (the next term of the chi2 CDF near 0)."""
    env = SensitivityEnvelope(sketch_dim=k)
    c_k = (k / 2) ** (k / 2) / math.gamma(k / 2 + 1)
    errs = [abs(float(env.sf(s)) * s**k / c_k - 1) for s in (10.0, 100.0, 1000.0)]
    assert errs[0] < 0.1 and errs[1] < errs[0] / 50 and errs[2] < errs[1] / 50


def test_renyi_moments_diverge() -> None:
    """docs/privacy/heavy_tails.md: the revealed-mode lower bound q^alpha E exp(alpha (alpha-1)
    S^2 / (2 sigma^2)) restricted to S <= s_top grows without bound in s_top; and in the hidden
    mode phi(x) m(x)^alpha, a lower bound of the integrand of E_P[L^alpha] (m from the
    continuous part of the uncapped law by adaptive quadrature), grows without bound in x
    (alpha = 1.5, k = 32, sigma = 1)."""
    k, sigma, alpha = 32, 1.0, 1.5
    env = SensitivityEnvelope(sketch_dim=k)
    partial = [
        integrate.quad(
            lambda s: math.exp(alpha * (alpha - 1) * s * s / (2 * sigma**2)) * float(env.pdf(s)),
            1.0,
            top,
            limit=400,
        )[0]
        for top in (5.0, 10.0, 20.0)
    ]
    assert partial[0] < partial[1] < partial[2] and partial[2] > 1e3 * partial[1]

    def log_integrand(x: float) -> float:
        m = integrate.quad(
            lambda s: (
                math.exp((s * x - s * s / 2) / sigma**2 - x * x / (2 * sigma**2))
                * float(env.pdf(s))
            ),
            1.0,
            x + 20.0,
            points=[x],
            limit=400,
        )[0]  # m(x) e^{-x^2 / (2 sigma^2)}, to stay in range
        log_m = math.log(m) + x * x / (2 * sigma**2)
        return stats.norm.logpdf(x, 0, sigma) + alpha * log_m

    # ~ (alpha - 1) x^2 / 2 - alpha (k + 1) log x: increasing from x ~ 14 on
    vals = [log_integrand(x) for x in (24.0, 48.0, 96.0)]
    assert vals[0] < vals[1] < vals[2] and vals[2] > 100.0


def test_hutchpp_ratio_given_the_head_is_a_hutchinson_ratio() -> None:
    """Theorem H (docs/privacy/hutchpp.md): with a fixed head sketch, n_hat++/n = h + (1-h) W'
    with h = ||M Q||^2 / ||M||^2 and W' distributed as sum_j w'_j chi2_k / k, w' the normalised
    spectrum of (I - QQ^T) M^T M (I - QQ^T). 20 000 tail draws: one-sample KS test against the
    exact law (Moschopoulos series), alpha = 1e-3; and the empirical CDF of the ratio stays
    below the chi2 envelope (binomial tolerance: 4 standard errors)."""
    gen = torch.Generator().manual_seed(1)
    n_draws, T, d, p, s, k = 20_000, 8, 5, 4, 1, 4
    A = torch.randn(T, d, generator=gen, dtype=torch.float64)
    G = torch.randn(T, p, generator=gen, dtype=torch.float64)
    S = torch.randn(d, s, generator=gen, dtype=torch.float64)
    M = G.T @ A
    Q = torch.linalg.qr(M.T @ M @ S).Q
    n = float((M**2).sum())
    h = float(((M @ Q) ** 2).sum()) / n
    resid = M @ (torch.eye(d, dtype=torch.float64) - Q @ Q.T)
    lam = torch.linalg.eigvalsh(resid.T @ resid).clamp(min=0).numpy()
    w = lam[lam > 1e-12 * lam.max()] / lam.sum()
    est = hutchpp_sqnorm(
        A.expand(n_draws, T, d),
        G.expand(n_draws, T, p),
        sketch_dim=k,
        head_dim=s,
        head_probes=S,
        generator=gen,
    ).numpy()
    ratio = est / n
    assert 0.0 < h < 1.0 and ratio.min() >= h - 1e-12
    law = GS.weighted_chi2(w, k)
    w_prime = (ratio - h) / (1 - h)
    ks = stats.kstest(w_prime, lambda t: law.cdf(np.asarray(t)))
    assert ks.pvalue > 1e-3, ks
    for y in (0.3, 0.6, 0.9):
        emp = float(np.mean(ratio <= y))
        env = float(envelope_cdf(y, sketch_dim=k))
        assert emp <= env + 4 * math.sqrt(env * (1 - env) / n_draws)
