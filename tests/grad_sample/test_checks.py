"""Model hygiene and misuse checks of the grad-sample module: each bad input either works
(checked against an oracle) or is refused with an error naming its cause before anything is
noised or accounted, and training recovers after ``zero_grad()``
(tests/reliability/CATALOGUE.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc.grad_sample.routing import UnsupportedModuleError
from opacus_rc.privacy_engine import PrivacyEngine
from tests import float64_oracle, private_mlp

pytestmark = pytest.mark.filterwarnings("ignore:a sketch_generator was passed")


def assert_refused_then_recovers(engine: Any, module: Any, opt: Any, crit: Any, model: Any) -> None:
    """After a failed backward: no gradient left, step() refuses, nothing is accounted; after
    zero_grad() a clean batch steps and is accounted exactly once."""
    steps, theta = len(engine.accountant), private_mlp.params(model)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="no step is taken and nothing is accounted"):
        opt.step()
    assert len(engine.accountant) == steps
    assert torch.equal(private_mlp.params(model), theta)
    opt.zero_grad()
    x, y = private_mlp.batch()
    crit(module(x), y).backward()
    opt.step()
    assert len(engine.accountant) == steps + 1
    assert not torch.equal(private_mlp.params(model), theta)


# --------------------------------------------------------------------------------------------
# A parameter used outside its module's forward
# --------------------------------------------------------------------------------------------


class SideUse(nn.Module):
    """SeqMLP whose ``lin2.weight`` is also (``both``) or only (``only``) used through
    ``F.linear`` outside ``lin2``'s forward; ``mode=None`` is the plain SeqMLP."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(private_mlp.D, private_mlp.H)
        self.lin2 = nn.Linear(private_mlp.H, private_mlp.CLASSES)
        self.mode: str | None = "both"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin1(x))
        if self.mode is None:
            return self.lin2(h).mean(1)
        side = nn.functional.linear(h, self.lin2.weight)  # not through lin2's hooks
        if self.mode == "only":
            return (side + self.lin2.bias).mean(1)
        return (self.lin2(h) + side).mean(1)


# --------------------------------------------------------------------------------------------
# batch-broadcast position_ids (Opacus issue 841)
# --------------------------------------------------------------------------------------------

VOCAB = 11


