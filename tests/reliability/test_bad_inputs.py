"""Bad and awkward inputs through the whole randomized-clipping stack
(tests/reliability/CATALOGUE.md).

Every entry either works (checked against an exact oracle) or fails with a clear error before
anything is noised or accounted: never a silent wrong norm, an unclipped sample or an unaccounted
step. Entries already covered elsewhere are listed in CATALOGUE.md with their test names.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.optimizers import DPLossRandomizedClipping, RandomizedClipOptimizer
from opacus_rc.privacy_engine import PrivacyEngine

pytestmark = pytest.mark.filterwarnings("ignore:a sketch_generator was passed")

D, H, CLASSES, T = 5, 6, 3, 4


class SeqMLP(nn.Module):
    """Token-wise MLP on (B, T, D), logits averaged over T: both weights are sketched."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x))).mean(1)


class FlatMLP(nn.Module):
    """MLP on (B, D): rank-2 inputs, so every norm is exact (no probes) and runs compare exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)))


def dataset(n: int, *, seq: bool, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, T, D) if seq else (n, D), generator=g) * 3
    return TensorDataset(x, torch.randint(0, CLASSES, (n,), generator=g))


def params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def private(
    model: nn.Module,
    *,
    engine: Any = None,
    n: int = 16,
    batch_size: int = 4,
    seq: bool = True,
    noise_multiplier: float = 1.0,
    **kwargs: Any,
) -> tuple[Any, Any, Any, Any, Any]:
    engine = PrivacyEngine() if engine is None else engine
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(dataset(n, seq=seq), batch_size=batch_size),
        noise_multiplier=noise_multiplier,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=kwargs.pop("sketch_dim", 8),
        **kwargs,
    )
    return (engine, *out)


def batch(n: int = 4, *, seq: bool = True, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ds = dataset(n, seq=seq, seed=seed)
    return ds.tensors[0].clone(), ds.tensors[1].clone()


def assert_refused_then_recovers(engine: Any, module: Any, opt: Any, crit: Any, model: Any) -> None:
    """After a failed backward: no gradient left, step() refuses, nothing is accounted; after
    zero_grad() a clean batch steps and is accounted exactly once."""
    steps, theta = len(engine.accountant), params(model)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="no step is taken and nothing is accounted"):
        opt.step()
    assert len(engine.accountant) == steps
    assert torch.equal(params(model), theta)
    opt.zero_grad()
    x, y = batch()
    crit(module(x), y).backward()
    opt.step()
    assert len(engine.accountant) == steps + 1
    assert not torch.equal(params(model), theta)


# --------------------------------------------------------------------------------------------
# NaN / inf
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["input", "loss"])
def test_nan_or_inf_raises_no_step_no_accounting(where: str) -> None:
    """A NaN activation (input) or an inf loss of one sample: clear FloatingPointError in
    backward(), no gradient survives, step() refuses, the accountant does not move."""
    torch.manual_seed(0)
    model = SeqMLP()
    engine, module, opt, crit, _ = private(model)
    x, y = batch()
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


# --------------------------------------------------------------------------------------------
# A parameter used outside its module's forward
# --------------------------------------------------------------------------------------------


class SideUse(nn.Module):
    """SeqMLP whose ``lin2.weight`` is also (``both``) or only (``only``) used through
    ``F.linear`` outside ``lin2``'s forward; ``mode=None`` is the plain SeqMLP."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, CLASSES)
        self.mode: str | None = "both"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin1(x))
        if self.mode is None:
            return self.lin2(h).mean(1)
        side = nn.functional.linear(h, self.lin2.weight)  # not through lin2's hooks
        if self.mode == "only":
            return (side + self.lin2.bias).mean(1)
        return (self.lin2(h) + side).mean(1)


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
    engine, module, opt, crit, _ = private(model, bookkeeping=bookkeeping)
    assert module.bookkeeping is bookkeeping
    x, y = batch()
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
    engine, module, opt, crit, _ = private(model)
    x, y = batch()
    for _ in range(2):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        crit(out.float(), y).backward()
        assert not module.private_step.uses.has_spans
        opt.step()
    assert len(engine.accountant) == 2


