"""Tests of the pure spectral-denoising functions (opacus_rc/denoising: shrinkage, svd, denoiser).

Oracles:
* The reference example of docs/denoising.md#denoising-oracle (values from an independent
  reference script, not this code): shrinker values, the planted rank-3 matrix drawn with
  ``numpy.random.default_rng(0)`` and its error/cosine table, the pure-noise control. Stated to
  1e-6 given the same numpy draws.
* The spiked-model identity eta*(y(x)) = x * c(x) * c~(x) of docs/denoising.md#denoising-shrinker,
  a closed form that does not use the shrinker formula.
* A NumPy re-implementation of the algorithm of docs/denoising.md#denoising-algorithm with the
  *expanded* shrinker formula (the library uses the factored one).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opacus_rc.denoising import (
    DEFAULT_KAPPA,
    denoise_matrix,
    frobenius_shrinker,
    optimal_shrinkage,
    shrink_singular_values,
)
from opacus_rc.denoising.svd import _randomized_svd

HYPOTHESIS = settings(max_examples=20, deadline=None, derandomize=True)


# ------------------------------------------------------------------------------------------------
# Helpers


def planted_e5() -> dict[str, np.ndarray | float]:
    """The planted test of docs/denoising.md#denoising-oracle, drawn exactly as described there."""
    m, n, sigma_e = 64, 256, 0.5
    x = np.array([3.0, 2.0, 1.2])
    theta = x * sigma_e * math.sqrt(n)
    rng = np.random.default_rng(0)
    U = np.linalg.qr(rng.standard_normal((m, 3)))[0]
    V = np.linalg.qr(rng.standard_normal((n, 3)))[0]
    X = U @ np.diag(theta) @ V.T
    Z = rng.standard_normal((m, n))
    noise_control = sigma_e * rng.standard_normal((m, n))  # "same rng, continuing"
    return {"X": X, "G": X + sigma_e * Z, "noise": noise_control, "sigma_e": sigma_e}


def rel_err(A: torch.Tensor, X: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(A - X) / torch.linalg.matrix_norm(X))


def cosine(A: torch.Tensor, X: torch.Tensor) -> float:
    return float((A * X).sum() / (torch.linalg.matrix_norm(A) * torch.linalg.matrix_norm(X)))


def numpy_reference(G: np.ndarray, sigma_e: float, kappa: float, norm_correction: bool):
    """docs/denoising.md#denoising-algorithm in NumPy, with the expanded shrinker formula."""
    M = G if G.shape[0] <= G.shape[1] else G.T
    m, n = M.shape
    U, s, Vt = np.linalg.svd(M, full_matrices=False)
    edge = sigma_e * (math.sqrt(m) + math.sqrt(n))
    if s[0] <= kappa * edge:
        return G.copy()
    inner = (s**2 - sigma_e**2 * (m + n)) ** 2 - 4 * sigma_e**4 * m * n
    shat = np.where(s > edge, np.sqrt(np.clip(inner, 0, None)) / s, 0.0)
    D = (U * shat) @ Vt
    if norm_correction:
        D = D * (np.linalg.norm(M) / np.linalg.norm(D))
    return D if G.shape[0] <= G.shape[1] else D.T


