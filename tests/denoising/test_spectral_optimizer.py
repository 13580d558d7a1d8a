"""Tests of SpectralDenoiser and noise_std_from_optimizer on Opacus DP optimizers.

What is proved here: sigma_e is formed from public constants only
(docs/denoising.md#denoising-noise-level, docs/denoising.md#denoising-post-processing); the
denoiser touches exactly the 2-D gradients it should, keeps their Frobenius norm, equals the
functional form, and leaves the privacy accounting untouched.
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from opacus import PrivacyEngine
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc.denoising import SpectralDenoiser, denoise_matrix, noise_std_from_optimizer


def fake_optimizer(params: list[torch.Tensor], **overrides) -> SimpleNamespace:
    """An object with the public attributes an Opacus DPOptimizer exposes after scale_grad."""
    attrs = {
        "params": params,
        "noise_multiplier": 1.0,
        "max_grad_norm": 2.0,
        "expected_batch_size": 50,
        "accumulated_iterations": 1,
        "loss_reduction": "mean",
    }
    attrs.update(overrides)
    return SimpleNamespace(**attrs)


def planted_grad(rows: int, cols: int, sigma_e: float, seed: int, snr: float = 3.0) -> torch.Tensor:
    """Rank-2 signal well above the bulk edge plus N(0, sigma_e^2) noise, float32."""
    gen = torch.Generator().manual_seed(seed)
    m, n = min(rows, cols), max(rows, cols)
    U = torch.linalg.qr(torch.randn(rows, 2, generator=gen)).Q
    V = torch.linalg.qr(torch.randn(cols, 2, generator=gen)).Q
    theta = torch.tensor([snr, snr / 2]).clamp(min=1.5 * (m / n) ** 0.25) * sigma_e * n**0.5
    return (U * theta) @ V.T + sigma_e * torch.randn(rows, cols, generator=gen)


def param_with_grad(grad: torch.Tensor) -> nn.Parameter:
    p = nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    return p


# ------------------------------------------------------------------------------------------------
# sigma_e from public quantities (docs/denoising.md#denoising-noise-level)


def test_noise_std_mean_and_sum() -> None:
    # mean: sigma C / (B_exp * accumulated_iterations) = 1.3 * 2 / (50 * 2); sum: sigma C.
    opt = fake_optimizer([], noise_multiplier=1.3, accumulated_iterations=2)
    assert noise_std_from_optimizer(opt) == pytest.approx(1.3 * 2.0 / 100, rel=1e-15)
    opt = fake_optimizer([], noise_multiplier=1.3, loss_reduction="sum", expected_batch_size=None)
    assert noise_std_from_optimizer(opt) == pytest.approx(2.6, rel=1e-15)


def test_noise_std_adaptive_clipping_uses_the_noise_multiplier_of_add_noise() -> None:
    # DPOptimizerFastGradientClipping (adaptive): _adjusted_noise_multiplier. AdaClipDPOptimizer:
    # (sigma^-2 - (2 sigma_u)^-2)^(-1/2) (Andrew et al. 2021, Theorem 1), e.g. sigma = 1,
    # sigma_u = 1 gives (1 - 1/4)^(-1/2) = 2/sqrt(3).
    opt = fake_optimizer([], _adjusted_noise_multiplier=1.7)
    assert noise_std_from_optimizer(opt) == pytest.approx(1.7 * 2.0 / 50, rel=1e-15)
    opt = fake_optimizer([], unclipped_num_std=1.0)
    assert noise_std_from_optimizer(opt) == pytest.approx(2 / math.sqrt(3) * 2.0 / 50, rel=1e-14)


@pytest.mark.parametrize(
    ("overrides", "regex"),
    [
        pytest.param(
            {"loss_reduction": "none"}, "loss_reduction must be 'mean' or 'sum'", id="reduction"
        ),
        pytest.param(
            {"expected_batch_size": None}, "positive expected_batch_size, got None", id="no_batch"
        ),
        pytest.param(
            {"expected_batch_size": 0}, "positive expected_batch_size, got 0", id="zero_batch"
        ),
        pytest.param(
            {"accumulated_iterations": 0}, "accumulated_iterations must be positive", id="acc"
        ),
        pytest.param(
            {"noise_multiplier": float("nan")}, "noise_std must be finite", id="nan_sigma"
        ),
    ],
)
def test_noise_std_bad_optimizer(overrides: dict, regex: str) -> None:
    with pytest.raises(ValueError, match=regex):
        noise_std_from_optimizer(fake_optimizer([], **overrides))


def make_dp_optimizer(expected_batch_size: int = 8) -> tuple[GradSampleModule, DPOptimizer]:
    torch.manual_seed(0)
    model = GradSampleModule(nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 6)))
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        noise_multiplier=0.7,
        max_grad_norm=1.5,
        expected_batch_size=expected_batch_size,
        generator=torch.Generator().manual_seed(1),
    )
    return model, opt


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_sigma_e_ignores_realised_batch_size() -> None:
    # Poisson batches of realised size 3, 8 and 13 with the same expected size 8: sigma_e is
    # 0.7 * 1.5 / 8 every time, read inside the step hook where the realised batch is visible
    # through p.grad_sample.
    model, opt = make_dp_optimizer(expected_batch_size=8)
    denoiser = SpectralDenoiser()
    seen: list[tuple[int, float]] = []

    def hook(optimizer: DPOptimizer) -> None:
        denoiser(optimizer)
        seen.append((len(optimizer.grad_samples[0]), denoiser.last_report.noise_std))

    opt.attach_step_hook(hook)
    for batch in (3, 8, 13):
        x, y = torch.randn(batch, 12), torch.randint(0, 6, (batch,))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert [b for b, _ in seen] == [3, 8, 13]
    assert [s for _, s in seen] == [pytest.approx(0.7 * 1.5 / 8, rel=1e-15)] * 3


def test_denoiser_output_does_not_depend_on_per_sample_data() -> None:
    # Same released p.grad, different (realised size, content) of p.grad_sample: identical output.
    outputs = []
    for batch, seed in ((2, 0), (31, 1)):
        _, opt = make_dp_optimizer(expected_batch_size=8)
        gen = torch.Generator().manual_seed(seed)
        for k, p in enumerate(opt.params):
            p.grad_sample = torch.randn(batch, *p.shape, generator=gen)
            p.grad = (
                planted_grad(*p.shape, sigma_e=0.7 * 1.5 / 8, seed=k)
                if p.dim() == 2
                else (torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
            )
        SpectralDenoiser()(opt)
        outputs.append([p.grad.clone() for p in opt.params])
    for a, b in zip(*outputs):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# Which gradients are touched


def test_denoiser_equals_functional_form_and_batches_by_shape() -> None:
    # Two 24 x 40 gradients (one batched SVD), one 40 x 24 and one pure-noise 24 x 40 (left
    # alone by the threshold rule), all float32.
    sigma_e = 2.0 * 1.0 / 50
    grads = [
        planted_grad(24, 40, sigma_e, seed=0),
        planted_grad(24, 40, sigma_e, seed=1),
        planted_grad(40, 24, sigma_e, seed=2),
        sigma_e * torch.randn(24, 40, generator=torch.Generator().manual_seed(3)),
    ]
    params = [param_with_grad(g) for g in grads]
    denoiser = SpectralDenoiser()
    denoiser(fake_optimizer(params))
    for g, p in zip(grads, params):
        torch.testing.assert_close(
            p.grad, denoise_matrix(g, noise_std=sigma_e), rtol=1e-5, atol=1e-6
        )
    report = denoiser.last_report
    assert report.noise_std == pytest.approx(sigma_e)
    assert [r.status for r in report.records] == ["denoised"] * 3 + ["below_threshold"]
    assert torch.equal(params[3].grad, grads[3])
    threshold = 1.05 * sigma_e * (24**0.5 + 40**0.5)
    assert all(r.threshold == pytest.approx(threshold) for r in report.records)
    # Both planted directions survive (a noise value just above the edge may too) and the exact
    # SVD computes all 24 triplets.
    assert report.records[0].kept_rank >= 2
    assert report.records[0].svd_rank == 24
    assert report.num_denoised == 3


def test_skips_1d_tiny_and_non_matrix_grads_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    sigma_e = 2.0 / 50
    grads = {
        "weight": planted_grad(16, 32, sigma_e, seed=0),
        "bias": torch.randn(16),
        "head": torch.randn(1, 32),  # min dimension 1: shrink + norm correction is the identity
        "lora_a": planted_grad(4, 32, sigma_e, seed=1),  # min dimension 4 < min_dim = 8
        "conv": torch.randn(8, 3, 5),
    }
    params = {k: param_with_grad(g) for k, g in grads.items()}
    frozen = nn.Parameter(torch.zeros(16, 16))  # grad None
    opt = fake_optimizer([*params.values(), frozen])
    denoiser = SpectralDenoiser(min_dim=8)
    with caplog.at_level(logging.INFO, logger="opacus_rc.denoising.opacus_adapter"):
        denoiser(opt)
        denoiser(opt)
    statuses = [r.status for r in denoiser.last_report.records]
    assert statuses == [
        "denoised",
        "skipped_not_2d",
        "skipped_min_dim",
        "skipped_min_dim",
        "skipped_not_2d",
        "no_grad",
    ]
    for name in ("bias", "head", "lora_a", "conv"):
        assert torch.equal(params[name].grad, grads[name]), name
    assert not torch.equal(params["weight"].grad, grads["weight"])
    untouched = [r for r in caplog.records if "untouched by rule" in r.getMessage()]
    assert len(untouched) == 1
    assert "(1, 32) (skipped_min_dim)" in untouched[0].getMessage()
    # With the default min_dim = 2 the 4 x 32 LoRA factor is denoised.
    params["lora_a"].grad = grads["lora_a"].clone()
    SpectralDenoiser()(opt)
    assert not torch.equal(params["lora_a"].grad, grads["lora_a"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_grads_keep_their_dtype(dtype: torch.dtype) -> None:
    sigma_e = 2.0 / 50
    g = planted_grad(24, 40, sigma_e, seed=0).to(dtype)
    p = param_with_grad(g)
    SpectralDenoiser()(fake_optimizer([p]))
    assert p.grad.dtype == dtype
    assert torch.equal(p.grad, denoise_matrix(g.float(), noise_std=sigma_e).to(dtype))


# ------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_grad_raises(bad: float) -> None:
    grads = [planted_grad(24, 40, 0.04, seed=0), planted_grad(24, 40, 0.04, seed=1)]
    grads[1][3, 4] = bad
    params = [param_with_grad(g) for g in grads]
    with pytest.raises(
        ValueError, match=r"non-finite gradient .* index\(es\) \[1\] of shape \(24, 40\)"
    ):
        SpectralDenoiser()(fake_optimizer(params))
    assert torch.equal(params[0].grad, grads[0])  # nothing written before raising


def test_distributed_optimizer_refused() -> None:
    p = param_with_grad(planted_grad(24, 40, 0.04, seed=0))
    with pytest.raises(NotImplementedError, match="world_size=2.*not post-processing"):
        SpectralDenoiser()(fake_optimizer([p], world_size=2))


@pytest.mark.parametrize(
    ("kwargs", "error", "regex"),
    [
        pytest.param(
            {"kappa": 0.5}, ValueError, r"kappa must be >= 1, got 0.5.*bulk edge", id="kappa"
        ),
        pytest.param({"min_dim": 0}, ValueError, "min_dim must be >= 1", id="min_dim"),
        pytest.param({"svd": "truncated"}, ValueError, "svd must be one of", id="svd"),
        pytest.param({"tol": 1.0}, ValueError, r"tol must be in \(0, 1\)", id="tol"),
        pytest.param({"rank": 0}, ValueError, "rank must be >= 1", id="rank"),
    ],
)
def test_bad_constructor_arguments(kwargs: dict, error: type, regex: str) -> None:
    with pytest.raises(error, match=regex):
        SpectralDenoiser(**kwargs)


def test_arguments_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        SpectralDenoiser(1.05)  # type: ignore[misc]
    with pytest.raises(TypeError):
        denoise_matrix(torch.randn(3, 4), 0.1)  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------
# End to end with opacus.PrivacyEngine


def train(denoise: bool) -> dict:
    """Three DP-SGD steps (hooks mode, PRV accountant) on a tiny model, fixed seeds."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 4))
    data = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    engine = PrivacyEngine(accountant="prv")
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data, batch_size=32),
        noise_multiplier=0.5,
        max_grad_norm=1.0,
        grad_sample_mode="hooks",
        noise_generator=torch.Generator().manual_seed(1),
    )
    denoiser = SpectralDenoiser()
    accountant_hook = optimizer.step_hook
    log: list[dict] = []

    def hook(opt: DPOptimizer) -> None:  # what attach_post_processing_hook will do
        before = [p.grad.clone() for p in opt.params]
        if denoise:
            denoiser(opt)
        log.append({"before": before, "after": [p.grad.clone() for p in opt.params]})
        accountant_hook(opt)

    optimizer.attach_step_hook(hook)
    for step, (x, y) in enumerate(loader):
        if step == 3:
            break
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "log": log,
        "params": [p.detach().clone() for p in model.parameters()],
        "history": list(engine.accountant.history),
        "epsilon": engine.get_epsilon(delta=1e-5),
        "report": denoiser.last_report,
        "noise_std": 0.5 * 1.0 / optimizer.expected_batch_size,
    }