@pytest.mark.parametrize("mistake", ["plain_loss", "second_step"])
def test_step_without_a_clipping_backward_is_refused(mistake: str) -> None:
    """A plain ``nn.CrossEntropyLoss()(...).backward()`` (an Opacus user's habit; the hooks run
    but nobody applies the clip factors) or a second ``step()`` after one backward would noise
    gradients that are unclipped or already released: step() must refuse before accumulating,
    noising or accounting. A noise-only step on zero gradients (empty Poisson batch) stays
    allowed. With a tiny C the unclipped gradient is ~1e4 x C, so a silent step would move the
    parameters by far more than the clipped one could."""
    torch.manual_seed(0)
    model = SeqMLP()
    engine, module, opt, crit, _ = private(model, noise_multiplier=0.0)
    x, y = batch()
    if mistake == "plain_loss":
        (nn.CrossEntropyLoss()(module(x), y) * 1000).backward()
    else:
        crit(module(x), y).backward()
        opt.step()
        assert len(engine.accountant) == 1
    steps, theta = len(engine.accountant), params(model)
    with pytest.raises(RuntimeError, match="but no clip factors were computed for them"):
        opt.step()
    assert len(engine.accountant) == steps
    assert torch.equal(params(model), theta)
    opt.zero_grad()
    # The step protocol has no noise-only step without a private backward (issue 12): zero
    # gradients set by hand are refused too; an empty Poisson batch goes through backward.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="no clip factors were computed for them"):
        opt.step()
    assert len(engine.accountant) == steps
    opt.zero_grad()
    crit(module(x[:0]), y[:0]).backward()  # empty batch: a noise-only step
    opt.step()
    assert len(engine.accountant) == steps + 1
    opt.zero_grad()
    crit(module(x), y).backward()
    opt.step()
    assert len(engine.accountant) == steps + 2


def test_nan_gradient_reaching_the_optimizer_is_refused() -> None:
    """Last line of defence: a NaN/inf in a clipped gradient (however it got there) makes
    step() raise before noise is added or the step is accounted."""
    model = SeqMLP()
    engine, module, opt, crit, _ = private(model)
    crit(module(batch()[0]), batch()[1]).backward()
    model.lin1.weight.grad[0, 0] = float("inf")
    theta = params(model)
    with pytest.raises(FloatingPointError, match="contain NaN or inf; no step is taken"):
        opt.step()
    assert len(engine.accountant) == 0 and torch.equal(params(model), theta)


# --------------------------------------------------------------------------------------------
# eval mode after make_private
# --------------------------------------------------------------------------------------------


def test_eval_mode_after_make_private_raises_naming_the_module() -> None:
    """make_private rejects eval-mode models (test_eval_mode_model_raises); switching to eval()
    afterwards and training anyway gives an error naming the module, not a missing norm."""
    model = SeqMLP()
    engine, module, opt, crit, _ = private(model)
    x, y = batch()
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
    model = SeqMLP()
    engine, module, opt, crit, _ = private(model)
    x, y = batch()
    crit(module(x), y).backward()
    module.eval()
    with pytest.raises(RuntimeError, match=r"is in eval mode"):
        module(x).sum().backward()
    module.train()
    steps, theta = len(engine.accountant), params(model)
    with pytest.raises(RuntimeError, match="no step is taken and nothing is accounted"):
        opt.step()
    assert len(engine.accountant) == steps and torch.equal(params(model), theta)
    opt.zero_grad()
    crit(module(x), y).backward()
    opt.step()
    assert len(engine.accountant) == steps + 1


# --------------------------------------------------------------------------------------------
# a module used twice: exact-path modules sum their per-sample gradients over uses
# --------------------------------------------------------------------------------------------