def random_planted(
    rows: int, cols: int, rank: int, sigma_e: float, seed: int, snr: float = 3.0
) -> torch.Tensor:
    """Low-rank signal (normalised strengths snr, snr/2, ...) plus N(0, sigma_e^2) noise."""
    gen = torch.Generator().manual_seed(seed)
    m, n = min(rows, cols), max(rows, cols)
    rank = min(rank, m)
    U = torch.linalg.qr(torch.randn(rows, rank, generator=gen, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(cols, rank, generator=gen, dtype=torch.float64)).Q
    x = snr / (1.0 + torch.arange(rank, dtype=torch.float64))
    theta = torch.clamp(x, min=1.1 * (m / n) ** 0.25) * sigma_e * math.sqrt(n)
    noise = sigma_e * torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    return (U * theta) @ V.T + noise


# ------------------------------------------------------------------------------------------------
# The shrinker (docs/denoising.md#denoising-shrinker)


@pytest.mark.parametrize(
    ("y", "expected"),
    [
        (1.4, 0.0),  # inside the bulk
        (1.5, 0.0),  # the edge 1 + sqrt(0.25) itself
        (1.6, 0.528891824951),
        (2.0, 1.280868845745),
        (3.0, 2.561737691490),
        (5.0, 4.745787605867),
    ],
)
def test_shrinker_oracle_beta_quarter(y: float, expected: float) -> None:
    # Independent reference values of eta*(y) at beta = 0.25 (the closed form of
    # docs/denoising.md#denoising-shrinker), given to 12 digits.
    assert frobenius_shrinker(y, beta=0.25).item() == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize(("y", "expected"), [(2.0, 0.0), (3.0, math.sqrt(5.0))])
def test_shrinker_oracle_square(y: float, expected: float) -> None:
    # For beta = 1 the shrinker is sqrt(y^2 - 4) (Gavish-Donoho 2017, abstract).
    assert frobenius_shrinker(y, beta=1.0).item() == pytest.approx(expected, abs=1e-9)


def spiked(x: float, beta: float) -> tuple[float, float, float, float]:
    """docs/denoising.md#denoising-shrinker: observed y(x), cos^2 of left and right vectors,
    x*c*c~."""
    y = math.sqrt((1 + x**2) * (beta + x**2)) / x
    c2 = (x**4 - beta) / (x**4 + beta * x**2)
    ct2 = (x**4 - beta) / (x**4 + x**2)
    return y, c2, ct2, x * math.sqrt(c2 * ct2)


def test_spiked_model_predictions_of_e5() -> None:
    # y(x) and eta(x) at beta = 0.25, x = (3, 2, 1.2) (the planted strengths of
    # docs/denoising.md#denoising-oracle), independent reference values to 8 decimals.
    ys = [3.20589734, 2.30488611, 1.69222076]
    etas = [2.79866174, 1.70832736, 0.74835915]
    for x, y_exp, eta_exp in zip((3.0, 2.0, 1.2), ys, etas):
        y, _, _, eta = spiked(x, 0.25)
        assert y == pytest.approx(y_exp, abs=1e-8)
        assert eta == pytest.approx(eta_exp, abs=1e-8)
        assert frobenius_shrinker(y, beta=0.25).item() == pytest.approx(eta_exp, abs=1e-8)


@HYPOTHESIS
@given(beta=st.floats(0.01, 1.0), excess=st.floats(0.01, 10.0))
def test_shrinker_equals_spiked_model_identity(beta: float, excess: float) -> None:
    # eta*(y(x)) = x c(x) c~(x) for every detectable x > beta^(1/4)
    # (docs/denoising.md#denoising-shrinker).
    x = beta**0.25 + excess
    y, _, _, expected = spiked(x, beta)
    assert frobenius_shrinker(y, beta=beta).item() == pytest.approx(expected, rel=1e-9)


@HYPOTHESIS
@given(m=st.integers(1, 300), n=st.integers(1, 300), sigma=st.floats(1e-3, 1e3))
def test_raw_shrinker_is_normalised_shrinker_in_raw_units(m: int, n: int, sigma: float) -> None:
    # s_hat = sigma sqrt(n_max) eta*(s / (sigma sqrt(n_max)); m_min / n_max), symmetric in (m, n).
    lo, hi = min(m, n), max(m, n)
    scale = sigma * math.sqrt(hi)
    y = torch.linspace(0.0, 6.0, 61, dtype=torch.float64)
    expected = scale * frobenius_shrinker(y, beta=lo / hi)
    got = shrink_singular_values(y * scale, noise_std=sigma, m=m, n=n)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12 * scale)
    got_t = shrink_singular_values(y * scale, noise_std=sigma, m=n, n=m)
    torch.testing.assert_close(got_t, got, rtol=0, atol=0)


def test_raw_shrinker_square_closed_form() -> None:
    # Square case in raw units: s_hat = sqrt(s^2 - 4 n sigma^2) above 2 sqrt(n) sigma
    # (Gavish-Donoho 2017, abstract), else 0.
    n, sigma = 100, 0.3
    s = torch.tensor([1.0, 5.9, 6.0, 6.1, 10.0, 50.0], dtype=torch.float64)
    expected = torch.where(s > 6.0, torch.sqrt((s**2 - 4 * n * sigma**2).clamp(min=0)), 0.0)
    torch.testing.assert_close(
        shrink_singular_values(s, noise_std=sigma, m=n, n=n), expected, rtol=1e-12, atol=1e-12
    )


def test_zero_noise_shrinker_is_identity() -> None:
    s = torch.tensor([3.0, 2.0, 1e-3, 0.0], dtype=torch.float64)
    torch.testing.assert_close(shrink_singular_values(s, noise_std=0.0, m=4, n=9), s)


# ------------------------------------------------------------------------------------------------
# The planted rank-3 oracle (docs/denoising.md#denoising-oracle)


