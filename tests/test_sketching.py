"""Tests of the trace estimators in ``opacus_rc.sketching`` (docs/privacy/estimators.md#estimators).

Statistical checks use fixed seeds and a tolerance of at least 4 standard deviations of the
statistic, derived in each test from the law of docs/privacy/estimators.md#estimators-hutchinson.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from opacus_rc.sketching import (
    ESTIMATORS,
    GRADIENT_ESTIMATORS,
    get_estimator,
    hutchinson_sqnorm,
    hutchinson_sqnorm_of_gradients,
    hutchpp_sqnorm,
    pow2_scale,
    sample_absmax,
    validate_sketch_dim,
)

# Hand-made oracle (independent float64 NumPy values): exact ||G_i^T A_i||_F^2 and n_hat for
# Omega = rng(123).normal((3,4))/2 on the fixture of oracle_factors().
EXACT = np.array([30.50139485, 48.45486162])
NHAT_ORACLE = np.array([15.08888833, 20.93363968])
W0_ORACLE = np.array([0.870770258, 0.129229742])  # normalised spectrum of O_0 (nonzero part)


def oracle_factors() -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle fixture: T=6, d=4, p=3, A0[t,j] = sin(1+t+2j), G0[t,i] = cos(0.5t-i)."""
    t = np.arange(6)[:, None]
    A0 = np.sin(1 + t + 2 * np.arange(4)[None, :])
    G0 = np.cos(0.5 * t - np.arange(3)[None, :])
    A = np.stack([A0, A0 * (1 + 0.1 * t)])
    G = np.stack([G0, G0[::-1]])
    return torch.tensor(A), torch.tensor(G)


def spectrum_weights(A: np.ndarray, G: np.ndarray) -> np.ndarray:
    """Normalised eigenvalues w_j of O = M M^T, M = G^T A (numpy, float64)."""
    M = G.T @ A
    lam = np.clip(np.linalg.eigvalsh(M @ M.T), 0, None)
    return lam / lam.sum()


def test_exact_oracle_of_the_fixture() -> None:
    A, G = oracle_factors()
    exact = ((G.transpose(1, 2) @ A) ** 2).sum((1, 2)).numpy()
    np.testing.assert_allclose(exact, EXACT, rtol=1e-9)
    w = np.sort(spectrum_weights(A[0].numpy(), G[0].numpy()))[::-1]
    np.testing.assert_allclose(w[:2], W0_ORACLE, rtol=1e-8)
    assert abs(w[2]) < 1e-12


def test_hutchinson_equals_trace_oracle_for_given_probes() -> None:
    """n_hat = tr(Omega^T O Omega) exactly (docs/privacy/estimators.md#estimators-hutchinson; oracle
    numbers above)."""
    A, G = oracle_factors()
    omega = np.random.default_rng(123).standard_normal((3, 4)) / 2
    est = hutchinson_sqnorm(A, G, sketch_dim=4, probes=torch.tensor(omega))
    np.testing.assert_allclose(est.numpy(), NHAT_ORACLE, rtol=1e-8)
    # Independent numpy evaluation of tr(Omega^T O Omega).
    for i in range(2):
        M = G[i].numpy().T @ A[i].numpy()
        np.testing.assert_allclose(est[i].item(), np.trace(omega.T @ M @ M.T @ omega), rtol=1e-10)
    # float32 inputs: float32 output, same value to float32 precision.
    est32 = hutchinson_sqnorm(A.float(), G.float(), sketch_dim=4, probes=torch.tensor(omega))
    assert est32.dtype == torch.float32
    np.testing.assert_allclose(est32.numpy(), NHAT_ORACLE, rtol=1e-5)


def test_input_side_sketch_is_trace_of_gram_of_m_transpose() -> None:
    A, G = oracle_factors()
    omega_d = np.random.default_rng(7).standard_normal((4, 5)) / math.sqrt(5)
    est = hutchinson_sqnorm(A, G, sketch_dim=5, probes=torch.tensor(omega_d), side="input")
    for i in range(2):
        M = G[i].numpy().T @ A[i].numpy()
        np.testing.assert_allclose(
            est[i].item(), np.trace(omega_d.T @ M.T @ M @ omega_d), rtol=1e-10
        )