class PositionModel(nn.Module):
    """GPT-2-like: token + learned position embeddings, position_ids of shape [1, T] by default."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, private_mlp.D)
        self.wpe = nn.Embedding(private_mlp.T, private_mlp.D)
        self.head = nn.Linear(private_mlp.D, private_mlp.CLASSES)
        self.expand_positions = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(ids.shape[1]).unsqueeze(0)  # [1, T], as Hugging Face
        if self.expand_positions:
            position_ids = position_ids.expand(ids.shape[0], -1)
        return self.head((self.wte(ids) + self.wpe(position_ids)).mean(1))


def token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (4, private_mlp.T), generator=g), torch.randint(
        0, private_mlp.CLASSES, (4,), generator=g
    )


# ----------------------------------------------------------------------------------------------
# Issue 14, items 3, 7 and 9 (lead)
# ----------------------------------------------------------------------------------------------


class _InplaceReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(private_mlp.D, private_mlp.H)
        self.act = nn.ReLU(inplace=True)
        self.lin2 = nn.Linear(private_mlp.H, private_mlp.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.act(self.lin1(x))).mean(1)


class _InplaceAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(private_mlp.D, private_mlp.D)
        self.lin2 = nn.Linear(private_mlp.D, private_mlp.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin1(x)
        h += x
        return self.lin2(h).mean(1)


# --------------------------------------------------------------------------------------------
# NaN / inf
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["input", "loss"])
def test_nan_or_inf_raises_no_step_no_accounting(where: str) -> None:
    """A NaN activation (input) or an inf loss of one sample: clear FloatingPointError in
    backward(), no gradient survives, step() refuses, the accountant does not move."""
    torch.manual_seed(0)
    model = private_mlp.SeqMLP()
    engine, module, opt, crit, _ = private_mlp.private(model)
    x, y = private_mlp.batch()
    if where == "input":
        x[2, 1, 0] = float("nan")
        loss = crit(module(x), y)
    else:
        out = module(x)
        scale = torch.ones(4, 1)
        scale[1] = float("inf")
        loss = crit(out * scale, y)
    with pytest.raises(FloatingPointError, match="1 of 4 per-sample gradient norm estimates"):
        loss.backward()
    assert_refused_then_recovers(engine, module, opt, crit, model)


@pytest.mark.parametrize("bookkeeping", [True, False])
@pytest.mark.parametrize("mode", ["both", "only"])
def test_parameter_used_outside_its_module_raises_then_recovers(
    mode: str, bookkeeping: bool
) -> None:
    """``lin2.weight`` reaching the loss outside ``lin2``'s forward: its per-sample norm would
    miss that use (with two passes the second pass would then release c_i * (inside + outside)
    gradients, whose norm can exceed C; with book-keeping the outside part would be silently
    dropped). backward() must refuse, naming the parameter, before any clip factor exists;
    ``mode="both"`` passed silently before the check existed."""
    torch.manual_seed(0)
    model = SideUse()
    model.mode = mode
    engine, module, opt, crit, _ = private_mlp.private(model, bookkeeping=bookkeeping)
    assert module.bookkeeping is bookkeeping
    x, y = private_mlp.batch()
    loss = crit(module(x), y)
    with pytest.raises(RuntimeError, match=r"'lin2\.weight'\] are used outside the forward"):
        loss.backward()
    model.mode = None
    assert_refused_then_recovers(engine, module, opt, crit, model)


def test_parameter_use_check_leaves_ordinary_models_alone() -> None:
    """Uses inside the owning module's forward pass the check, also under autocast (whose
    weight casts are cached for the region, so that the consuming node is the cast); the
    recorded spans are consumed by every backward."""
    torch.manual_seed(0)
    model = SideUse()
    model.mode = None
    engine, module, opt, crit, _ = private_mlp.private(model)
    x, y = private_mlp.batch()
    for _ in range(2):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        crit(out.float(), y).backward()
        assert not module.private_step.uses.has_spans
        opt.step()
    assert len(engine.accountant) == 2


# --------------------------------------------------------------------------------------------
# eval mode after make_private
# --------------------------------------------------------------------------------------------


def test_eval_mode_after_make_private_raises_naming_the_module() -> None:
    """make_private rejects eval-mode models (test_eval_mode_model_raises); switching to eval()
    afterwards and training anyway gives an error naming the module, not a missing norm."""
    model = private_mlp.SeqMLP()
    engine, module, opt, crit, _ = private_mlp.private(model)
    x, y = private_mlp.batch()
    module.eval()
    with torch.no_grad():  # evaluation itself is fine and leaves nothing behind
        module(x)
    with pytest.raises(RuntimeError, match=r"module 'lin2' \(Linear\) is in eval mode"):
        crit(module(x), y).backward()
    module.train()
    assert_refused_then_recovers(engine, module, opt, crit, model)


def test_a_failed_hooked_backward_after_the_clipped_one_refuses_the_step() -> None:
    """After a clipped backward, a second backward of an eval-mode forward (no inputs recorded)
    raises in the hook, after autograd may already have added its unclipped gradient to
    ``p.grad``. The step must then be refused, not released with the first backward's factors:
    the hook used to drop only the records (the phase stayed "applied" and ``step()`` went
    through); now it fails the step."""
    model = private_mlp.SeqMLP()
    engine, module, opt, crit, _ = private_mlp.private(model)
    x, y = private_mlp.batch()
    crit(module(x), y).backward()
    module.eval()
    with pytest.raises(RuntimeError, match=r"is in eval mode"):
        module(x).sum().backward()
    module.train()
    steps, theta = len(engine.accountant), private_mlp.params(model)
    with pytest.raises(RuntimeError, match="no step is taken and nothing is accounted"):
        opt.step()
    assert len(engine.accountant) == steps and torch.equal(private_mlp.params(model), theta)
    opt.zero_grad()
    crit(module(x), y).backward()
    opt.step()
    assert len(engine.accountant) == steps + 1


def test_broadcast_position_ids_raise_clearly_then_work_expanded(
    microbatch_norms: Callable,
) -> None:
    """position_ids [1, T]: the position embedding only sees the batch-summed gradient, so its
    per-sample norm is unknowable; Opacus fails with "stack expects each tensor to be equal
    size" (#841). Here: a ValueError naming 'wpe.weight' and the fix; nothing is stepped. With
    position_ids expanded to [B, T] the norms equal the microbatch oracle (all exact here)."""
    torch.manual_seed(0)
    model = PositionModel()
    reference = copy.deepcopy(model)
    engine = PrivacyEngine()
    module, opt, crit, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(*token_batch()), batch_size=2),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
    )
    ids, y = token_batch()
    with pytest.raises(ValueError, match=r"batch has 4 samples but \{'wpe.weight': 1\}.*expand"):
        crit(module(ids), y).backward()
    with pytest.raises(RuntimeError, match="nothing is accounted"):
        opt.step()
    assert len(engine.accountant) == 0
    opt.zero_grad()
    model.expand_positions = True
    crit(module(ids), y).backward()
    reference.expand_positions = True
    rows = iter(y.split(1))
    oracle = microbatch_norms(reference, ids, lambda o: nn.functional.cross_entropy(o, next(rows)))
    torch.testing.assert_close(
        module.per_sample_gradient_norms, oracle["__total__"], rtol=1e-5, atol=1e-6
    )
    opt.step()
    assert len(engine.accountant) == 1


def test_only_broadcast_modules_trainable_raises_one_factor_per_sample() -> None:
    """If every trainable module sees the broadcast input, all norms have batch size 1 and
    Opacus' loss would broadcast ONE clip factor over the batch (a silent wrong clip). The
    randomized-clipping loss checks one factor per sample."""
    model = PositionModel()
    model.wte.requires_grad_(False)
    model.head.requires_grad_(False)
    engine, module, opt, crit, _ = private_mlp.private(model, n=4, seq=False)
    ids, y = token_batch()
    with pytest.raises(ValueError, match="computed 1 clip factors for per-sample losses of shape"):
        crit(module(ids), y).backward()
    with pytest.raises(RuntimeError, match="nothing is accounted"):
        opt.step()


@pytest.mark.parametrize(
    ("factory", "advice"),
    [(_InplaceReLU, r"\['act'\]: set inplace=False"), (_InplaceAdd, "h = h \\+ x")],
)
def test_inplace_ops_on_hooked_outputs_get_a_clear_error(factory: Any, advice: str) -> None:
    """Issue 14, item 3: PyTorch's 'Output 0 of BackwardHookFunction is a view and is being
    modified inplace' (whose advice does not apply) becomes an error naming the inplace=True
    modules and the fix; nothing is stepped or accounted."""
    torch.manual_seed(0)
    engine, module, opt, crit, _ = private_mlp.private(factory())
    x, y = private_mlp.batch()
    with pytest.raises(RuntimeError, match=advice):
        crit(module(x), y).backward()
    assert len(engine.accountant) == 0


def hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules()
    )


# --------------------------------------------------------------------------------------------
# pytorch/pytorch#117925 (2024-01): module hooks do not run when ``module.forward(x)`` is called
# instead of ``module(x)``.
# --------------------------------------------------------------------------------------------


class ForwardCalledDirectly(float64_oracle.MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2.forward(torch.tanh(self.lin1(x)))


# --------------------------------------------------------------------------------------------
# meta-pytorch/opacus#673 (2024-09): GradSampleModuleFastGradientClipping silently ignored the
# strict and force_functorch arguments (the user wanted strict=False for BatchNorm).
# --------------------------------------------------------------------------------------------


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(float64_oracle.D, float64_oracle.H)
        self.bn = nn.BatchNorm1d(float64_oracle.H)
        self.out = nn.Linear(float64_oracle.H, float64_oracle.K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.lin(x)))


# --------------------------------------------------------------------------------------------
# PEFT's DoRA (huggingface/peft PR 1474, 2024-02; use_dora=True in LoraConfig): the magnitude
# layer forms ||W + s B A|| by running lora_A and lora_B on an identity matrix, inside every
# forward. No DP tracker report was found; the case is PEFT's own implementation, met by any
# user who switches LoRA to DoRA.
# --------------------------------------------------------------------------------------------


def test_peft_dora_is_refused_at_make_private_and_plain_lora_trains() -> None:
    """Before: make_private accepted a DoRA model, and the first forward failed with
    "module 'base_model.model.lin1.lora_A.default' (Linear) ran more than once before a
    backward pass (a module reused within one forward, or a training-mode forward that was
    never backpropagated)", which does not say that DoRA is the cause. Now make_private raises
    UnsupportedModuleError naming the DoRA layer and the way out, leaving no hook behind; the
    same model with plain LoRA takes an accounted step whose clipped gradient of the adapters
    equals the float64 oracle."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    dora = peft.get_peft_model(
        float64_oracle.MLP(), peft.LoraConfig(r=2, target_modules=["lin1"], use_dora=True)
    )
    hooks = hook_count(dora)
    with pytest.raises(
        UnsupportedModuleError, match=r"DoRA.*'base_model.model.lin1'.*use_dora=False"
    ):
        float64_oracle.private(dora)
    assert hook_count(dora) == hooks
    torch.manual_seed(0)
    lora = peft.get_peft_model(float64_oracle.MLP(), peft.LoraConfig(r=2, target_modules=["lin1"]))
    with torch.no_grad():  # B = 0 at peft's initialisation: make both factors matter
        lora.base_model.model.lin1.lora_B.default.weight.normal_()
    # float64 oracle on a copy of the adapted model made before any hook, one sample at a time
    ref = copy.deepcopy(lora.base_model.model).double()
    x, y = float64_oracle.batch()
    ref_named = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    expected = {n: torch.zeros_like(p) for n, p in ref_named.items()}
    for i in range(float64_oracle.B):
        loss = nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(ref_named.values()))
        factor = min(1.0, float64_oracle.C / float(torch.sqrt(sum((g**2).sum() for g in grads))))
        for n, g in zip(ref_named, grads, strict=True):
            expected[n] += factor * g
    engine, module, opt, crit = float64_oracle.private(lora, lr=0.0)
    named = {n: p for n, p in lora.base_model.model.named_parameters() if p.requires_grad}
    assert set(named) == set(expected)
    crit(module(x), y).backward()
    for n, p in named.items():  # float32 step against float64: a few ulps of the gradients
        torch.testing.assert_close(p.grad.double(), expected[n], rtol=1e-4, atol=1e-6)
    opt.step()
    assert len(engine.accountant) == 1