def test_planted_rank3_oracle() -> None:
    case = planted_e5()
    X, G = torch.from_numpy(case["X"]), torch.from_numpy(case["G"])
    sigma_e = case["sigma_e"]
    s = torch.linalg.svdvals(G)
    torch.testing.assert_close(
        s[:4],
        torch.tensor([25.6957, 18.5366, 13.5227, 11.2538], dtype=torch.float64),
        atol=5e-5,
        rtol=0,
    )
    assert sigma_e * (8 + 16) == 12.0  # threshold sigma_e (sqrt(m) + sqrt(n))
    assert float(torch.linalg.matrix_norm(X)) == pytest.approx(30.4, abs=1e-9)
    assert float(torch.linalg.matrix_norm(G)) == pytest.approx(70.58633, abs=5e-6)

    shrunk = optimal_shrinkage(G, noise_std=sigma_e)
    corrected = denoise_matrix(G, noise_std=sigma_e)  # default kappa 1.05: 25.7 > 12.6
    table = {  # docs/denoising.md#denoising-oracle: (relative error, cosine), tolerance 1e-6
        "noisy": (G, 2.101296, 0.425480),
        "shrunk": (shrunk, 0.484900, 0.874678),
        "shrunk + norm-corrected": (corrected, 1.526251, 0.874678),
    }
    for name, (A, err, cos) in table.items():
        assert rel_err(A, X) == pytest.approx(err, abs=1e-6), name
        assert cosine(A, X) == pytest.approx(cos, abs=1e-6), name
    # Norm correction restores the noisy Frobenius norm and keeps the shrunk direction.
    assert float(torch.linalg.matrix_norm(corrected)) == pytest.approx(70.58633, abs=5e-6)
    assert cosine(corrected, shrunk) == pytest.approx(1.0, abs=1e-12)
    # Exactly three singular values survive (the fourth, 11.25, is below the edge 12).
    assert int(torch.linalg.matrix_rank(shrunk, atol=1e-8)) == 3
    np.testing.assert_allclose(
        corrected.numpy(), numpy_reference(case["G"], sigma_e, 1.05, True), rtol=0, atol=1e-12
    )


def test_pure_noise_control_unchanged() -> None:
    # docs/denoising.md#denoising-oracle: continuing the same rng, s1/threshold = 0.977; kappa =
    # 1.05 leaves it as is.
    case = planted_e5()
    noise = torch.from_numpy(case["noise"])
    ratio = float(torch.linalg.svdvals(noise)[0]) / 12.0
    assert ratio == pytest.approx(0.977, abs=5e-4)
    out = denoise_matrix(noise, noise_std=case["sigma_e"], kappa=1.05)
    assert torch.equal(out, noise)


def test_default_kappa_leaves_pure_noise_alone() -> None:
    # 200 pure-noise 8 x 512 matrices (a LoRA-factor-like aspect ratio). At kappa = 1 the top
    # singular value passes the bulk edge in ~10% of draws (Tracy-Widom fluctuations), at the
    # default 1.05 in none (DEFAULT_KAPPA comment); the test fails if the default drifts to 1.
    gen = torch.Generator().manual_seed(1)
    noise = 0.01 * torch.randn(200, 8, 512, generator=gen)
    out_default = denoise_matrix(noise, noise_std=0.01)
    assert DEFAULT_KAPPA == 1.05
    assert torch.equal(out_default, noise)
    out_edge = denoise_matrix(noise, noise_std=0.01, kappa=1.0)
    changed = (out_edge != noise).flatten(1).any(1).sum().item()
    assert 5 <= changed <= 50


# ------------------------------------------------------------------------------------------------
# Invariances and batching


SHAPES = [(24, 40), (40, 24), (30, 30), (2, 50), (50, 3)]


@HYPOTHESIS
@given(
    shape=st.sampled_from(SHAPES),
    c=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
    norm_correction=st.booleans(),
)
def test_scale_invariance(
    shape: tuple[int, int], c: float, seed: int, norm_correction: bool
) -> None:
    # denoise(c G, c sigma_e) = c denoise(G, sigma_e): every step is positively homogeneous.
    G = random_planted(*shape, rank=2, sigma_e=0.1, seed=seed)
    base = denoise_matrix(G, noise_std=0.1, norm_correction=norm_correction)
    scaled = denoise_matrix(c * G, noise_std=c * 0.1, norm_correction=norm_correction)
    torch.testing.assert_close(scaled, c * base, rtol=1e-9, atol=1e-12 * c)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("norm_correction", [True, False])
