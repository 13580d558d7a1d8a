"""``PrivacyEngine.make_private(denoise="spectral", ...)``: wiring, accounting, validation.

What is proved here:

* for every clipping mode (Opacus flat, per-layer, adaptive and ghost through the engine, and
  randomized clipping with both grad-sample modes), a step with ``denoise="spectral"`` releases,
  for every 2-D gradient, exactly ``denoise_matrix(noisy, sigma_e)`` of the noisy gradient the
  same step releases without denoising, with ``sigma_e`` computed here from the test's own
  numbers (docs/denoising.md#denoising-noise-level); the Frobenius norm is kept, the values change;
  1-D gradients are bit-identical;
* the accountant sees the same steps: epsilon with and without denoising is identical;
* every invalid option raises before a hook is attached (and none is left behind), including a
  failure detected after Opacus attached its hooks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from opacus.data_loader import DPDataLoader
from opacus.optimizers import (
    AdaClipDPOptimizer,
    DPOptimizer,
    DPOptimizerFastGradientClipping,
    DPPerLayerOptimizer,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc import PrivacyEngine, attach_post_processing_hook
from opacus_rc.denoising import DEFAULT_KAPPA, SpectralDenoiser, denoise_matrix
from opacus_rc.optimizers import RandomizedClipOptimizer

pytestmark = [
    pytest.mark.filterwarnings("ignore:a sketch_generator was passed"),
    pytest.mark.filterwarnings("ignore:Using a non-full backward hook"),
    pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha"),
]

VOCAB, EMB, HIDDEN, CLASSES, SEQ = 8, 16, 32, 3, 5
N, BATCH = 64, 16  # expected batch size N / (N / BATCH) = 16
SIGMA, CLIP = 0.02, 1.0


class SmallTransformer(nn.Module):
    """Embedding (2-D), Linear with bias (2-D + 1-D), LayerNorm (1-D), Linear head (2-D)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMB)
        self.up = nn.Linear(EMB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.up(self.emb(x))))
        return self.head(h.mean(1))


def data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (N, SEQ), generator=g)
    y = x[:, 0] % CLASSES  # learnable: the class is a function of the first token
    return TensorDataset(x, y)


#: (id, make_private overrides, expected optimizer type, combined clip norm C)
MODES = [
    pytest.param({"clipping": "flat"}, DPOptimizer, CLIP, id="flat"),
    pytest.param(
        {"clipping": "per_layer", "max_grad_norm": [0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]},
        DPPerLayerOptimizer,
        # Opacus noises per-layer clipping with the norm of the per-layer bounds.
        math.sqrt(sum(c * c for c in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0))),
        id="per_layer",
    ),
    pytest.param(
        {
            "clipping": "adaptive",
            "target_unclipped_quantile": 0.5,
            "clipbound_learning_rate": 0.2,
            "max_clipbound": 10.0,
            "min_clipbound": 0.1,
            "unclipped_num_std": 1.0,
        },
        AdaClipDPOptimizer,
        CLIP,
        id="adaptive",
    ),
    pytest.param(
        {"clipping": "flat", "grad_sample_mode": "ghost"},
        DPOptimizerFastGradientClipping,
        CLIP,
        id="ghost",
    ),
    pytest.param({"clipping": "randomized"}, RandomizedClipOptimizer, CLIP, id="randomized"),
    pytest.param(
        {"clipping": "randomized", "grad_sample_mode": "ghost"},
        RandomizedClipOptimizer,
        CLIP,
        id="randomized_ghost",
    ),
]


def noise_multiplier_of_add_noise(optimizer: Any) -> float:
    """The multiplier Opacus draws the noise with (adaptive clipping inflates it)."""
    if isinstance(optimizer, AdaClipDPOptimizer):
        # Andrew et al. 2021, Theorem 1, as in Opacus' AdaClipDPOptimizer.add_noise.
        return (SIGMA**-2 - (2 * optimizer.unclipped_num_std) ** -2) ** -0.5
    return SIGMA