class LayerNormTwice(nn.Module):
    """A LayerNorm applied twice (Opacus #578): exact per-sample gradients summed over uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, H)
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.lin(x))
        return self.head(self.norm(2 * torch.tanh(h)))


def test_reused_exact_module_sums_per_sample_gradients(microbatch_norms: Callable) -> None:
    """Sketched modules used twice raise naming the module (test_reused_module_raises_naming_it);
    a module on Opacus' exact path (LayerNorm) used twice gets the norm of the summed per-sample
    gradient, equal to the microbatch oracle."""
    torch.manual_seed(0)
    model = LayerNormTwice()
    reference = copy.deepcopy(model)
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, loss_reduction="sum")
    x = torch.randn(3, D)
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
    model = SeqMLP()
    reference = copy.deepcopy(model)
    engine, module, opt, crit, _ = private(model, sketch_dim=4096)
    x, y = batch()
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
    assert torch.isfinite(params(model)).all() and len(engine.accountant) == 1


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
    model = nn.Linear(D, H, bias=False)
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
    x = torch.zeros(3, T, D)
    x[1] = 1e14 * torch.randn(T, D)  # sample 1 only: its gradient is target_1^T x_1, ~1e30
    target = torch.zeros(3, T, H)
    target[1] = 1e15 * torch.randn(T, H)
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


# --------------------------------------------------------------------------------------------
# batch-broadcast position_ids (Opacus issue 841)
# --------------------------------------------------------------------------------------------

VOCAB = 11


class PositionModel(nn.Module):
    """GPT-2-like: token + learned position embeddings, position_ids of shape [1, T] by default."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(T, D)
        self.head = nn.Linear(D, CLASSES)
        self.expand_positions = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(ids.shape[1]).unsqueeze(0)  # [1, T], as Hugging Face
        if self.expand_positions:
            position_ids = position_ids.expand(ids.shape[0], -1)
        return self.head((self.wte(ids) + self.wpe(position_ids)).mean(1))


def token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (4, T), generator=g), torch.randint(
        0, CLASSES, (4,), generator=g
    )


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
    engine, module, opt, crit, _ = private(model, n=4, seq=False)
    ids, y = token_batch()
    with pytest.raises(ValueError, match="computed 1 clip factors for per-sample losses of shape"):
        crit(module(ids), y).backward()
    with pytest.raises(RuntimeError, match="nothing is accounted"):
        opt.step()


def test_per_token_loss_without_shape_raises() -> None:
    """A per-token loss (B*T values) without ``shape=``: B clip factors cannot be matched to
    B*T losses; Opacus would fail in a broadcast (or, for B = 1, silently pass)."""
    model = SeqMLP()
    model.forward = lambda x: model.lin2(torch.tanh(model.lin1(x)))  # (B, T, CLASSES)
    engine, module, opt, crit, _ = private(model)
    x, _ = batch()
    logits = module(x)
    tokens = torch.zeros(4 * T, dtype=torch.long)
    with pytest.raises(ValueError, match="pass shape=logits.shape"):
        crit(logits.reshape(-1, CLASSES), tokens).backward()
    opt.zero_grad()
    crit(module(x).reshape(-1, CLASSES), tokens, shape=(4, T, CLASSES)).backward()
    opt.step()
    assert len(engine.accountant) == 1


# --------------------------------------------------------------------------------------------
# gradient accumulation and BatchMemoryManager (Opacus #683, PR 707)
# --------------------------------------------------------------------------------------------


def test_second_backward_without_step_raises() -> None:
    """Opacus' two-pass loss zeroes gradients between its passes, so accumulating two
    backward() calls silently drops the first (#683). Here it raises and points to
    BatchMemoryManager; after step() or zero_grad() backward works again."""
    model = SeqMLP()
    engine, module, opt, crit, _ = private(model)
    x, y = batch()
    crit(module(x), y).backward()
    with pytest.raises(RuntimeError, match="BatchMemoryManager"):
        crit(module(x), y).backward()
    opt.step()
    opt.zero_grad()
    crit(module(x), y).backward()
    opt.step()
    assert len(engine.accountant) == 2


