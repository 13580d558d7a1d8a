"""Numerical checks of every step of the envelope proofs in docs/privacy/envelope.md.

The exact law of X_w = sum_j w_j chi2_k / k (and of X_w plus exponential terms) comes from
Moschopoulos' series (tests/docs/gamma_sums.py), independent of the library. Tolerances: the
series is exact to ~1e-14 absolute; finite differences with step h have error O(h^2 f''') ~
1e-9 at h = 1e-5, hence the 1e-6 relative tolerances on derivatives.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import integrate, optimize, special, stats

from opacus_rc.accountants.analysis.envelope import envelope_cdf


def _load(name: str):  # pytest runs in importlib mode: load the sibling oracle by path
    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_opacus_rc_docs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GS = _load("gamma_sums")
GammaSum, weighted_chi2 = GS.GammaSum, GS.weighted_chi2


def cdf_w(w, k: int, y: float) -> float:
    """P(X_w <= y)."""
    return float(weighted_chi2(w, k).cdf(y)[0])


def p_plus(w, k: int, y: float, theta: float | None = None) -> float:
    """Density at y of X_w + theta E (of X_w itself if theta is None)."""
    extra = () if theta is None else ((1.0, theta),)
    return float(weighted_chi2(w, k, extra).pdf(y)[0])


def rank_one(k: int, y: float) -> float:
    return float(stats.chi2.cdf(k * y, k))


def random_weights(rng: np.random.Generator, n: int, low: float = 0.03) -> np.ndarray:
    """Random simplex point with every weight >= low (keeps the series short)."""
    w = rng.dirichlet(np.ones(n))
    w = low + (1.0 - n * low) * w
    return w / w.sum()


def test_gamma_sum_oracle() -> None:
    """The oracle itself: one component is scipy's Gamma; two components match numerical
    convolution; the density integrates to the CDF and its derivative to the density."""
    one = GammaSum([2.5], [0.3])
    t = np.array([0.2, 0.75, 2.0])
    np.testing.assert_allclose(one.cdf(t), stats.gamma.cdf(t, 2.5, scale=0.3), rtol=1e-13)
    two = GammaSum([1.5, 4.0], [0.2, 0.7])
    for x in (0.5, 2.0, 4.0):
        conv = integrate.quad(
            lambda u, x=x: (
                stats.gamma.pdf(u, 1.5, scale=0.2) * stats.gamma.pdf(x - u, 4, scale=0.7)
            ),
            0,
            x,
            epsabs=0,
            epsrel=1e-12,
        )[0]
        assert float(two.pdf(x)[0]) == pytest.approx(conv, rel=1e-11, abs=1e-15)
    assert float(two.cdf(2.0)[0]) == pytest.approx(
        integrate.quad(lambda u: float(two.pdf(u)[0]), 1e-12, 2.0, epsrel=1e-12)[0], rel=1e-10
    )
    h = 1e-5
    fd = (float(two.pdf(2.0 + h)[0]) - float(two.pdf(2.0 - h)[0])) / (2 * h)
    assert float(two.dpdf(2.0)[0]) == pytest.approx(fd, rel=1e-7)


def test_many_equal_weights_push_the_cdf_to_one_above_the_mean() -> None:
    """Proposition 1: equal weights on m coordinates give chi2_{mk} / (mk), whose CDF at any
    y > 1 tends to 1 (and exceeds the rank-one value); at y < 1 it tends to 0."""
    for k in (1, 8, 32):
        for y in (1.01, 1.05, 1.5):
            vals = [stats.chi2.cdf(m * k * y, m * k) for m in (1, 10, 100, 10_000, 1_000_000)]
            assert vals[-2] <= vals[-1]  # the approach is eventually monotone
            assert vals[-1] > 1 - 1e-6 and vals[-1] > rank_one(k, y)
        assert stats.chi2.cdf(1_000_000 * k * 0.95, 1_000_000 * k) < 1e-6


@pytest.mark.parametrize("k", [2, 3, 8])
def test_size_bias_identities(k: int) -> None:
    """Lemma 1: E[Y g(Y)] = E[g(Y + E / alpha)]; dF/dw_j = -p_{X + theta_j E}(y) (central
    differences, h = 1e-5); y p_X(y) = sum_j w_j p_{X + theta_j E}(y)."""
    a = k / 2.0
    # E[Y 1{Y <= c}] = P(Y + E/alpha <= c): both sides independently
    for c in (0.4, 1.0, 2.5):
        lhs = integrate.quad(lambda u: u * stats.gamma.pdf(u, a, scale=1 / a), 0, c)[0]
        rhs = float(GammaSum([a, 1.0], [1 / a, 1 / a]).cdf(c)[0])
        assert lhs == pytest.approx(rhs, rel=1e-10)
    rng = np.random.default_rng(k)
    w = random_weights(rng, 3)
    for y in (0.3, 0.7, 0.95):
        partials = []
        for j in range(3):
            h = 1e-5
            up, down = w.copy(), w.copy()
            up[j] += h
            down[j] -= h
            fd = (cdf_w(up, k, y) - cdf_w(down, k, y)) / (2 * h)
            exact = -p_plus(w, k, y, w[j] / a)
            assert fd == pytest.approx(exact, rel=1e-6), (j, y)
            partials.append(-exact)
        assert y * p_plus(w, k, y) == pytest.approx(float(np.dot(w, partials)), rel=1e-11)


@pytest.mark.parametrize("k", [2, 4, 32])
def test_vertex_derivative_identity(k: int) -> None:
    """Lemma 2: along w + t(e_1 - w), dF/dt = y p_X - p_{X + theta_1 E}
    = sum_j alpha theta_j (theta_1 - theta_j) q_j'(y), q_j the density of
    X + theta_j E' + theta_1 E''."""
    a = k / 2.0
    rng = np.random.default_rng(100 + k)
    w = np.sort(random_weights(rng, 3))[::-1]  # coordinate 0 has the largest weight
    th = w / a
    e1 = np.array([1.0, 0.0, 0.0])
    for y in (0.4, 0.8, 0.97):
        d_direct = y * p_plus(w, k, y) - p_plus(w, k, y, th[0])
        d_series = sum(
            a
            * th[j]
            * (th[0] - th[j])
            * float(weighted_chi2(w, k, ((1.0, th[j]), (1.0, th[0]))).dpdf(y)[0])
            for j in range(3)
        )
        assert d_direct == pytest.approx(d_series, rel=1e-9, abs=1e-14)
        h = 1e-5
        fd = (cdf_w(w + h * (e1 - w), k, y) - cdf_w(w - h * (e1 - w), k, y)) / (2 * h)
        assert fd == pytest.approx(d_direct, rel=1e-6, abs=1e-12)