def one_step(overrides: dict[str, Any], *, denoise: bool, kappa: float = DEFAULT_KAPPA) -> dict:
    """Build a fresh model and engine, take one step on a fixed batch, return what was released.

    The model, noise, sketch and batch are seeded identically for ``denoise`` True and False,
    so the noisy gradients before post-processing are the same.
    """
    torch.manual_seed(0)
    model = SmallTransformer()
    engine = PrivacyEngine()
    args: dict[str, Any] = {
        "module": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "data_loader": DataLoader(data(), batch_size=BATCH),
        "criterion": nn.CrossEntropyLoss(),
        "noise_multiplier": SIGMA,
        "max_grad_norm": CLIP,
        "noise_generator": torch.Generator().manual_seed(7),
        **overrides,
    }
    if args["clipping"] == "randomized":
        args["sketch_generator"] = torch.Generator().manual_seed(8)
        args["sketch_dim"] = 16
    if denoise:
        args.update(denoise="spectral", denoise_kappa=kappa)
    out = engine.make_private(**args)
    module, optimizer = out[0], out[1]
    criterion = out[2] if len(out) == 4 else args["criterion"]
    released: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in model.named_parameters()}

    def record(opt: Any) -> None:  # runs after the denoiser, before the accountant
        released.update({names[id(p)]: p.grad.detach().clone() for p in opt.params})

    attach_post_processing_hook(optimizer, record)
    x, y = data(1).tensors
    criterion(module(x[:BATCH]), y[:BATCH]).backward()
    optimizer.step()
    optimizer.zero_grad()
    module.cleanup() if hasattr(module, "cleanup") else None
    return {"engine": engine, "optimizer": optimizer, "released": released}


@pytest.mark.parametrize(("overrides", "optimizer_type", "combined_clip"), MODES)
def test_each_clipping_mode_denoises_exactly_the_2d_gradients(
    overrides: dict, optimizer_type: type, combined_clip: float
) -> None:
    plain = one_step(overrides, denoise=False)
    den = one_step(overrides, denoise=True)
    assert type(den["optimizer"]) is optimizer_type
    denoiser = den["engine"].denoiser
    assert isinstance(denoiser, SpectralDenoiser) and denoiser.kappa == DEFAULT_KAPPA
    assert plain["engine"].denoiser is None
    # sigma_e of docs/denoising.md#denoising-noise-level from the test's own constants: sigma * C /
    # expected batch size (rel 1e-6: Opacus forms the per-layer combined norm in float32).
    sigma_e = noise_multiplier_of_add_noise(den["optimizer"]) * combined_clip / BATCH
    assert denoiser.last_report.noise_std == pytest.approx(sigma_e, rel=1e-6)

    statuses = {}
    for name, noisy in plain["released"].items():
        out = den["released"][name]
        if noisy.dim() != 2:
            assert torch.equal(out, noisy), name  # biases and LayerNorm: untouched
            continue
        expected = denoise_matrix(noisy, noise_std=sigma_e, kappa=DEFAULT_KAPPA)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-7)
        assert out.norm().item() == pytest.approx(noisy.norm().item(), rel=1e-5)  # norm kept
        statuses[name] = (out - noisy).abs().max().item()
    # At sigma = 0.02 every 2-D gradient's top singular value is 1.7-13x the threshold
    # kappa * sigma_e * (sqrt(m) + sqrt(n)) (measured), so each one was changed, by more than a
    # tenth of the noise level (the shrinker removes the noise bulk, entries of size ~sigma_e).
    assert set(statuses) == {"emb.weight", "up.weight", "head.weight"}
    assert all(change > 0.1 * sigma_e for change in statuses.values()), (sigma_e, statuses)
    by_status = {r.status for r in denoiser.last_report.records if len(r.shape) == 2}
    assert by_status == {"denoised"}


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"clipping": "flat"}, id="flat"),
        pytest.param({"clipping": "randomized"}, id="randomized"),
    ],
)
def test_epsilon_is_identical_with_and_without_denoising(overrides: dict) -> None:
    epsilons = []
    for denoise in (False, True):
        torch.manual_seed(0)
        model = SmallTransformer()
        engine = PrivacyEngine()
        extra = {"denoise": "spectral"} if denoise else {}
        out = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data(), batch_size=BATCH),
            criterion=nn.CrossEntropyLoss(),
            noise_multiplier=1.0,
            max_grad_norm=CLIP,
            **overrides,
            **extra,
        )
        module, optimizer = out[0], out[1]
        criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
        x, y = data(1).tensors
        for step in range(3):
            rows = slice(step * BATCH, (step + 1) * BATCH)
            criterion(module(x[rows]), y[rows]).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert len(engine.accountant) == 3  # every step reached the accountant
        assert (engine.denoiser is not None) == denoise
        epsilons.append(engine.get_epsilon(delta=1e-5))
    assert epsilons[0] > 0 and epsilons[1] == epsilons[0]


