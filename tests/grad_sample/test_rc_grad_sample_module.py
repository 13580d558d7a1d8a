"""GradSampleModuleRandomizedClipping / GradSampleHooksRandomizedClipping behaviour."""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from opacus.optimizers import DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_rc.sketching as sketching
from opacus_rc.grad_sample import (
    GradSampleHooksRandomizedClipping,
    GradSampleModuleRandomizedClipping,
)
from opacus_rc.optimizers import DPLossRandomizedClipping, RandomizedClipOptimizer
from opacus_rc.privacy_engine import PrivacyEngine
from opacus_rc.sketching import SketchSpec, hutchinson_sqnorm
from tests import flat_mlp, float64_oracle, private_mlp

pytestmark = pytest.mark.filterwarnings("ignore:a sketch_generator was passed")

VOCAB, EMB, HID, CLASSES, SEQ = 11, 6, 6, 3, 5


class TinySeqModel(nn.Module):
    """Embedding -> Linear -> LayerNorm -> Linear (same width, comparable probes) -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMB)
        self.lin1 = nn.Linear(EMB, HID)
        self.norm = nn.LayerNorm(HID)
        self.lin2 = nn.Linear(HID, HID)
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin2(torch.tanh(self.norm(self.lin1(self.emb(x)))))
        return self.head(h.mean(1))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def one_backward(gsm: Any, model_out: Callable[[], torch.Tensor], y: torch.Tensor) -> Any:
    """Run the DP two-pass loss once (sigma = 0) and return the optimizer."""
    opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(gsm.parameters() if isinstance(gsm, nn.Module) else [], lr=0.1),
        noise_multiplier=0.0,
        max_grad_norm=gsm.max_grad_norm,
        expected_batch_size=max(len(y), 1),
    )
    crit = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss())
    crit(model_out(), y).backward()
    return opt


def test_spec_generator_and_warning() -> None:
    model = TinySeqModel()
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0)
    assert gsm.sketch_spec == SketchSpec("hutchinson", 32, None, per_sample=True, secret=True)
    assert isinstance(gsm.sketch_generator, torch.Generator)
    gsm.cleanup()
    g = gen(0)
    with pytest.warns(UserWarning, match="seed stays secret"):
        gsm = GradSampleModuleRandomizedClipping(
            model, max_grad_norm=1.0, sketch="hutch++", sketch_dim=16, sketch_generator=g
        )
    assert gsm.sketch_spec == SketchSpec("hutch++", 16, 16, per_sample=True, secret=False)
    assert gsm.sketch_generator is g
    gsm.cleanup()
    gsm = GradSampleModuleRandomizedClipping(
        model, max_grad_norm=1.0, sketch="hutch++", sketch_dim=8, sketch_head_dim=4
    )
    assert gsm.sketch_spec.head_dim == 4 and gsm.sketch_spec.accounted_dim == 8
    gsm.cleanup()


def test_os_seeded_generators_differ() -> None:
    seeds = {
        GradSampleModuleRandomizedClipping(
            nn.Linear(2, 2), max_grad_norm=1.0
        ).sketch_generator.initial_seed()
        for _ in range(3)
    }
    assert len(seeds) == 3


def test_probes_fresh_per_sample_layer_and_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Intercept every probe draw (the single draw function) and check, from the outside:

    * each draw has one independent sketch per sample (no two samples share one);
    * the two same-shape sketched layers and the two steps never reuse a sketch;
    * the intercepted probes are the ones used: recomputing lin2's norm from its captured
      activations/gradients with them reproduces the module's value;
    * torch's global RNG is untouched (the sketch never uses the data or noise generator).
    """
    draws: list[torch.Tensor] = []
    original = sketching.draw_gaussian_probes

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(*args, **kwargs)
        draws.append(out.clone())
        return out

    monkeypatch.setattr(sketching, "draw_gaussian_probes", recording)
    torch.manual_seed(0)
    model = TinySeqModel()
    captured: dict[str, torch.Tensor] = {}

    def save_input(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        captured["A"] = inputs[0].detach()

    def save_grad(module: nn.Module, grad_in: tuple, grad_out: tuple) -> None:
        captured.setdefault("G", grad_out[0].detach())

    model.lin2.register_forward_hook(save_input)
    model.lin2.register_full_backward_hook(save_grad)
    gsm = GradSampleModuleRandomizedClipping(
        model, max_grad_norm=1.0, sketch_dim=4, loss_reduction="sum"
    )
    B = 4
    per_step: list[list[torch.Tensor]] = []
    for step in range(2):
        x = torch.randint(0, VOCAB, (B, SEQ), generator=gen(step))
        y = torch.randint(0, CLASSES, (B,), generator=gen(10 + step))
        captured.clear()
        draws.clear()
        rng_state = torch.get_rng_state()
        F.cross_entropy(gsm(x), y, reduction="sum").backward()  # first pass of the DP loss
        w2 = gsm.norm_samples["lin2.weight"].clone()
        gsm.get_clipping_coef()
        assert torch.equal(torch.get_rng_state(), rng_state)
        # Backward order: lin2 then lin1 (p = d = 6: output side). The head sees a pooled
        # rank-2 input and uses the exact rank-one formula: no draw.
        assert [tuple(d.shape) for d in draws] == [(B, HID, 4), (B, HID, 4)]
        for d in draws:
            flat = d.flatten(1)
            assert torch.cdist(flat, flat).add(torch.eye(B)).min() > 0  # samples differ
        assert not torch.equal(draws[0], draws[1])  # lin2 vs lin1, same shape
        per_step.append(draws.copy())
        # The recorded lin2 probes reproduce lin2's norm from its own A and G.
        A, G = captured["A"], captured["G"]
        ref = hutchinson_sqnorm(A, G, sketch_dim=4, probes=draws[0]).sqrt()
        torch.testing.assert_close(w2, ref, rtol=1e-5, atol=1e-7)
        gsm.zero_grad()
    for a, b in zip(per_step[0], per_step[1]):
        assert not torch.equal(a, b)  # fresh every step


def test_nan_estimate_raises_and_recovers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, sketch_dim=4)
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    y = torch.tensor([0, 1, 2])
    with pytest.raises(
        FloatingPointError, match=r"1 of 3 per-sample gradient norm estimates are NaN or inf"
    ):
        one_backward(gsm, lambda: gsm(x), y)
    x[1, 2] = 0.0
    one_backward(gsm, lambda: gsm(x), y)  # the next, clean step works
    assert torch.isfinite(gsm.per_sample_gradient_norms).all()