def test_mode_lemma() -> None:
    """Lemma 3: T = sum theta_g Gamma(beta_g), beta_g > 1, has an increasing density on (0, M),
    M = sum (beta_g - 1) theta_g; indeed (sum lambda_g) p'/p >= M (M - t) / t."""
    rng = np.random.default_rng(7)
    for _ in range(25):
        n = int(rng.integers(1, 5))
        beta = 1.0 + rng.uniform(0.05, 4.0, size=n)
        theta = rng.uniform(0.05, 1.0, size=n)
        M = float(np.sum((beta - 1) * theta))
        lam = float(np.sum((beta - 1) * theta**2))
        T = GammaSum(beta, theta)
        t = np.linspace(0.02, 0.98, 25) * M
        p, dp = T.pdf(t), T.dpdf(t)
        assert np.all(dp > 0), (beta, theta)
        assert np.all(lam * dp / p >= M * (M - t) / t * (1 - 1e-9) - 1e-12)


@pytest.mark.parametrize("k", [2, 4])
def test_two_value_lemma_ingredients(k: int) -> None:
    """Lemma 4, its two ingredients: for k >= 2, log p_X is concave; and a level c is met by
    theta -> p_{X + theta E}(y) at most twice (the zeros of the Laplace transform L(beta),
    beta = 1 / theta, whose sign is that of p_{X + theta E}(y) - c)."""
    rng = np.random.default_rng(11 + k)
    for _ in range(2):
        w = random_weights(rng, 4)
        X = weighted_chi2(w, k)
        t = np.linspace(0.05, 2.5, 200)
        logp = np.log(X.pdf(t))
        assert np.all(np.diff(logp, 2) <= 1e-10)
        for y in (0.5, 0.9):
            thetas = np.geomspace(1e-2, 5.0, 60)
            vals = np.array([p_plus(w, k, y, th) for th in thetas])
            for c in np.quantile(vals, [0.1, 0.3, 0.5, 0.7, 0.9]):
                changes = np.count_nonzero(np.diff(np.sign(vals - c)))
                assert changes <= 2, (w, y, c)