@pytest.mark.parametrize("side", ["output", "input"])
def test_hutchinson_unbiased_with_formula_variance(side: str) -> None:
    """Mean and variance of n_hat/n over N = 200,000 independent per-sample sketches.

    The batch holds N copies of each oracle sample; per-sample probes make them independent.
    W = n_hat/n has mean 1 and Var W = (2/k) sum_j w_j^2
    (docs/privacy/estimators.md#estimators-hutchinson).
    * mean: sd(mean W) = sqrt(Var W / N); allow 4 sd.
    * variance: the sample variance has relative sd sqrt((mu4/sigma^4 - 1)/N) with
      mu4/sigma^4 = 3 + kappa4/kappa2^2 = 3 + 12 sum w^4 / (k (sum w^2)^2) (cumulants of a
      chi-square mixture); for k = 4 and rank one this is 6, so the relative sd is
      sqrt(5/N) = 0.005 at N = 200,000 and 3% is 6 sd. N was chosen from this.
    """
    k, N = 4, 200_000
    A, G = oracle_factors()
    gen = torch.Generator().manual_seed(2024 if side == "output" else 2025)
    for i in range(2):
        Ai = A[i].expand(N, -1, -1)
        Gi = G[i].expand(N, -1, -1)
        W = (hutchinson_sqnorm(Ai, Gi, sketch_dim=k, generator=gen, side=side) / EXACT[i]).numpy()
        w = spectrum_weights(A[i].numpy(), G[i].numpy())
        var_w = 2 / k * np.sum(w**2)
        if i == 0:
            assert var_w == pytest.approx(0.387471, abs=1e-6)  # (2/k) sum w_j^2 with the oracle's w
        assert abs(W.mean() - 1) < 4 * math.sqrt(var_w / N)
        kurt = 3 + 12 * np.sum(w**4) / (k * np.sum(w**2) ** 2)
        rel_sd_var = math.sqrt((kurt - 1) / N)
        assert 5 * rel_sd_var < 0.03  # the 3% band is at least 5 standard errors wide
        assert abs(W.var(ddof=1) / var_w - 1) < 0.03


def test_hutchinson_rank_one_law_is_scaled_chi_square() -> None:
    """Rank-one gradient (T = 1): n_hat/n ~ chi2_k / k exactly; KS test, 20,000 draws.

    The same data against chi2_{k+1}/(k+1) must be rejected, so the test has power.
    """
    k, N = 3, 20_000
    gen = torch.Generator().manual_seed(11)
    a = torch.randn(1, 1, 5, dtype=torch.float64, generator=gen)
    g = torch.randn(1, 1, 4, dtype=torch.float64, generator=gen)
    exact = (g.norm() * a.norm()).item() ** 2
    W = hutchinson_sqnorm(
        a.expand(N, -1, -1), g.expand(N, -1, -1), sketch_dim=k, generator=gen
    ).numpy()
    W = W / exact
    assert stats.kstest(W, stats.chi2(df=k, scale=1 / k).cdf).pvalue > 1e-3
    assert stats.kstest(W, stats.chi2(df=k + 1, scale=1 / (k + 1)).cdf).pvalue < 1e-6


def test_hutchinson_mixture_law_two_sample_ks() -> None:
    """Oracle sample 0: n_hat/n ~ w1 chi2_k/k + w2 chi2_k/k
    (docs/privacy/estimators.md#estimators-hutchinson).

    Two-sample KS against 20,000 numpy draws of the mixture (an independent generator).
    """
    k, N = 4, 20_000
    A, G = oracle_factors()
    gen = torch.Generator().manual_seed(5)
    W = hutchinson_sqnorm(
        A[0].expand(N, -1, -1), G[0].expand(N, -1, -1), sketch_dim=k, generator=gen
    ).numpy()
    W = W / EXACT[0]
    rng = np.random.default_rng(99)
    ref = sum(wj * rng.chisquare(k, size=N) / k for wj in W0_ORACLE)
    assert stats.ks_2samp(W, ref).pvalue > 1e-3
    # Power: the rank-one law (w = e1) is a different distribution and must be rejected.
    assert stats.ks_2samp(W, rng.chisquare(k, size=N) / k).pvalue < 1e-6


def test_hutchpp_exact_when_rank_at_most_head_dim() -> None:
    """docs/privacy/estimators.md#estimators-hutchpp: with s >= rank(M), Hutch++ returns the exact
    value for any probes."""
    A, G = oracle_factors()
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        est = hutchpp_sqnorm(A, G, sketch_dim=2, head_dim=3, generator=gen)
        np.testing.assert_allclose(est.numpy(), EXACT, rtol=1e-9)
    # Planted rank 2 in larger dimensions, s = 2.
    gen = torch.Generator().manual_seed(3)
    U = torch.randn(4, 9, 2, dtype=torch.float64, generator=gen)
    A2 = U @ torch.randn(4, 2, 7, dtype=torch.float64, generator=gen)
    G2 = torch.randn(4, 9, 6, dtype=torch.float64, generator=gen)
    exact = ((G2.transpose(1, 2) @ A2) ** 2).sum((1, 2))
    est = hutchpp_sqnorm(A2, G2, sketch_dim=1, head_dim=2, generator=gen)
    torch.testing.assert_close(est, exact, rtol=1e-9, atol=0)