def test_inf_loss_raises() -> None:
    model = nn.Linear(4, 3)
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, sketch_dim=4)
    x = torch.randn(2, 4)
    x[0] = float("inf")
    with pytest.raises(FloatingPointError, match="NaN or inf"):
        one_backward(gsm, lambda: gsm(x), torch.tensor([0, 1]))


class Reuses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.tanh(self.block(x)))


def test_reused_module_raises_naming_it() -> None:
    gsm = GradSampleModuleRandomizedClipping(Reuses(), max_grad_norm=1.0, sketch_dim=4)
    with pytest.raises(
        NotImplementedError, match=r"module 'block\.0' \(Linear\) ran more than once"
    ):
        gsm(torch.randn(2, 4))
    # State was reset: a forward under no_grad leaves nothing behind and does not raise.
    with torch.no_grad():
        gsm(torch.randn(2, 4))


def test_reused_embedding_raises_naming_it() -> None:
    class EmbTwice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.emb(x) + self.emb(x)

    gsm = GradSampleModuleRandomizedClipping(EmbTwice(), max_grad_norm=1.0)
    with pytest.raises(NotImplementedError, match=r"module 'emb' \(Embedding\)"):
        gsm(torch.tensor([[1, 2]]))


def test_tied_parameters_raise_at_construction(assert_no_hooks: Callable) -> None:
    # An embedding tied to an LM head is supported (tests/grad_sample/test_tied.py); a weight
    # shared by two nn.Linear layers is not.
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 4)
            self.out = nn.Linear(4, 4, bias=False)
            self.out.weight = self.inp.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.inp(x))

    model = Tied()
    with pytest.raises(
        NotImplementedError, match=r"tied between modules 'inp' \(Linear\), 'out' \(Linear\)"
    ):
        GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0)
    assert_no_hooks(model)
    model.inp.weight.requires_grad_(False)  # a frozen shared weight is fine
    GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0).cleanup()