@pytest.mark.parametrize("bookkeeping", [True, False], ids=["book-keeping", "two-passes"])
def test_submodule_forward_called_directly_is_named_in_the_error(bookkeeping: bool) -> None:
    """``self.lin2.forward(h)`` skips lin2's hooks, so its parameters get a gradient that no
    per-sample norm covers. Before: refused, but the error named only ``F.linear(h,
    model.fc.weight)`` as the cause. Now it also names ``model.fc.forward(h)`` and says to call
    the module itself; nothing is noised or accounted, and after ``zero_grad()`` the step of
    the corrected model equals the float64 oracle."""
    torch.manual_seed(0)
    model = ForwardCalledDirectly()
    engine, module, opt, crit = float64_oracle.private(model, lr=0.0, bookkeeping=bookkeeping)
    x, y = float64_oracle.batch()
    with pytest.raises(RuntimeError, match=r"'lin2.weight'.*model\.fc\.forward\(h\).*hooks"):
        crit(module(x), y).backward()
    with pytest.raises(RuntimeError):
        opt.step()
    assert len(engine.accountant) == 0
    opt.zero_grad()
    model.forward = float64_oracle.MLP.forward.__get__(model)  # the corrected forward: self.lin2(h)
    expected, _ = (
        float64_oracle.clipped_sum_oracle(  # the oracle's copy has no hooks: .forward() is exact
            model,
            x,
            lambda ref, i: nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1]),
        )
    )
    crit(module(x), y).backward()
    float64_oracle.assert_grads_equal(model, expected)
    opt.step()
    assert len(engine.accountant) == 1