def test_descartes_rule_for_laplace_transforms() -> None:
    """Lemma 5: h(u) = poly(u) e^{-u} with r sign changes on (0, inf) (random roots) has a
    Laplace transform (closed form sum_n a_n n! / (beta + 1)^(n + 1)) with at most r positive
    zeros; with one sign change at a < 1 there is exactly one, at beta = 1/a - 1."""
    rng = np.random.default_rng(5)
    betas = np.geomspace(1e-3, 1e3, 4000)
    for _ in range(200):
        r = int(rng.integers(0, 4))
        roots = np.sort(rng.uniform(0.05, 8.0, size=r))
        coeffs = np.poly(roots)[::-1] if r else np.array([1.0])  # a_0 + a_1 u + ...
        L = sum(a * math.factorial(n) / (betas + 1) ** (n + 1) for n, a in enumerate(coeffs))
        assert np.count_nonzero(np.diff(np.sign(L))) <= r
    for a in (0.1, 0.5, 0.9):
        L = 1.0 / (betas + 1) ** 2 - a / (betas + 1)
        flips = np.nonzero(np.diff(np.sign(L)))[0]
        assert flips.size == 1 and betas[flips[0]] <= 1 / a - 1 <= betas[flips[0] + 1]


@pytest.mark.parametrize("k", [2, 3, 4, 8, 32])
def test_two_valued_points_are_not_maxima(k: int) -> None:
    """Step 6: at i weights a > m weights b, the derivative toward the vertex of an a-weight is
    positive on (0, 1), by the mode lemma applied to Gamma(i alpha + 1) + Gamma(m alpha + 1)
    with M = 1."""
    a_ = k / 2.0
    for i, m in ((1, 1), (1, 3), (2, 2), (3, 1)):
        for ratio in (1.5, 4.0):
            b = 1.0 / (i * ratio + m)
            a = ratio * b
            w = np.array([a] * i + [b] * m)
            T = GammaSum([i * a_ + 1, m * a_ + 1], [a / a_, b / a_])
            assert float(np.sum([i * a_, m * a_] * np.array([a / a_, b / a_]))) == pytest.approx(1)
            ys = np.linspace(0.15, 0.99, 12)
            assert np.all(T.dpdf(ys) > 0)
            for y in ys[::3]:
                d = y * p_plus(w, k, y) - p_plus(w, k, y, a / a_)
                assert d > 0, (k, i, m, ratio, y)


@pytest.mark.parametrize("k", [2, 3, 4, 8, 32])
def test_rank_one_is_the_worst_case_below_the_mean(k: int) -> None:
    """Theorem L: random weight vectors (2 to 5 weights) and near-vertex ones never beat the
    rank-one value P(chi2_k <= k y) for y < 1 (relative slack 1e-12 for rounding)."""
    rng = np.random.default_rng(1000 + k)
    vectors = [random_weights(rng, int(rng.integers(2, 6))) for _ in range(12)]
    vectors += [np.array([1 - e, e]) for e in (0.02, 0.05)]
    vectors += [np.array([1 - 2 * e, e, e]) for e in (0.02, 0.1)]
    ys = (0.1, 0.4, 0.7, 0.9, 0.99)
    for w in vectors:
        X = weighted_chi2(w, k)
        vals = X.cdf(np.array(ys))
        ref = np.array([rank_one(k, y) for y in ys])
        assert np.all(vals <= ref * (1 + 1e-12)), (w, vals, ref)


def test_rank_one_is_not_the_worst_case_above_the_mean() -> None:
    """The restriction y < 1 is sharp: at y = 1.01 many-coordinate uniform weights beat the
    rank-one value for every k, and near-vertex weights do too for k = 8 and 32."""
    y = 1.01
    for k in (1, 2, 8, 32):
        assert stats.chi2.cdf(1_000_000 * k * y, 1_000_000 * k) > rank_one(k, y)
    for k in (8, 32):
        assert cdf_w(np.array([0.98, 0.02]), k, y) > rank_one(k, y)


@pytest.mark.parametrize("envelope", ["chi2", "schur", "chernoff"])
def test_lemma_d_exact_parts_never_hurt(envelope: str) -> None:
    """Lemma D: P(a + (1 - a) X' <= y) = P(X' <= (y - a)/(1 - a)) <= F_env(y)."""
    rng = np.random.default_rng(3)
    for k in (2, 8, 32):
        for _ in range(3):
            w = random_weights(rng, 3)
            X = weighted_chi2(w, k)
            for a in (0.0, 0.1, 0.5, 0.9):
                for y in (0.2, 0.6, 0.95, 1.2):
                    lhs = 1.0 if y >= 1 else float(X.cdf((y - a) / (1 - a))[0]) if y > a else 0.0
                    env = float(envelope_cdf(y, sketch_dim=k, envelope=envelope))
                    assert lhs <= env * (1 + 1e-12) + 1e-15, (k, w, a, y)