def test_eval_mode_rejected(assert_no_hooks: Callable) -> None:
    model = TinySeqModel().eval()
    with pytest.raises(ValueError, match=r"eval mode.*call model\.train\(\)"):
        GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"eval mode.*call model\.train\(\)"):
        GradSampleHooksRandomizedClipping(model, max_grad_norm=1.0)
    assert_no_hooks(model)
    model.train()
    model.norm.eval()
    with pytest.raises(
        ValueError, match=r"submodules with trainable parameters are in eval mode: \['norm'\]"
    ):
        GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0)
    assert_no_hooks(model)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"sketch": "gauss"},
            ValueError,
            r"sketch must be one of \('hutchinson', 'hutch\+\+'\), got 'gauss'",
        ),
        ({"sketch_dim": 0}, ValueError, "sketch_dim must be >= 1"),
        (
            {"sketch_head_dim": 4},
            ValueError,
            "sketch_head_dim is only used by sketch='hutch\\+\\+'",
        ),
        ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm must be a finite number > 0"),
        ({"max_grad_norm": [1.0, 2.0]}, TypeError, "one float max_grad_norm"),
        ({"loss_reduction": "none"}, ValueError, "loss_reduction must be 'mean' or 'sum'"),
        (
            {"secure_mode": True, "sketch_generator": torch.Generator()},
            ValueError,
            "prohibited with secure_mode",
        ),
        ({"sketch_generator": 3}, TypeError, "sketch_generator must be a torch.Generator"),
    ],
)
def test_bad_arguments_raise_before_hooks(
    kwargs: dict, error: type, match: str, assert_no_hooks: Callable
) -> None:
    model = TinySeqModel()
    args = {"max_grad_norm": 1.0, **kwargs}
    with pytest.raises(error, match=match):
        GradSampleModuleRandomizedClipping(model, **args)
    assert_no_hooks(model)