# --------------------------------------------------------------------------------------------
# meta-pytorch/opacus#687 (2024-11): "can I set some model parameter's requires_grad false after
# make_private" (the maintainers: an error with ghost clipping, untested otherwise).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bookkeeping", [True, False], ids=["book-keeping", "two-passes"])
def test_parameter_frozen_after_make_private(bookkeeping: bool) -> None:
    """Freezing ``lin1.weight`` after make_private (gradual unfreezing run backwards): the step
    works, the frozen weight gets no gradient, no noise and no update, and the other
    parameters' clipped gradient equals the float64 oracle whose per-sample norm covers the
    still-trainable parameters only (so clipping is not looser than the accounted C)."""
    torch.manual_seed(0)
    model = float64_oracle.MLP()
    engine, module, opt, crit = float64_oracle.private(model, lr=0.0, bookkeeping=bookkeeping)
    x, y = float64_oracle.batch()
    model.lin1.weight.requires_grad_(False)
    frozen = model.lin1.weight.detach().clone()
    expected, _ = float64_oracle.clipped_sum_oracle(model, x, float64_oracle.ce_of_sample(x, y))
    assert "lin1.weight" not in expected
    crit(module(x), y).backward()
    assert model.lin1.weight.grad is None
    float64_oracle.assert_grads_equal(model, expected)
    opt.param_groups[0]["lr"] = 0.5
    opt.step()
    assert torch.equal(model.lin1.weight, frozen)
    assert len(engine.accountant) == 1