@pytest.mark.parametrize("k", [3, 4, 8, 32])
def test_schur_convexity_below_1_minus_2_over_k(k: int) -> None:
    """Proposition 2: for y <= 1 - 2/k, moving weight from a smaller to a larger coordinate
    raises F (Schur-Ostrowski: (w_i - w_j)(dF/dw_i - dF/dw_j) >= 0)."""
    a = k / 2.0
    y_top = 1.0 - 2.0 / k
    rng = np.random.default_rng(50 + k)
    for _ in range(6):
        w = random_weights(rng, 3, low=0.08)
        i, j = int(np.argmax(w)), int(np.argmin(w))
        for y in (0.5 * y_top, y_top):
            d_i = -p_plus(w, k, y, w[i] / a)
            d_j = -p_plus(w, k, y, w[j] / a)
            assert (w[i] - w[j]) * (d_i - d_j) >= -1e-15
            moved = w.copy()
            moved[i] += 0.03
            moved[j] -= 0.03
            assert cdf_w(moved, k, y) >= cdf_w(w, k, y) * (1 - 1e-12)


def test_schur_region_is_sharp() -> None:
    """Just above 1 - 2/k, near (1 - eps, eps, 0), moving mass to the empty coordinate raises F
    (its derivative p_{X + theta_2 E}(y) - p_X(y) is positive); below, it lowers F."""
    k, a = 8, 4.0
    w = np.array([0.97, 0.03])
    for y, sign in ((0.8, 1.0), (0.7, -1.0)):  # 1 - 2/k = 0.75
        slope = p_plus(w, k, y, w[1] / a) - p_plus(w, k, y)
        assert sign * slope > 0, (y, slope)
        spread = cdf_w(np.array([0.97, 0.025, 0.005]), k, y) - cdf_w(w, k, y)
        assert sign * spread > 0, (y, spread)


@pytest.mark.parametrize("k", [1, 2, 8, 32])
def test_convex_order_hinge_bound(k: int) -> None:
    """Proposition 3: E(c - X_w)_+ <= E(c - Y)_+ (X_w <=_cx Y), hence
    P(X_w <= y) <= h(y) = inf_c E(c - Y)_+ / (c - y); and h <= Chernoff."""
    a = k / 2.0

    def hinge_y(c: float) -> float:  # E(c - Y)_+ = c F_Y(c) - P(chi2_{k+2} <= k c)
        return c * special.gammainc(a, a * c) - special.gammainc(a + 1, a * c)

    rng = np.random.default_rng(70 + k)
    for _ in range(4):
        w = random_weights(rng, 3)
        X = weighted_chi2(w, k)
        for c in (0.5, 0.9, 1.3):
            lhs = integrate.quad(lambda t, X=X: float(X.cdf(t)[0]), 0, c, epsrel=1e-11)[0]
            assert lhs <= hinge_y(c) * (1 + 1e-9)
        for y in (0.3, 0.8, 0.97):
            h = optimize.minimize_scalar(
                lambda c, y=y: hinge_y(c) / (c - y), bounds=(y + 1e-9, 40), method="bounded"
            ).fun
            assert float(X.cdf(y)[0]) <= h * (1 + 1e-9)
            assert h <= (y * math.exp(1 - y)) ** a * (1 + 1e-9)


@pytest.mark.parametrize("k", [1, 2, 8, 32])
def test_chernoff_laplace_bound(k: int) -> None:
    """Proposition 4: E exp(-t X_w) = prod (1 + 2 t w_j / k)^(-k/2) <= (1 + 2t/k)^(-k/2)
    (checked against the oracle's law too), and min_t e^{ty}(1 + 2t/k)^(-k/2) is
    (y e^{1 - y})^(k/2)."""
    rng = np.random.default_rng(90 + k)
    for _ in range(4):
        w = random_weights(rng, 3)
        X = weighted_chi2(w, k)
        for t in (0.1, 1.0, 10.0):
            lt = float(np.prod((1 + 2 * t * w / k) ** (-k / 2)))
            assert lt <= (1 + 2 * t / k) ** (-k / 2) * (1 + 1e-14)
            by_law = integrate.quad(
                lambda u, t=t, X=X: math.exp(-t * u) * float(X.pdf(u)[0]), 1e-12, np.inf, limit=200
            )[0]
            assert by_law == pytest.approx(lt, rel=1e-7)
    for y in (0.2, 0.6, 0.95):
        best = optimize.minimize_scalar(
            lambda t, y=y: t * y - (k / 2) * math.log1p(2 * t / k),
            bounds=(0, 1e4),
            method="bounded",
            options={"xatol": 1e-10},
        ).fun
        assert math.exp(best) == pytest.approx((y * math.exp(1 - y)) ** (k / 2), rel=1e-7)