@pytest.mark.parametrize("seq", [False, True])
def test_batch_memory_manager_equals_logical_batches(fake_engine: Any, seq: bool) -> None:
    """Poisson logical batches split into physical batches of <= 2 by BatchMemoryManager:

    * one accountant step per logical batch, at the logical sample rate (PR 707, #683);
    * clip factors are decided per sample inside each physical batch, so the update equals
      one step per whole logical batch. seq=False: rank-2 inputs, exact norms, clipping
      active (C = 1, inputs scaled by 3), exact comparison. seq=True: sketched norms with
      C = 1e6 (every factor 1), which checks the accumulation of physical batches (the
      ``summed_grad`` aliasing of PR 707) on the sketched path.
    """
    torch.manual_seed(0)
    model = SeqMLP() if seq else FlatMLP()
    start = copy.deepcopy(model)
    C = 1e6 if seq else 1.0
    module, opt, crit, loader = fake_engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(dataset(24, seq=seq), batch_size=6),
        noise_multiplier=0.0,
        max_grad_norm=C,
        clipping="randomized",
        sketch_dim=4,
    )
    logical: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as bmm:
        for x, y in bmm:
            assert len(x) <= 2
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
            logical[-1].append((x, y))
            if not opt._is_last_step_skipped:
                logical.append([])
    logical.pop()
    history = fake_engine.accountant.history
    assert sum(n for _, _, n in history) == len(logical) == len(loader) == 4
    assert {q for _, q, _ in history} == {1 / len(loader)}
    assert any(len(chunks) > 1 for chunks in logical)

    gsm = GradSampleModuleRandomizedClipping(start, max_grad_norm=C, sketch_dim=4)
    ref_opt = RandomizedClipOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=0.5),
        grad_sample_module=gsm,
        noise_multiplier=0.0,
        max_grad_norm=C,
        expected_batch_size=opt.expected_batch_size,
    )
    ref_crit = DPLossRandomizedClipping(gsm, ref_opt, nn.CrossEntropyLoss())
    clipped = 0
    for chunks in logical:
        x = torch.cat([c[0] for c in chunks])
        y = torch.cat([c[1] for c in chunks])
        ref_crit(gsm(x), y).backward()
        clipped += int((gsm.per_sample_gradient_norms > C).sum())
        ref_opt.step()
        ref_opt.zero_grad()
    if not seq:
        assert clipped >= 5  # the clip factors matter
    torch.testing.assert_close(params(model), params(start), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# frozen parameters and exact-fallback logging
# --------------------------------------------------------------------------------------------


def test_frozen_parameters_get_no_noise_and_no_update() -> None:
    """A frozen base layer with a trainable adapter (LoRA-like): the frozen weights are neither
    noised nor updated; trainable ones are (no-probe check: test_frozen_weight_draws_no_probes)."""
    torch.manual_seed(0)
    model = SeqMLP()
    model.lin1.requires_grad_(False)
    frozen = model.lin1.weight.detach().clone()
    engine, module, opt, crit, _ = private(model)
    assert all(p.requires_grad for p in opt.params) and len(opt.params) == 2
    x, y = batch()
    trainable = model.lin2.weight.detach().clone()
    crit(module(x), y).backward()
    opt.step()
    assert torch.equal(model.lin1.weight, frozen) and model.lin1.weight.grad is None
    assert not torch.equal(model.lin2.weight, trainable)


class Scale(nn.Module):
    """A parameterised layer with no Opacus sampler (functorch fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def test_exact_fallback_is_logged_once_not_per_step(caplog: pytest.LogCaptureFixture) -> None:
    """Modules without a sketched sampler are logged (INFO) once, at construction, with the path
    they take; training steps log nothing (paths:
    test_exact_fallbacks_frozen_layers_and_logging)."""
    model = nn.Sequential(nn.Linear(D, H), Scale(), nn.Linear(H, CLASSES))
    logger = "opacus_rc.grad_sample.grad_sample_module"
    with caplog.at_level(logging.INFO, logger=logger):
        engine = PrivacyEngine()
        module, opt, crit, _ = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(dataset(8, seq=True), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            clipping="randomized",
        )
        at_construction = [r for r in caplog.records if r.name == logger]
        assert [r.args[0] for r in at_construction] == ["0", "1", "2"]
        assert "functorch fallback" in at_construction[1].getMessage()
        for _ in range(2):
            x, y = batch()
            crit(module(x).mean(1), y).backward()
            opt.step()
            opt.zero_grad()
    assert [r for r in caplog.records if r.name == logger] == at_construction


# --------------------------------------------------------------------------------------------
# unaccountable steps and post-processing in the wrong place
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clipping", ["randomized", "flat"])
def test_zero_noise_with_rc_accountant_is_never_an_unaccounted_step(
    clipping: str, assert_no_hooks: Callable
) -> None:
    """sigma = 0 has infinite epsilon. With the RC accountant the run is either refused by
    make_private before any hook is attached, or it steps with every step accounted and an
    infinite epsilon: never accepted and then failing (or unaccounted) at every step (issue
    14, item 6). Which of the two depends on whether RCAccountant records sigma = 0."""
    model = FlatMLP()
    engine = PrivacyEngine()
    args = {
        "module": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.5),
        "data_loader": DataLoader(dataset(16, seq=False), batch_size=4),
        "noise_multiplier": 0.0,
        "max_grad_norm": 1.0,
        "clipping": clipping,
    }
    try:
        out, messages = _make_private_recording_warnings(engine, **args)
    except ValueError as err:
        assert "cannot record a step without noise" in str(err)
        assert_no_hooks(model)
        assert len(engine.accountant) == 0 and engine.dataset is None
        return
    assert messages == [_ZERO_NOISE_WARNING]
    module, opt = out[0], out[1]
    crit = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    x, y = batch(seq=False)
    crit(module(x), y).backward()
    opt.step()
    assert len(engine.accountant) == 1 and engine.get_epsilon(1e-5) == float("inf")


_ZERO_NOISE_WARNING = (
    "noise_multiplier=0: no noise is added, so this run is not differentially private and its "
    "epsilon is infinite; use it for debugging only"
)


def _make_private_recording_warnings(engine: Any, **args: Any) -> tuple[Any, list[str]]:
    """``engine.make_private(**args)`` and the messages of the noise-multiplier warnings it
    gave (exceptions propagate)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = engine.make_private(**args)
    return out, [str(w.message) for w in record if "noise_multiplier" in str(w.message)]


def test_post_processing_refused_on_opacus_ddp_optimizers() -> None:
    """Opacus' DDP optimizers call step hooks before their all-reduce, where ranks > 0 hold an
    un-noised partial sum: a post-processing hook (the spectral denoiser) there would not be
    post-processing. attach_post_processing_hook refuses them; the randomized-clipping DDP
    optimizer reduces first (tests/distributed, scenario noise_once)."""
    from opacus.optimizers import DistributedDPOptimizer, DistributedDPOptimizerFastGradientClipping

    from opacus_rc.optimizers import attach_post_processing_hook

    for cls in (DistributedDPOptimizer, DistributedDPOptimizerFastGradientClipping):
        opt = object.__new__(cls)  # no process group here; only the type matters
        opt.step_hook = None
        with pytest.raises(ValueError, match="before its gradient all-reduce"):
            attach_post_processing_hook(opt, lambda o: None)


def test_loss_arithmetic_keeps_the_checks() -> None:
    """``loss * w + c`` (weighted or combined losses) keeps the randomized-clipping backward,
    with its checks (here: accumulation)."""
    from opacus_rc.optimizers import DPTensorRandomizedClipping

    model = SeqMLP()
    engine, module, opt, crit, _ = private(model)
    x, y = batch()
    loss = 0.5 * crit(module(x), y) / 2 + 1.0 - 0.0
    assert isinstance(loss, DPTensorRandomizedClipping)
    loss.backward()
    with pytest.raises(RuntimeError, match="BatchMemoryManager"):
        (-crit(module(x), y)).backward()
    opt.step()
    assert len(engine.accountant) == 1


# ============================================================================================
# Issue 14, engine items (4, 5, 6); items 10 and 11 (the README) are in test_privacy_engine.py
# ============================================================================================


class _ZeroNoiseAccountant(RDPAccountant):
    """A stand-in for an RC accountant that records sigma = 0 steps with an infinite epsilon
    (Opacus' RDP does: its RDP at sigma = 0 is infinite), and records each step's sketch spec."""

    supports_randomized_clipping = True

    def __init__(self) -> None:
        super().__init__()
        self.specs: list[Any] = []

    def step(self, *, noise_multiplier: float, sample_rate: float, sketch_spec: Any = None) -> None:
        self.specs.append(sketch_spec)
        super().step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        def hook_fn(optim: Any) -> None:
            self.step(
                noise_multiplier=optim.noise_multiplier,
                sample_rate=sample_rate * optim.accumulated_iterations,
                sketch_spec=getattr(optim, "sketch_spec", None),
            )

        return hook_fn


class _RefusesZeroNoise(_ZeroNoiseAccountant):
    """Refuses sigma = 0 in ``step`` with RCAccountant's message (the RC accountant today)."""

    def step(self, *, noise_multiplier: float, sample_rate: float, sketch_spec: Any = None) -> None:
        if not noise_multiplier > 0:
            raise ValueError(
                f"noise_multiplier must be a finite number > 0, got {noise_multiplier}"
            )
        super().step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)


