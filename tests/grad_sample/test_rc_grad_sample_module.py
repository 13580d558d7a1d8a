"""GradSampleModuleRandomizedClipping / GradSampleHooksRandomizedClipping behaviour."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from opacus.optimizers import DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from torch import nn

import opacus_rc.sketching as sketching
from opacus_rc.grad_sample import (
    GradSampleHooksRandomizedClipping,
    GradSampleModuleRandomizedClipping,
)
from opacus_rc.sketching import SketchSpec, hutchinson_sqnorm

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
        ({"sketch": "gauss"}, ValueError, "unknown sketch estimator 'gauss'"),
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