def test_transpose_equivariance(shape: tuple[int, int], norm_correction: bool) -> None:
    G = random_planted(*shape, rank=2, sigma_e=0.1, seed=7)
    out = denoise_matrix(G, noise_std=0.1, norm_correction=norm_correction)
    out_t = denoise_matrix(G.T, noise_std=0.1, norm_correction=norm_correction)
    torch.testing.assert_close(out_t, out.T, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out, G)  # the rule fired, so the check is not vacuous
    torch.testing.assert_close(
        optimal_shrinkage(G.T, noise_std=0.1), optimal_shrinkage(G, noise_std=0.1).T
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_numpy_reference(shape: tuple[int, int]) -> None:
    G = random_planted(*shape, rank=3, sigma_e=0.2, seed=11)
    for nc in (True, False):
        expected = numpy_reference(G.numpy(), 0.2, 1.05, nc)
        got = denoise_matrix(G, noise_std=0.2, norm_correction=nc).numpy()
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-11)


def test_batched_equals_per_matrix() -> None:
    # A (2, 3, 24, 40) batch mixing planted matrices (denoised) and pure noise (left alone):
    # each matrix gets its own threshold decision.
    mats = [random_planted(24, 40, rank=2, sigma_e=0.1, seed=s) for s in range(4)]
    gen = torch.Generator().manual_seed(5)
    mats += [0.1 * torch.randn(24, 40, generator=gen, dtype=torch.float64) for _ in range(2)]
    batch = torch.stack(mats).reshape(2, 3, 24, 40)
    out = denoise_matrix(batch, noise_std=0.1)
    assert out.shape == batch.shape
    for k, M in enumerate(mats):
        single = denoise_matrix(M, noise_std=0.1)
        torch.testing.assert_close(out.reshape(6, 24, 40)[k], single, rtol=1e-12, atol=1e-12)
    flat = out.reshape(6, 24, 40)
    assert all(not torch.equal(flat[k], mats[k]) for k in range(4))
    assert all(torch.equal(flat[k], mats[k]) for k in (4, 5))
    shrunk = optimal_shrinkage(batch, noise_std=0.1).reshape(6, 24, 40)
    for k, M in enumerate(mats):
        torch.testing.assert_close(shrunk[k], optimal_shrinkage(M, noise_std=0.1))


# ------------------------------------------------------------------------------------------------
# Randomized SVD