class _FiniteAtZeroNoise(_ZeroNoiseAccountant):
    """Records sigma = 0 but reports a finite epsilon: a claim that would not hold."""

    def get_epsilon(self, delta: float, *args: Any, **kwargs: Any) -> float:
        return 1.0


def _engine_with(accountant: Any) -> PrivacyEngine:
    engine = PrivacyEngine(accountant="prv")
    engine.accountant = accountant
    return engine


@pytest.mark.filterwarnings("ignore:Optimal order is the smallest alpha")
def test_zero_noise_is_a_debugging_run_with_infinite_epsilon() -> None:
    """Issue 14, item 6, the decided behaviour: sigma = 0 with an accountant that records it.
    make_private warns once (not per step); steps work and add no noise (two runs with
    different noise generators end at the same, moved parameters; rank-2 inputs, so the norms
    are exact and the runs deterministic); every step is accounted with its sketch spec; the
    epsilon is infinite."""
    finals = []
    for noise_seed in (1, 2):
        torch.manual_seed(0)
        model = FlatMLP()
        theta = params(model)
        engine = _engine_with(_ZeroNoiseAccountant())
        loader = DataLoader(dataset(16, seq=False), batch_size=4)
        (module, opt, crit, loader), messages = _make_private_recording_warnings(
            engine,
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            clipping="randomized",
            noise_generator=torch.Generator().manual_seed(noise_seed),
        )
        assert messages == [_ZERO_NOISE_WARNING]
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="noise_multiplier=0")
            for seed in (1, 2):
                x, y = batch(seq=False, seed=seed)
                crit(module(x), y).backward()
                opt.step()
                opt.zero_grad()
        assert engine.accountant.history == [(0.0, 1 / len(loader), 2)]
        assert engine.accountant.specs == [module.sketch_spec] * 2
        assert engine.get_epsilon(1e-5) == float("inf")
        assert not torch.equal(params(model), theta)
        finals.append(params(model))
    assert torch.equal(finals[0], finals[1])