def test_hutchpp_unbiased_full_rank() -> None:
    """rank(M) = 5 > s = 2: the tail is random; mean over N = 50,000 draws within 4 sd.

    Var(n_hat++) = E[(2/k) ||(I-QQ^T) M^T M (I-QQ^T)||_F^2] <= (2/k) ||M^T M||_F^2 (the head is
    exact and E[n_hat++ | Q] = n), so sd(mean) <= sqrt((2/k) ||O||_F^2 / N).
    """
    k, s, N = 3, 2, 50_000
    gen = torch.Generator().manual_seed(17)
    A = torch.randn(1, 8, 6, dtype=torch.float64, generator=gen)
    G = torch.randn(1, 8, 5, dtype=torch.float64, generator=gen)
    M = G[0].T @ A[0]
    exact = (M**2).sum().item()
    o_fro2 = ((M @ M.T) ** 2).sum().item()
    est = hutchpp_sqnorm(
        A.expand(N, -1, -1), G.expand(N, -1, -1), sketch_dim=k, head_dim=s, generator=gen
    )
    sd_mean = math.sqrt(2 / k * o_fro2 / N)
    assert abs(est.mean().item() - exact) < 4 * sd_mean
    assert est.var().item() > 0  # the tail is genuinely random here
    # Head + tail: the variance is below plain Hutchinson's (2/k)||O||_F^2 (MMMW 2021).
    assert est.var().item() < 2 / k * o_fro2


def test_per_sample_probes_are_independent() -> None:
    A, G = oracle_factors()
    gen = torch.Generator().manual_seed(0)
    est = hutchinson_sqnorm(
        A[:1].expand(8, -1, -1), G[:1].expand(8, -1, -1), sketch_dim=4, generator=gen
    )
    assert torch.unique(est).numel() == 8