@pytest.mark.parametrize("clipping", ["flat", "randomized"])
def test_make_private_with_epsilon_attaches_the_denoiser(clipping: str) -> None:
    torch.manual_seed(0)
    model = SmallTransformer()
    engine = PrivacyEngine()
    out = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data(), batch_size=BATCH),
        criterion=nn.CrossEntropyLoss(),
        target_epsilon=8.0,
        target_delta=1e-5,
        epochs=1,
        max_grad_norm=CLIP,
        clipping=clipping,
        denoise="spectral",
        denoise_kappa=1.5,
    )
    module, optimizer = out[0], out[1]
    criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    x, y = data(1).tensors
    criterion(module(x[:BATCH]), y[:BATCH]).backward()
    optimizer.step()
    report = engine.denoiser.last_report
    assert engine.denoiser.kappa == 1.5
    assert report is not None and len(report.records) == len(list(model.parameters()))
    sigma = optimizer.noise_multiplier
    assert report.noise_std == pytest.approx(sigma * CLIP / BATCH, rel=1e-12)
    assert len(engine.accountant) == 1


class FakeDDP(DistributedDataParallel):
    """Passes ``isinstance(m, DistributedDataParallel)`` without a process group."""

    def __init__(self, module: nn.Module) -> None:
        nn.Module.__init__(self)
        self.module = module

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


BAD = [
    pytest.param(
        {"denoise": "wiener"},
        ValueError,
        r"^denoise must be one of \('spectral',\), got 'wiener'$",
        id="name",
    ),
    pytest.param(
        {"denoise": "spectral", "denoise_kappa": 0.9},
        ValueError,
        r"kappa must be >= 1, got 0.9. kappa = 1 puts the threshold at the bulk edge",
        id="kappa",
    ),
    pytest.param(
        {"denoise_kappa": 1.2}, ValueError, "only apply with a denoiser", id="kappa_alone"
    ),
    pytest.param(
        {"denoise_options": {"svd": "exact"}},
        ValueError,
        "only apply with a denoiser",
        id="options_alone",
    ),
    pytest.param(
        {"denoise": "spectral", "denoise_options": {"kapa": 1.2}},
        TypeError,
        "unexpected keyword argument 'kapa'",
        id="option_name",
    ),
    pytest.param(
        {"denoise": "spectral", "denoise_options": {"kappa": 1.2}},
        ValueError,
        "pass kappa as denoise_kappa",
        id="kappa_in_options",
    ),
    pytest.param(
        {"denoise": "spectral", "denoise_options": {"svd": "lanczos"}},
        ValueError,
        r"svd must be one of \('exact', 'randomized'\)",
        id="svd",
    ),
    pytest.param(
        {"denoise": "spectral", "grad_sample_mode": "ghost_fsdp"},
        NotImplementedError,
        "does not support distributed training",
        id="fsdp_mode",
    ),
    pytest.param(
        {"check_lora_update": True}, ValueError, "no trainable peft LoRA adapter", id="no_lora"
    ),
]