@pytest.mark.parametrize(
    ("accountant", "match"),
    [
        pytest.param(
            _RefusesZeroNoise,
            r"noise_multiplier=0: the 'rdp' accountant cannot record a step without noise "
            r"\(ValueError: noise_multiplier must be a finite number > 0, got 0.0\), so every "
            r"optimizer step would fail. Pass a noise_multiplier > 0",
            id="refuses_the_step",
        ),
        pytest.param(
            _FiniteAtZeroNoise,
            r"reports a finite epsilon \(1 at delta=1e-05\) for a step without noise",
            id="finite_epsilon",
        ),
    ],
)
@pytest.mark.parametrize("clipping", ["randomized", "flat"])
def test_zero_noise_refused_up_front_when_the_accountant_cannot_account_it(
    accountant: type, match: str, clipping: str, assert_no_hooks: Callable
) -> None:
    """Issue 14, item 6: before, make_private accepted sigma = 0 and then every step() raised
    in the RC accountant's hook. An accountant that cannot record a noiseless step (or would
    give it a finite epsilon) now makes make_private raise, before any hook, saying what to
    do; the accountant itself is not touched (the check runs on a copy)."""
    model = FlatMLP()
    engine = _engine_with(accountant())
    with pytest.raises(ValueError, match=match):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(dataset(16, seq=False), batch_size=4),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            clipping=clipping,
        )
    assert_no_hooks(model)
    assert engine.accountant.history == [] and engine.accountant.specs == []
    assert engine.dataset is None


def test_zero_noise_with_the_rc_accountant_runs_with_infinite_epsilon() -> None:
    """Issue 14, item 6 and issue 20, item 9 with the real RC accountant: a sigma = 0
    debugging run with randomized clipping steps, every step is accounted (with its sketch
    spec), epsilon is infinite. Before, RCAccountant refused sigma = 0, so the engine refused
    the run up front and advised "an accountant that records sigma = 0", while every other
    accountant is refused for randomized clipping. The accountant warns once, at its first
    noiseless step (the engine's warning at make_private is the only one there)."""
    model = FlatMLP()
    engine = PrivacyEngine()
    (module, opt, crit, _), messages = _make_private_recording_warnings(
        engine,
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(dataset(16, seq=False), batch_size=4),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        clipping="randomized",
    )
    assert messages == [_ZERO_NOISE_WARNING]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for seed in (1, 2):
            x, y = batch(seq=False, seed=seed)
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
    noiseless = [str(w.message) for w in record if "without noise" in str(w.message)]
    assert len(noiseless) == 1 and "get_epsilon() is inf" in noiseless[0]
    assert len(engine.accountant) == 2 and engine.get_epsilon(1e-5) == float("inf")
    ((event, steps),) = engine.accountant.ledger
    assert steps == 2 and event.noise_multiplier == 0.0
    assert event.sketch_spec == module.sketch_spec and event.sketch_spec is not None