@pytest.mark.parametrize("rank", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_randomized_matches_exact_on_planted(rank: int, dtype: torch.dtype) -> None:
    # Kept triplets are converged to relative residual tol = 1e-4; on this matrix the output is
    # then within ~tol/2 of the exact one (DEFAULT_TOL comment), so 1e-4 is the bound asserted.
    case = planted_e5()
    G = torch.from_numpy(case["G"]).to(dtype)
    X = torch.from_numpy(case["X"]).to(dtype)
    exact = denoise_matrix(G, noise_std=0.5)
    gen = torch.Generator().manual_seed(0)
    rand = denoise_matrix(G, noise_std=0.5, svd="randomized", rank=rank, generator=gen)
    assert rel_err(rand, exact) < 1e-4
    assert rel_err(rand, X) == pytest.approx(1.526251, abs=2e-4)
    assert cosine(rand, X) == pytest.approx(0.874678, abs=1e-4)


def test_randomized_rank_doubles_until_below_edge() -> None:
    # Planted rank 3, edge 12: starting at rank 1, the rank-th Ritz value is above the edge at
    # ranks 1 and 2 (true values 25.7, 18.5), below at rank 4 (true 4th value 11.25).
    case = planted_e5()
    G = torch.from_numpy(case["G"]).unsqueeze(0)
    gen = torch.Generator().manual_seed(0)
    U, S, Vh, r = _randomized_svd(
        G, edge=12.0, rank=1, oversampling=10, tol=1e-4, max_iterations=32, generator=gen
    )
    assert r == 4
    assert U.shape == (1, 64, 14) and S.shape == (1, 14) and Vh.shape == (1, 14, 256)
    torch.testing.assert_close(S[0, :3], torch.linalg.svdvals(G[0])[:3], rtol=1e-6, atol=0)
    # Too wide a sketch for the matrix, or no convergence allowed: the exact SVD is used.
    assert (
        _randomized_svd(
            G, edge=12.0, rank=60, oversampling=10, tol=1e-4, max_iterations=32, generator=gen
        )[3]
        == 64
    )
    assert (
        _randomized_svd(
            G, edge=12.0, rank=4, oversampling=10, tol=1e-12, max_iterations=0, generator=gen
        )[3]
        == 64
    )


def test_randomized_on_larger_batch() -> None:
    # A batch of three 120 x 400 rank-5 planted matrices: randomized stays below the full rank
    # and matches the exact result to the tolerance.
    G = torch.stack([random_planted(120, 400, rank=5, sigma_e=0.05, seed=s) for s in range(3)])
    gen = torch.Generator().manual_seed(3)
    exact = denoise_matrix(G, noise_std=0.05)
    rand = denoise_matrix(G, noise_std=0.05, svd="randomized", rank=8, generator=gen)
    for k in range(3):
        assert rel_err(rand[k], exact[k]) < 1e-4
    _, _, _, r = _randomized_svd(
        G,
        edge=0.05 * (math.sqrt(120) + 20),
        rank=8,
        oversampling=10,
        tol=1e-4,
        max_iterations=32,
        generator=gen,
    )
    assert r == 8


# ------------------------------------------------------------------------------------------------
# Dtypes and degenerate inputs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_computed_in_float32(dtype: torch.dtype) -> None:
    G = random_planted(24, 40, rank=2, sigma_e=0.1, seed=2).to(dtype)
    out = denoise_matrix(G, noise_std=0.1)
    assert out.dtype == dtype
    assert torch.equal(out, denoise_matrix(G.float(), noise_std=0.1).to(dtype))


def test_zero_noise_is_identity_and_zero_matrix_unchanged() -> None:
    G = random_planted(24, 40, rank=2, sigma_e=0.1, seed=3)
    torch.testing.assert_close(denoise_matrix(G, noise_std=0.0), G, rtol=1e-12, atol=1e-12)
    Z = torch.zeros(5, 7, dtype=torch.float64)
    assert torch.equal(denoise_matrix(Z, noise_std=0.1), Z)
    assert torch.equal(optimal_shrinkage(Z, noise_std=0.1), Z)


# ------------------------------------------------------------------------------------------------
# Bad input


def test_kappa_below_one_raises_with_bulk_edge_explanation() -> None:
    G = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"kappa must be >= 1, got 0.99.*bulk edge"):
        denoise_matrix(G, noise_std=0.1, kappa=0.99)
    with pytest.raises(ValueError, match="kappa must be >= 1"):
        denoise_matrix(G, noise_std=0.1, kappa=float("nan"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_matrix_raises(bad: float) -> None:
    G = torch.randn(4, 6)
    G[1, 2] = bad
    with pytest.raises(ValueError, match="non-finite entries"):
        denoise_matrix(G, noise_std=0.1)
    with pytest.raises(ValueError, match="non-finite entries"):
        optimal_shrinkage(G, noise_std=0.1)


@pytest.mark.parametrize(
    ("kwargs", "error", "regex"),
    [
        pytest.param(
            {"noise_std": -0.1},
            ValueError,
            "noise_std must be finite and >= 0",
            id="negative_noise",
        ),
        pytest.param(
            {"noise_std": float("nan")}, ValueError, "noise_std must be finite", id="nan_noise"
        ),
        pytest.param(
            {"noise_std": float("inf")}, ValueError, "noise_std must be finite", id="inf_noise"
        ),
        pytest.param(
            {"noise_std": "a"}, TypeError, "noise_std must be a real number", id="str_noise"
        ),
        pytest.param(
            {"svd": "lanczos"},
            ValueError,
            r"svd must be one of \('exact', 'randomized'\)",
            id="unknown_svd",
        ),
        pytest.param({"rank": 0}, ValueError, "rank must be >= 1, got 0", id="zero_rank"),
        pytest.param({"rank": 2.0}, TypeError, "rank must be an int", id="float_rank"),
        pytest.param(
            {"oversampling": -1}, ValueError, "oversampling must be >= 0", id="neg_oversampling"
        ),
        pytest.param({"tol": 0.0}, ValueError, r"tol must be in \(0, 1\)", id="zero_tol"),
        pytest.param(
            {"max_iterations": -1}, ValueError, "max_iterations must be >= 0", id="neg_iterations"
        ),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, regex: str) -> None:
    args = {"noise_std": 0.1, **kwargs}
    with pytest.raises(error, match=regex):
        denoise_matrix(torch.randn(4, 6), **args)


def test_bad_matrices() -> None:
    with pytest.raises(ValueError, match=r"shape \(\.\.\., m, n\), got shape \(5,\)"):
        denoise_matrix(torch.randn(5), noise_std=0.1)
    with pytest.raises(TypeError, match="floating-point"):
        denoise_matrix(torch.ones(3, 4, dtype=torch.int64), noise_std=0.1)
    with pytest.raises(ValueError, match=r"beta must be in \(0, 1\]"):
        frobenius_shrinker(2.0, beta=1.5)
    with pytest.raises(ValueError, match="y must be finite and >= 0"):
        frobenius_shrinker(-1.0, beta=0.5)