def test_parameter_used_outside_its_module_raises() -> None:
    """A trainable weight used through F.linear outside its module's forward gets a gradient
    but no per-sample norm: refuse to produce clip factors instead of leaving it unclipped."""

    class Bypass(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.side = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + F.linear(x, self.side.weight)

    gsm = GradSampleModuleRandomizedClipping(Bypass(), max_grad_norm=1.0, sketch_dim=4)
    x = torch.randn(2, 4)
    with pytest.raises(
        RuntimeError, match=r"\['side\.weight'\] received a gradient but no per-sample norm"
    ):
        one_backward(gsm, lambda: gsm(x), torch.tensor([0, 1]))


def test_norms_of_unused_modules_are_not_stale(microbatch_norms: Callable) -> None:
    """Step 1 uses both branches; step 2 only one. Step 2's norms must not contain step 1's."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 3)
            self.b = nn.Linear(4, 3)
            self.use_b = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) + (self.b(x) if self.use_b else 0)

    torch.manual_seed(0)
    model = Branchy()
    reference = copy.deepcopy(model)  # before hooks; no optimizer step is taken below
    reference.use_b = False
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1e6, sketch_dim=4)
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 2])
    one_backward(gsm, lambda: gsm(x), y)
    model.use_b = False
    one_backward(gsm, lambda: gsm(x), y)
    ce = nn.CrossEntropyLoss()
    rows = [torch.tensor([int(v)]) for v in y]
    it = iter(rows)
    # Rank-2 inputs: exact norms; only module a contributes.
    oracle = microbatch_norms(reference, x, lambda out: ce(out, next(it)))
    torch.testing.assert_close(
        gsm.per_sample_gradient_norms, oracle["__total__"], rtol=1e-5, atol=1e-7
    )


def test_empty_batch_gives_empty_clip_factors() -> None:
    gsm = GradSampleModuleRandomizedClipping(TinySeqModel(), max_grad_norm=1.0, sketch_dim=4)
    x = torch.zeros(0, SEQ, dtype=torch.long)
    one_backward(gsm, lambda: gsm(x), torch.zeros(0, dtype=torch.long))
    assert gsm.per_sample_gradient_norms.shape == (0,)


def test_zero_gradient_sample_gets_factor_one() -> None:
    model = nn.Linear(4, 2, bias=False)
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=0.5, sketch_dim=4)
    x = torch.randn(3, 1, 4)
    x[1] = 0.0
    out = gsm(x).sum((1, 2))
    out.sum().backward()
    coef = gsm.get_clipping_coef()
    assert gsm.per_sample_gradient_norms[1] == 0
    assert coef[1] == 1.0 and torch.isfinite(coef).all()


def test_bf16_autocast_norms_are_float32_and_accurate(microbatch_norms: Callable) -> None:
    """Under bf16 autocast the sketched norms are accumulated and returned in float32 and stay
    within 5% of the exact float64 norms (k = 4096 sketch sd ~1.1%, bf16 rounding of the
    factors ~0.4%)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 4))
    reference = copy.deepcopy(model)
    gsm = GradSampleModuleRandomizedClipping(
        model, max_grad_norm=1.0, sketch_dim=4096, loss_reduction="sum"
    )
    x = torch.randn(3, 10, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gsm(x)
    out.float().pow(2).sum().backward()
    for name in ("0.weight", "2.weight"):
        assert gsm.norm_samples[name].dtype == torch.float32
    oracle = microbatch_norms(reference, x, lambda o: o.pow(2).sum())
    torch.testing.assert_close(gsm.get_norm_sample(), oracle["__total__"], rtol=0.05, atol=1e-6)


def test_hooks_twin_wrap_model_false(assert_no_hooks: Callable) -> None:
    torch.manual_seed(0)
    model = TinySeqModel()
    hooks = GradSampleHooksRandomizedClipping(model, max_grad_norm=1.0, sketch_dim=8)
    assert not isinstance(hooks, nn.Module)
    assert hooks.sketch_spec.sketch_dim == 8
    opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(model.parameters(), lr=0.1),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
    )
    crit = DPLossFastGradientClipping(hooks, opt, nn.CrossEntropyLoss())
    x = torch.randint(0, VOCAB, (4, SEQ))
    before = model.lin1.weight.detach().clone()
    crit(model(x), torch.tensor([0, 1, 2, 0])).backward()
    opt.step()
    assert hooks.per_sample_gradient_norms.shape == (4,)
    assert not torch.equal(model.lin1.weight, before)
    hooks.cleanup()
    assert_no_hooks(model)


def test_secure_mode_reseeds_every_step() -> None:
    model = nn.Linear(3, 2)
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, secure_mode=True)
    seeds = [gsm.sketch_generator.initial_seed()]
    for _ in range(2):
        gsm(torch.randn(2, 4, 3)).sum().backward()
        gsm.get_clipping_coef()
        seeds.append(gsm.sketch_generator.initial_seed())
    assert len(set(seeds)) == 3