@pytest.mark.parametrize("clipping", ["flat", "randomized"])
@pytest.mark.parametrize(("override", "error", "match"), BAD)
def test_bad_denoise_options_raise_before_any_hook(
    assert_no_hooks: Callable, clipping: str, override: dict, error: type, match: str
) -> None:
    model = SmallTransformer()
    engine = PrivacyEngine()
    with pytest.raises(error, match=match):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data(), batch_size=BATCH),
            noise_multiplier=1.0,
            max_grad_norm=CLIP,
            clipping=clipping,
            **override,
        )
    assert_no_hooks(model)
    assert engine.dataset is None and len(engine.accountant) == 0 and engine.denoiser is None


def test_distributed_model_is_refused_up_front(assert_no_hooks: Callable) -> None:
    inner = SmallTransformer()
    engine = PrivacyEngine()
    with pytest.raises(NotImplementedError, match="denoise='spectral' does not support distrib"):
        engine.make_private(
            module=FakeDDP(inner),
            optimizer=torch.optim.SGD(inner.parameters(), lr=0.1),
            data_loader=DataLoader(data(), batch_size=BATCH),
            noise_multiplier=1.0,
            max_grad_norm=CLIP,
            denoise="spectral",
        )
    assert_no_hooks(inner)


def test_make_private_with_epsilon_validates_before_the_noise_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import opacus_rc.accountants as accountants

    def no_search(*args: Any, **kwargs: Any) -> float:
        raise AssertionError("the noise search ran before the denoise options were validated")

    monkeypatch.setattr(accountants, "get_noise_multiplier", no_search)
    model = SmallTransformer()
    with pytest.raises(ValueError, match=r"denoise must be one of \('spectral',\), got 'svd'"):
        PrivacyEngine().make_private_with_epsilon(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data(), batch_size=BATCH),
            target_epsilon=3.0,
            target_delta=1e-5,
            epochs=1,
            max_grad_norm=CLIP,
            clipping="randomized",
            denoise="svd",
        )


@pytest.mark.parametrize("clipping", ["flat", "randomized"])
def test_unusable_noise_level_fails_in_make_private_and_cleans_up(
    assert_no_hooks: Callable, clipping: str
) -> None:
    """An Opacus DPDataLoader at q = 0.01 over a public dataset_size of 49 records: its
    divisor is int(49 * 0.01) = 0, so sigma_e = sigma C / 0 cannot be formed (and the noisy sum
    would be divided by 0). It is refused in make_private (by the schedule's divisor check, before
    the denoiser's own check of the same), not at the first step; no hook stays. (A plain loader of
    batch size 1 over 49 records used to give int(49 * (1/49)) = 0 as well; its divisor is now its
    batch size, 1: docs/privacy/mechanism.md#mechanism-public.)"""
    assert int(49 * 0.01) == 0
    model = SmallTransformer()
    engine = PrivacyEngine()
    x, y = data().tensors
    with pytest.raises(ValueError, match=r"expected batch size, int\(dataset_size=49 .*is 0"):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DPDataLoader(TensorDataset(x[:49], y[:49]), sample_rate=0.01),
            noise_multiplier=1.0,
            max_grad_norm=CLIP,
            clipping=clipping,
            denoise="spectral",
            dataset_size=49,
        )
    assert_no_hooks(model)
    assert engine.dataset is None and engine.denoiser is None


def test_engine_attributes_follow_the_last_make_private() -> None:
    engine = PrivacyEngine()
    dataset = data()
    for denoise, expected in (("spectral", SpectralDenoiser), (None, type(None))):
        model = SmallTransformer()
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(dataset, batch_size=BATCH),
            noise_multiplier=1.0,
            max_grad_norm=CLIP,
            denoise=denoise,
        )[0].cleanup()
        assert isinstance(engine.denoiser, expected)
        assert engine.lora_update_guard is None