# --------------------------------------------------------------------------------------------
# huggingface/peft#3409 (2026-07, from meta-pytorch/opacus#820): parameters materialised or
# replaced after a hook-registering library wrapped the model; the optimizer keeps the stale
# ones and the adapters never move (max |delta| = 0) while epsilon grows.
# --------------------------------------------------------------------------------------------


def test_parameters_replaced_after_make_private_are_refused() -> None:
    """``model.load_state_dict(sd, assign=True)`` after make_private replaces every parameter
    object (the optimizer holds the old ones). The private backward raises naming them,
    nothing is accounted; a load without ``assign`` (copied in place) trains normally and
    moves every parameter."""
    torch.manual_seed(0)
    model = float64_oracle.MLP()
    engine, module, opt, crit = float64_oracle.private(model)
    x, y = float64_oracle.batch()
    state = {k: v.clone() + 0.1 for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    with pytest.raises(RuntimeError, match=r"replaced or tied after the model was made private"):
        crit(module(x), y).backward()
    with pytest.raises(RuntimeError):
        opt.step()
    assert len(engine.accountant) == 0
    torch.manual_seed(0)
    model = float64_oracle.MLP()
    engine, module, opt, crit = float64_oracle.private(model)
    model.load_state_dict(state)  # in place: the optimizer's parameters
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    crit(module(x), y).backward()
    opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert len(engine.accountant) == 1


@pytest.mark.parametrize("option", ["strict", "force_functorch"])
def test_strict_and_force_functorch_are_refused_by_name_not_ignored(option: str) -> None:
    """Passing ``strict=False`` or ``force_functorch=True`` to make_private with randomized
    clipping raises a TypeError naming the option (never accepted and ignored), before any hook
    is attached; BatchNorm (which mixes the samples of a batch) stays refused with the default
    options."""
    model = float64_oracle.NormMLP()
    hooks = hook_count(model)
    value = option == "force_functorch"
    with pytest.raises(TypeError, match=rf"unexpected keyword arguments.*'{option}'"):
        float64_oracle.private(model, **{option: value})
    assert hook_count(model) == hooks
    with pytest.raises(Exception, match=r"BatchNorm"):
        float64_oracle.private(WithBatchNorm())


# --------------------------------------------------------------------------------------------
# meta-pytorch/opacus#646 (2024-04): "Spectral normalization in Opacus": a model with
# spectral_norm (ParametrizedConv2d) was refused as an unsupported layer.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parametrization, bias",
    [
        (parametrizations.weight_norm, False),
        (parametrizations.weight_norm, True),
        (parametrizations.spectral_norm, True),
        (parametrizations.orthogonal, False),
    ],
    ids=["weight_norm-no-bias", "weight_norm", "spectral_norm", "orthogonal"],
)
def test_parametrized_weights_are_refused_naming_the_parametrization(
    parametrization: Any, bias: bool
) -> None:
    """``torch.nn.utils.parametrizations.weight_norm(nn.Linear(D, H, bias=False))``: before,
    make_private routed ``lin1.parametrizations.weight`` to functorch and the first backward
    failed with a bare ``IndexError: list index out of range``; with a bias the layer was
    refused for owning ``bias`` "directly" (advice: move it into a leaf module), and
    spectral_norm/orthogonal for the ParametrizationList's buffers; none named the
    parametrization. Now make_private raises UnsupportedModuleError naming ``lin1.weight`` and
    ``remove_parametrizations``, leaving no hook; after removing it the model's step equals
    the float64 oracle."""
    torch.manual_seed(0)
    model = float64_oracle.MLP()
    model.lin1 = parametrization(nn.Linear(float64_oracle.D, float64_oracle.H, bias=bias))
    hooks = hook_count(model)
    with pytest.raises(
        UnsupportedModuleError,
        match=r"parametrized tensors.*'lin1.weight'.*remove_parametrizations",
    ):
        float64_oracle.private(model)
    assert hook_count(model) == hooks
    parametrize.remove_parametrizations(model.lin1, "weight")
    x, y = float64_oracle.batch()
    expected, _ = float64_oracle.clipped_sum_oracle(model, x, float64_oracle.ce_of_sample(x, y))
    engine, module, opt, crit = float64_oracle.private(model, lr=0.0)
    crit(module(x), y).backward()
    float64_oracle.assert_grads_equal(model, expected)
    opt.step()
    assert len(engine.accountant) == 1