class Scale(nn.Module):
    """A layer with no Opacus sampler: its norm comes from Opacus' functorch fallback."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class MyLinear(nn.Linear):
    """A Linear subclass: exact-type lookup, so it is not sketched (exact, like Opacus)."""


def test_exact_fallbacks_frozen_layers_and_logging(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, microbatch_norms: Callable
) -> None:
    """Only registered types draw probes; the frozen layer contributes nothing; the other
    layers get Opacus' exact norms (functorch, grad sampler, ghost); paths are logged once."""
    draws: list[tuple[int, ...]] = []
    original = sketching.draw_gaussian_probes

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(*args, **kwargs)
        draws.append(tuple(out.shape))
        return out

    monkeypatch.setattr(sketching, "draw_gaussian_probes", recording)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 5),  # frozen below
        nn.Tanh(),
        Scale(5),
        MyLinear(5, 3),
        nn.LayerNorm(3),
        nn.Linear(3, 2),
    )
    model[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    with caplog.at_level("INFO", logger="opacus_rc.grad_sample.grad_sample_module"):
        gsm = GradSampleModuleRandomizedClipping(
            model, max_grad_norm=1.0, sketch_dim=4096, loss_reduction="sum"
        )
    paths = {r.args[0]: r.args[2] for r in caplog.records}
    assert paths["2"].endswith("(functorch fallback)")
    assert paths["3"].endswith("(functorch fallback)")
    assert paths["4"].startswith("exact per-sample gradients (Opacus grad sampler)")
    assert paths["5"].startswith("sketched (hutchinson, k=4096)")
    assert "0" not in paths  # frozen: not hooked
    x = torch.randn(3, 7, 4)
    gsm(x).pow(2).sum().backward()
    assert draws == [(3, 2, 4096)]  # only the registered nn.Linear (output side, p = 2)
    oracle = microbatch_norms(reference, x, lambda o: o.pow(2).sum())
    for name in ("2.w", "3.weight", "4.weight"):
        got = gsm.norm_samples[name].double()
        torch.testing.assert_close(got, oracle[name], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gsm.get_norm_sample(), oracle["__total__"], rtol=0.05, atol=0)


def test_norms_are_consumed_by_the_clip_factors() -> None:
    """A step's norms serve exactly one get_clipping_coef(); asking again without a new
    backward pass raises instead of silently reusing them."""
    gsm = GradSampleModuleRandomizedClipping(nn.Linear(3, 2), max_grad_norm=1.0, sketch_dim=4)
    with pytest.raises(RuntimeError, match="no per-sample norms for this step"):
        gsm.get_clipping_coef()
    gsm(torch.randn(2, 5, 3)).sum().backward()
    coef = gsm.get_clipping_coef()
    assert coef.shape == (2,) and gsm.per_sample_gradient_norms.shape == (2,)
    with pytest.raises(RuntimeError, match="consumed by get_clipping_coef"):
        gsm.get_clipping_coef()


# --------------------------------------------------------------------------------------------
# a module used twice: exact-path modules sum their per-sample gradients over uses
# --------------------------------------------------------------------------------------------


class LayerNormTwice(nn.Module):
    """A LayerNorm applied twice (Opacus #578): exact per-sample gradients summed over uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(private_mlp.D, private_mlp.H)
        self.norm = nn.LayerNorm(private_mlp.H)
        self.head = nn.Linear(private_mlp.H, private_mlp.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.lin(x))
        return self.head(self.norm(2 * torch.tanh(h)))


def _tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).train()
    model.model.embed_tokens.weight.requires_grad_(False)
    return model


def _generate_then_train(model: nn.Module, wrap_model: bool) -> None:
    """generate() through what make_private returns equals the untouched model's; then one
    clipped LM step is accounted (generation left no state behind)."""
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(1))
    engine = PrivacyEngine()
    module, opt, crit, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data_loader=DataLoader(TensorDataset(tokens), batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=4,
        wrap_model=wrap_model,
    )
    model_like = module if wrap_model else model
    prompt = tokens[:2, :3]
    mask = torch.ones_like(prompt)
    out = model_like.generate(prompt, attention_mask=mask, max_new_tokens=3, do_sample=False)
    expected = reference.generate(prompt, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 6) and torch.equal(out, expected)
    assert model_like.config is model.config
    x = tokens[:4]
    logits = model_like(input_ids=x).logits[:, :-1]
    crit(logits.reshape(-1, 32), x[:, 1:].reshape(-1), shape=(4, 5)).backward()
    opt.step()
    assert len(engine.accountant) == 1


def test_reused_exact_module_sums_per_sample_gradients(microbatch_norms: Callable) -> None:
    """Sketched modules used twice raise naming the module (test_reused_module_raises_naming_it);
    a module on Opacus' exact path (LayerNorm) used twice gets the norm of the summed per-sample
    gradient, equal to the microbatch oracle."""
    torch.manual_seed(0)
    model = LayerNormTwice()
    reference = copy.deepcopy(model)
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, loss_reduction="sum")
    x = torch.randn(3, private_mlp.D)
    gsm(x).pow(2).sum().backward()
    oracle = microbatch_norms(reference, x, lambda o: o.pow(2).sum())
    for name in ("norm.weight", "norm.bias", "lin.weight", "head.weight"):
        got = gsm.norm_samples[name].double()
        torch.testing.assert_close(got, oracle[name], rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------
# bf16 / fp16 autocast
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_full_step_accumulates_in_float32(
    dtype: torch.dtype, microbatch_norms: Callable
) -> None:
    """A full private step under CPU autocast: norms and clip factors are float32, within 5% of
    the float64 oracle at k = 4096 (sketch sd 1.1%, half-precision factors < 1%), and the
    update is finite. bf16 norms alone: test_bf16_autocast_norms_are_float32_and_accurate."""
    torch.manual_seed(0)
    model = private_mlp.SeqMLP()
    reference = copy.deepcopy(model)
    engine, module, opt, crit, _ = private_mlp.private(model, sketch_dim=4096)
    x, y = private_mlp.batch()
    with torch.autocast("cpu", dtype=dtype):
        out = module(x)
    assert out.dtype == dtype
    loss = crit(out.float(), y)
    loss.backward()
    norms = module.per_sample_gradient_norms
    rows = iter(y.split(1))
    oracle = microbatch_norms(reference, x, lambda o: nn.functional.cross_entropy(o, next(rows)))
    # Opacus scales backprops by B under "mean": the module's norms are those of the
    # per-sample losses, as the oracle's.
    torch.testing.assert_close(norms, oracle["__total__"], rtol=0.05, atol=1e-6)
    for p in (model.lin1.weight, model.lin2.weight):
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
    opt.step()
    assert torch.isfinite(private_mlp.params(model)).all() and len(engine.accountant) == 1


# --------------------------------------------------------------------------------------------
# huge norms
# --------------------------------------------------------------------------------------------


def test_huge_norm_sample_is_clipped_end_to_end() -> None:
    """One sample with a gradient norm near 1e30 (float32) among ordinary ones: its released
    contribution is exactly C * n / n_hat (randomized clipping's sensitivity,
    docs/privacy/mechanism.md#mechanism-sensitivity),
    within 5% of C at k = 4096 (sd 1.1%), and the update stays finite. The per-layer rescaling
    is tested in test_huge_gradients_give_finite_accurate_norms."""
    torch.manual_seed(0)
    model = nn.Linear(private_mlp.D, private_mlp.H, bias=False)
    C = 1.0
    gsm = GradSampleModuleRandomizedClipping(
        model, max_grad_norm=C, sketch_dim=4096, loss_reduction="sum"
    )
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=1.0),
        grad_sample_module=gsm,
        noise_multiplier=0.0,
        max_grad_norm=C,
        expected_batch_size=3,
        loss_reduction="sum",
    )

    class LinearLoss(nn.Module):  # loss_i = <out_i, target_i>: gradient target_i^T x_i
        reduction = "sum"

        def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            per_sample = (out * target).flatten(1).sum(1)
            return per_sample if self.reduction == "none" else per_sample.sum()

    crit = DPLossRandomizedClipping(gsm, opt, LinearLoss(), "sum")
    x = torch.zeros(3, private_mlp.T, private_mlp.D)
    x[1] = 1e14 * torch.randn(
        private_mlp.T, private_mlp.D
    )  # sample 1 only: its gradient is target_1^T x_1, ~1e30
    target = torch.zeros(3, private_mlp.T, private_mlp.H)
    target[1] = 1e15 * torch.randn(private_mlp.T, private_mlp.H)
    exact = (target[1].double().T @ x[1].double()).norm()
    assert 1e28 < exact < 1e32
    before = model.weight.detach().clone()
    crit(gsm(x), target).backward()
    n_hat = gsm.per_sample_gradient_norms[1]
    opt.step()
    step = (before - model.weight.detach()).double().norm()
    assert torch.isfinite(model.weight).all()
    torch.testing.assert_close(step, C * exact / n_hat, rtol=1e-4, atol=0)
    torch.testing.assert_close(step, torch.tensor(C, dtype=torch.float64), rtol=0.05, atol=0)


def test_exact_fallback_is_logged_once_not_per_step(caplog: pytest.LogCaptureFixture) -> None:
    """Modules without a sketched sampler are logged (INFO) once, at construction, with the path
    they take; training steps log nothing (paths:
    test_exact_fallbacks_frozen_layers_and_logging)."""
    model = nn.Sequential(
        nn.Linear(private_mlp.D, private_mlp.H),
        private_mlp.Scale(),
        nn.Linear(private_mlp.H, private_mlp.CLASSES),
    )
    logger = "opacus_rc.grad_sample.grad_sample_module"
    with caplog.at_level(logging.INFO, logger=logger):
        engine = PrivacyEngine()
        module, opt, crit, _ = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(private_mlp.dataset(8, seq=True), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            clipping="randomized",
        )
        at_construction = [r for r in caplog.records if r.name == logger]
        assert [r.args[0] for r in at_construction] == ["0", "1", "2"]
        assert "functorch fallback" in at_construction[1].getMessage()
        for _ in range(2):
            x, y = private_mlp.batch()
            crit(module(x).mean(1), y).backward()
            opt.step()
            opt.zero_grad()
    assert [r for r in caplog.records if r.name == logger] == at_construction


def test_wrapped_hf_model_forwards_generate_and_attributes() -> None:
    """Issue 14, item 4: with wrap_model=True, ``module.generate(...)`` and ``module.config``
    raised AttributeError (Opacus' wrapper forwards only submodule names,
    ``AbstractGradSampleModule.__getattr__``; Opacus #341/#435). The wrapper now forwards
    any attribute it lacks to the model."""
    _generate_then_train(_tiny_llama(), wrap_model=True)


def test_unwrapped_hf_model_generates_with_wrap_model_false() -> None:
    """The workaround for item 4 until the wrapper forwards: wrap_model=False keeps the model's
    class, so generate() works, and training afterwards is clipped and accounted."""
    _generate_then_train(_tiny_llama(), wrap_model=False)


def test_private_backward_does_not_warn_about_output_hooks() -> None:
    """Issue 14, item 9: the lowest hooked layer's inputs need no gradient, so PyTorch warned
    'Full backward hook is firing when gradients are computed with respect to module outputs'
    at every step, from our own loss; nothing for the user to act on, so it is silenced there."""
    torch.manual_seed(0)
    engine, module, opt, crit, _ = private_mlp.private(private_mlp.SeqMLP())
    x, y = private_mlp.batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        crit(module(x), y).backward()
        opt.step()
    assert not [w for w in caught if "Full backward hook is firing" in str(w.message)]
    assert len(engine.accountant) == 1


class GRUNet(nn.Module):
    """Opacus' DPGRU with a Linear head on the last step (meta-pytorch/opacus#639)."""

    def __init__(self) -> None:
        super().__init__()
        from opacus.layers import DPGRU

        self.rnn = DPGRU(flat_mlp.D, flat_mlp.H, batch_first=True)
        self.fc = nn.Linear(flat_mlp.H, flat_mlp.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.fc(out[:, -1])


def test_to_standard_module_leaves_a_clean_model_that_can_be_made_private_again() -> None:
    """meta-pytorch/opacus PR 754 (2025-05): ``to_standard_module`` after ghost clipping left
    attributes behind. After training with randomized clipping, ``to_standard_module()``
    gives the original class with no hook and no per-sample attribute; a plain backward gives
    autograd's gradient (float64 check), and the model can be made private again."""
    torch.manual_seed(0)
    model = flat_mlp.FlatMLP()
    engine, module, opt, crit, loader = flat_mlp.private(model)
    flat_mlp.train_all(module, opt, crit, loader)
    plain = module.to_standard_module()
    assert type(plain) is flat_mlp.FlatMLP
    for sub in plain.modules():
        assert not (sub._forward_hooks or sub._backward_hooks or sub._forward_pre_hooks)
        assert not sub._backward_pre_hooks
        assert not getattr(sub, "activations", None) and not hasattr(sub, "max_batch_len")
    for p in plain.parameters():
        for attr in ("grad_sample", "_current_grad_sample", "_forward_counter"):
            assert getattr(p, attr, None) in (None, 0), attr
    x, y = flat_mlp.batch()
    plain.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(plain(x), y).backward()
    ref = flat_mlp.FlatMLP().double()
    ref.load_state_dict({k: v.double() for k, v in plain.state_dict().items()})
    nn.functional.cross_entropy(ref(x.double()), y).backward()
    for p, r in zip(plain.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.double(), r.grad, rtol=1e-5, atol=1e-7)
    plain.zero_grad(set_to_none=True)
    engine2, module2, opt2, crit2, _ = flat_mlp.private(plain)
    crit2(module2(x), y).backward()
    opt2.step()
    assert len(engine2.accountant) == 1


def test_dpgru_with_a_linear_head_matches_the_per_sample_oracle() -> None:
    """meta-pytorch/opacus#639 (2024-08 comment): a Linear layer on top of Opacus' DPGRU gave
    "Per sample gradient is not initialized. Not updated in backward pass?". Here the GRU's
    RNNLinear cells take Opacus' exact grad sampler and the head's rank-2 input is exact too,
    so the per-sample norms and the clipped gradient equal a float64 oracle (one autograd
    call per sample) to 1e-5."""
    torch.manual_seed(0)
    model = GRUNet()
    ref = GRUNet().double()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    engine, module, opt, crit, _ = flat_mlp.private(model, seq=True)
    x, y = flat_mlp.batch(seq=True)
    crit(module(x), y).backward()
    norms = module.get_norm_sample()
    grads = [p.grad.double().clone() for p in model.parameters()]
    expected_norms, expected = [], [torch.zeros_like(p) for p in ref.parameters()]
    for i in range(flat_mlp.B):
        loss = nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1])
        g = torch.autograd.grad(loss, list(ref.parameters()))
        n = float(torch.sqrt(sum((t**2).sum() for t in g)))
        expected_norms.append(n)
        for e, t in zip(expected, g, strict=True):
            e += min(1.0, flat_mlp.C / n) * t
    torch.testing.assert_close(
        norms, torch.tensor(expected_norms, dtype=torch.float64), rtol=1e-5, atol=0
    )
    for got, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, e, rtol=1e-5, atol=1e-7)
    opt.step()
    assert len(engine.accountant) == 1


def test_bf16_model_norms_match_the_oracle_within_bf16_rounding() -> None:
    """A model cast to bfloat16 (weights, activations and gradients bf16, no autocast): the
    step runs, the per-sample norms are float32 and equal the float64 oracle (on the same bf16
    weights, in float64 arithmetic) within bf16 rounding: a relative 2**-8 per rounding, a few
    dozen roundings along the forward and backward of these three layers, so 5%; the update
    is finite and accounted."""
    torch.manual_seed(0)
    model = float64_oracle.NormMLP().to(torch.bfloat16)
    x, y = float64_oracle.batch()
    x = x.to(torch.bfloat16)
    _, oracle_norms = float64_oracle.clipped_sum_oracle(model, x, float64_oracle.ce_of_sample(x, y))
    engine, module, opt, crit = float64_oracle.private(model)
    crit(module(x), y).backward()
    norms = module.per_sample_gradient_norms
    assert norms.dtype in (torch.float32, torch.float64)
    torch.testing.assert_close(
        norms.double(), torch.tensor(oracle_norms, dtype=torch.float64), rtol=0.05, atol=0.0
    )
    assert min(oracle_norms) > float64_oracle.C  # clipping is active
    opt.step()
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in model.parameters())
    assert len(engine.accountant) == 1