def test_generator_determines_the_draws() -> None:
    A, G = oracle_factors()
    for estimator in ESTIMATORS.values():
        e1 = estimator(A, G, sketch_dim=2, generator=torch.Generator().manual_seed(1))
        e2 = estimator(A, G, sketch_dim=2, generator=torch.Generator().manual_seed(1))
        e3 = estimator(A, G, sketch_dim=2, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(e1, e2, rtol=0, atol=0)
        if estimator is hutchinson_sqnorm:
            assert not torch.equal(e1, e3)


def test_bf16_inputs_accumulate_in_float32() -> None:
    """bf16 factors under bf16 autocast: float32 result equal (to 1e-5) to the float64
    computation on the same bf16-rounded values and the same probes.

    With T = 2048 a bf16 accumulation would be off by ~1e-3..1e-2 relative (8-bit mantissa),
    far outside 1e-5; float32 accumulation errs by ~sqrt(T) * 6e-8 ~ 3e-6.
    """
    gen = torch.Generator().manual_seed(8)
    A = torch.randn(3, 2048, 16, generator=gen).bfloat16()
    G = torch.randn(3, 2048, 12, generator=gen).bfloat16()
    for estimator in ESTIMATORS.values():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            est = estimator(A, G, sketch_dim=8, generator=torch.Generator().manual_seed(4))
        ref = estimator(
            A.double(), G.double(), sketch_dim=8, generator=torch.Generator().manual_seed(4)
        )
        assert est.dtype == torch.float32
        torch.testing.assert_close(est.double(), ref, rtol=1e-5, atol=0)


def test_empty_shapes() -> None:
    for estimator in ESTIMATORS.values():
        out = estimator(torch.zeros(0, 5, 3), torch.zeros(0, 5, 2), sketch_dim=4)
        assert out.shape == (0,)
        out = estimator(torch.zeros(2, 0, 3), torch.zeros(2, 0, 2), sketch_dim=4)
        torch.testing.assert_close(out, torch.zeros(2))


def test_registry_and_validators() -> None:
    assert set(ESTIMATORS) == {"hutchinson", "hutch++"}
    assert get_estimator("hutch++") is hutchpp_sqnorm
    with pytest.raises(
        ValueError, match=r"sketch must be one of \('hutchinson', 'hutch\+\+'\), got 'gauss'"
    ):
        get_estimator("gauss")
    with pytest.raises(ValueError, match="sketch_dim must be >= 1, got 0"):
        validate_sketch_dim(0)
    with pytest.raises(TypeError, match="sketch_dim must be an int"):
        validate_sketch_dim(2.0)
    with pytest.raises(TypeError, match="sketch_dim must be an int"):
        validate_sketch_dim(True)
    A, G = oracle_factors()
    with pytest.raises(ValueError, match=r"must agree on \(B, T\)"):
        hutchinson_sqnorm(A, G[:, :5], sketch_dim=2)
    with pytest.raises(ValueError, match="must be 3-D"):
        hutchinson_sqnorm(A[0], G[0], sketch_dim=2)
    with pytest.raises(ValueError, match="probes have 5 rows"):
        hutchinson_sqnorm(A, G, sketch_dim=2, probes=torch.zeros(5, 2))
    with pytest.raises(ValueError, match="head_dim must be >= 1"):
        hutchpp_sqnorm(A, G, sketch_dim=2, head_dim=0)
    with pytest.raises(ValueError, match="side must be one of"):
        hutchinson_sqnorm(A, G, sketch_dim=2, side="left")


def _old_absmax(t: torch.Tensor) -> torch.Tensor:
    """The max-abs pass the samplers ran before issue 34: ``vector_norm(ord=inf)`` per sample."""
    return torch.linalg.vector_norm(t.reshape(t.shape[0], -1), ord=math.inf, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_sample_absmax_and_its_scale_equal_the_inf_norm(dtype: torch.dtype) -> None:
    """The cheaper reduction gives the old value and power-of-two scale bit for bit: random
    samples (with extreme and subnormal magnitudes), an all-zero sample, samples holding +inf,
    -inf, NaN and NaN next to inf, a non-contiguous view, and rank 2 and 4 inputs."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn(9, 7, 5, generator=g, dtype=torch.float64)
    t[1] *= 1e-30 if dtype in (torch.float32, torch.float64) else 1e-3
    t[2] *= 1e30 if dtype in (torch.float32, torch.float64) else 1e3
    t[3] = 0.0
    t[4, 2, 1] = math.inf
    t[5, 0, 0] = -math.inf
    t[6, 6, 4] = math.nan
    t[7, 1, 1], t[7, 3, 3] = -math.inf, math.nan
    t[8] = -t[8].abs()  # the largest magnitude is a negative entry
    t = t.to(dtype)
    cases = [t, t.transpose(1, 2), t[:, :, 0], t.reshape(9, 7, 5, 1)]
    for case in cases:
        new, old = sample_absmax(case), _old_absmax(case)
        assert new.dtype == old.dtype == dtype
        assert torch.equal(new.isnan(), old.isnan())
        ok = ~old.isnan()
        assert torch.equal(new[ok], old[ok])
        if dtype in (torch.float32, torch.float64):
            for a, b in zip(pow2_scale(new), pow2_scale(old)):
                assert torch.equal(a, b)
    assert torch.equal(sample_absmax(torch.empty(3, 0, 4)), torch.zeros(3))
    assert sample_absmax(torch.empty(0, 2, 4)).shape == (0,)
    with pytest.raises(ValueError, match="batch-first"):
        sample_absmax(torch.ones(3))


def test_autocast_off_disables_autocast_and_costs_nothing_when_it_is_off() -> None:
    """Inside a CPU bf16 autocast region the products run in float32 and the region is restored
    after; outside any autocast region no ``torch.autocast`` is built (issue 34: ~25 us of Python
    per call, several calls per layer per step); on ``meta`` it is a no-op."""
    import contextlib

    from opacus_rc.sketching import autocast_off

    a = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
        with autocast_off(torch.device("cpu")):
            assert not torch.is_autocast_enabled("cpu")
            assert (a @ a).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")
        assert (a @ a).dtype == torch.bfloat16
    assert isinstance(autocast_off("cpu"), contextlib.nullcontext)
    assert isinstance(autocast_off("meta"), contextlib.nullcontext)
    with autocast_off("cpu"):
        assert (a @ a).dtype == torch.float32


@pytest.mark.parametrize("form", ["factors", "gradients"])
def test_float64_sum_of_squares_is_finite_up_to_the_float32_range(form: str) -> None:
    """``sum_dtype=torch.float64`` sums the float32 sketch's squares in float64. Ordinary values:
    the float32 sum's value (rtol 1e-5: each sum of k d <= 48 squares rounds by at most
    ~48 u = 3e-6 relative, u = 2^-24). Factors of 1e14 and 1e15 (gradient norms ~1e30,
    squares ~1e60, beyond float32; a sample at 1e-15 beside them): finite and the float64
    estimate with the same probes to float32 rounding of the products (rtol 1e-5). Factors of
    1e20 (entries ~1e40, beyond float32): inf, never a finite wrong value."""
    g = torch.Generator().manual_seed(0)
    A = torch.randn(3, 6, 4, generator=g)
    G = torch.randn(3, 6, 3, generator=g)

    def est(a: torch.Tensor, b: torch.Tensor, **kw: object) -> torch.Tensor:
        gen = torch.Generator().manual_seed(5)
        if form == "factors":
            return hutchinson_sqnorm(a, b, sketch_dim=4, generator=gen, **kw)
        m = (b.double().transpose(1, 2) @ a.double()).to(a.dtype)
        return hutchinson_sqnorm_of_gradients(m, sketch_dim=4, generator=gen, **kw)

    wide = est(A, G, sum_dtype=torch.float64)
    assert wide.dtype == torch.float64
    torch.testing.assert_close(wide, est(A, G).double(), rtol=1e-5, atol=0)
    big_a, big_g = A * 1e14, G * 1e15
    big_g[1] *= 1e-30
    assert not torch.isfinite(est(big_a, big_g)[[0, 2]]).any()  # float32 squares overflow
    wide = est(big_a, big_g, sum_dtype=torch.float64)
    assert torch.isfinite(wide).all() and wide[0] > 1e55
    torch.testing.assert_close(wide, est(big_a.double(), big_g.double()), rtol=1e-5, atol=0)
    assert not torch.isfinite(est(A * 1e20, G * 1e20, sum_dtype=torch.float64)).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("d", "p"), [(8, 4), (4, 8), (6, 6)])
def test_gradient_form_is_the_factor_form_with_the_same_probes(
    dtype: torch.dtype, d: int, p: int
) -> None:
    """The estimators from per-sample gradients ``M_i = G_i^T A_i`` draw the same probes from
    the same generator state as those from the factors (both sides: ``"auto"`` takes the output
    side for p <= d, the input side otherwise) and give the same values up to float rounding;
    ``scale=s`` gives the estimate of ``s M`` (``s^2`` times). Tolerance: the two orders of
    summation differ by a few float32 ulps per product (observed <= 6e-7 relative). Half
    precision: both forms accumulate in float32, the gradient form from ``M`` rounded to the
    half dtype (as Opacus' per-sample gradient of half factors is), a relative error of at most
    ``2 u`` in ``||M Omega||^2`` per entry (``u = 2^-8`` bfloat16, ``2^-11`` float16): rtol
    ``2e-2`` and ``2e-3`` (observed <= 6e-4 and 3e-5)."""
    B, T = 3, 5
    g = torch.Generator().manual_seed(0)
    A = torch.randn(B, T, d, generator=g).to(dtype)
    G = torch.randn(B, T, p, generator=g).to(dtype)
    M = torch.einsum("btp,btd->bpd", G.double(), A.double()).to(dtype)
    rtol = {torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(dtype, 1e-5)
    s = torch.full((B,), 2.0**-3, dtype=dtype)
    for factor_form, kwargs in (
        (hutchinson_sqnorm, {"sketch_dim": 16}),
        (hutchpp_sqnorm, {"sketch_dim": 3, "head_dim": 2}),
    ):
        grad_form = GRADIENT_ESTIMATORS[factor_form]
        want = factor_form(A, G, generator=torch.Generator().manual_seed(5), **kwargs)
        got = grad_form(M, generator=torch.Generator().manual_seed(5), **kwargs)
        torch.testing.assert_close(got, want, rtol=rtol, atol=0)
        scaled = grad_form(M, generator=torch.Generator().manual_seed(5), scale=s, **kwargs)
        torch.testing.assert_close(scaled * 64, want, rtol=rtol, atol=0)
        # Other probes give other values: the equality above is not a constant's.
        other = grad_form(M, generator=torch.Generator().manual_seed(6), **kwargs)
        assert not torch.allclose(other, want, rtol=1e-3)
    with pytest.raises(ValueError, match="3-D"):
        hutchinson_sqnorm_of_gradients(M[0], sketch_dim=4)