@pytest.mark.filterwarnings("ignore:Full backward hook is firing", "ignore:Secure RNG turned off")
def test_end_to_end_opacus_privacy_engine() -> None:
    with_denoiser, without = train(True), train(False)
    assert len(with_denoiser["log"]) == 3
    for entry in with_denoiser["log"]:
        n_changed = 0
        for before, after in zip(entry["before"], entry["after"]):
            if before.dim() != 2:
                assert torch.equal(before, after)  # biases and LayerNorm untouched, bit for bit
                continue
            expected = denoise_matrix(before, noise_std=with_denoiser["noise_std"])
            torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(
                torch.linalg.matrix_norm(after), torch.linalg.matrix_norm(before), rtol=1e-5, atol=0
            )
            n_changed += not torch.equal(before, after)
        assert n_changed >= 1  # the signal is above the threshold, so the check is not vacuous
    assert with_denoiser["report"].noise_std == pytest.approx(0.5 / 32, rel=1e-15)
    # The first step saw identical noisy gradients in both runs (same seeds): the denoiser only
    # post-processes what Opacus released.
    for a, b in zip(with_denoiser["log"][0]["before"], without["log"][0]["before"]):
        assert torch.equal(a, b)
    # Post-processing: same accountant history and the same epsilon, different parameters.
    assert with_denoiser["history"] == without["history"]
    assert with_denoiser["epsilon"] == without["epsilon"]
    assert any(not torch.equal(a, b) for a, b in zip(with_denoiser["params"], without["params"]))