def test_make_private_with_epsilon_accepts_rand_on_empty() -> None:
    """Issue 14, item 5: make_private_with_epsilon(rand_on_empty=True, clipping="randomized")
    raised "unexpected keyword arguments" although make_private accepts it. Now it reaches the
    Poisson loader: 4 records at q = 1/4 give an empty batch with probability 0.75^4 = 0.32
    per draw, so 40 draws without rand_on_empty would contain one with probability
    1 - 0.68^40 > 0.9999; with it, every batch holds one random record instead. A step on such
    a batch is clipped and accounted."""
    torch.manual_seed(0)
    model = FlatMLP()
    engine = PrivacyEngine()
    module, opt, crit, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(dataset(4, seq=False), batch_size=1),
        target_epsilon=8.0,
        target_delta=1e-5,
        epochs=1,
        max_grad_norm=1.0,
        clipping="randomized",
        rand_on_empty=True,
    )
    sizes = [len(x) for _ in range(10) for x, _ in loader]
    assert len(sizes) == 40 and min(sizes) >= 1
    x, y = next(iter(loader))
    crit(module(x), y).backward()
    opt.step()
    assert len(engine.accountant) == 1 and opt.noise_multiplier > 0


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


# ----------------------------------------------------------------------------------------------
# Issue 14, items 3, 7 and 9 (lead)
# ----------------------------------------------------------------------------------------------


class _InplaceReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.act = nn.ReLU(inplace=True)
        self.lin2 = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.act(self.lin1(x))).mean(1)


class _InplaceAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, D)
        self.lin2 = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin1(x)
        h += x
        return self.lin2(h).mean(1)


@pytest.mark.parametrize(
    ("factory", "advice"),
    [(_InplaceReLU, r"\['act'\]: set inplace=False"), (_InplaceAdd, "h = h \\+ x")],
)
def test_inplace_ops_on_hooked_outputs_get_a_clear_error(factory: Any, advice: str) -> None:
    """Issue 14, item 3: PyTorch's 'Output 0 of BackwardHookFunction is a view and is being
    modified inplace' (whose advice does not apply) becomes an error naming the inplace=True
    modules and the fix; nothing is stepped or accounted."""
    torch.manual_seed(0)
    engine, module, opt, crit, _ = private(factory())
    x, y = batch()
    with pytest.raises(RuntimeError, match=advice):
        crit(module(x), y).backward()
    assert len(engine.accountant) == 0


def test_private_backward_does_not_warn_about_output_hooks() -> None:
    """Issue 14, item 9: the lowest hooked layer's inputs need no gradient, so PyTorch warned
    'Full backward hook is firing when gradients are computed with respect to module outputs'
    at every step, from our own loss; nothing for the user to act on, so it is silenced there."""
    torch.manual_seed(0)
    engine, module, opt, crit, _ = private(SeqMLP())
    x, y = batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        crit(module(x), y).backward()
        opt.step()
    assert not [w for w in caught if "Full backward hook is firing" in str(w.message)]
    assert len(engine.accountant) == 1


class _MaskedCE(nn.Module):
    """A criterion that masks padding itself and has no ignore_index attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.reduction = "mean"

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(logits, target.clamp(min=0), reduction="none")
        loss = loss * (target >= 0)
        return loss if self.reduction == "none" else loss.mean()


def test_criterion_without_ignore_index_warns_once() -> None:
    """Issue 14, item 7: with shape=, Opacus averages a per-token loss over all positions when
    the criterion has no ignore_index (masked positions' zero losses count in the mean); this
    warns once, naming the fix. nn.CrossEntropyLoss does not warn."""
    torch.manual_seed(0)
    model = SeqMLP()
    x, y = batch()
    per_token = torch.full((4, 3), -1, dtype=torch.long)
    per_token[:, 0] = y
    for criterion, warns in ((nn.CrossEntropyLoss(ignore_index=-1), False), (_MaskedCE(), True)):
        engine, module, opt, crit, _ = private(copy.deepcopy(model), criterion=criterion)
        logits = module(x).unsqueeze(1).expand(4, 3, CLASSES)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                crit(logits.reshape(-1, CLASSES), per_token.reshape(-1), shape=(4, 3))
        hits = [w for w in caught if "has no ignore_index attribute" in str(w.message)]
        assert len(hits) == (1 if warns else 0)
        module.private_step.reset()
