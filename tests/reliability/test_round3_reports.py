"""Issue 20, "What to build": ten more public reports (2024-2026), tried on opacus_rc.

Each test reproduces one report (its repository#number is in the test's comment and in
CATALOGUE.md, section "Round 3 (reports)") as a small input: tiny models on the CPU, checked
against a float64 oracle that computes one sample at a time with plain autograd (no hooks),
with no noise (sigma = 0) and clipping active, or against an independent
reference for accounting. Where the right answer is an error, the test checks the error and
its advice, and that the step after it works.
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

D, H, K, B = 5, 6, 3, 4
C = 0.5  # max_grad_norm: below every per-sample norm of these inputs, so clipping is active
SIGMA = 0.0  # no noise: the released gradient is the clipped sum (epsilon is infinite)


class MLP(nn.Module):
    """Two linear layers on (B, D) inputs: rank-2 inputs, so every norm is exact."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)))


def loader(n: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, D, generator=g) * 3, torch.randint(0, K, (n,), generator=g))
    return DataLoader(ds, batch_size=B)


def private(model: nn.Module, *, lr: float = 0.5, **kwargs: Any) -> tuple[Any, ...]:
    """``(engine, module, optimizer, criterion)`` of randomized clipping on ``model``."""
    engine = PrivacyEngine()
    args: dict[str, Any] = {
        "noise_multiplier": SIGMA,
        "max_grad_norm": C,
        "clipping": "randomized",
        "sketch_dim": 8,
    }
    args.update(kwargs)
    trainable = [p for p in model.parameters() if p.requires_grad]
    module, opt, crit, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(trainable, lr=lr), data_loader=loader(), **args
    )
    return engine, module, opt, crit


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, D, generator=g) * 3, torch.randint(0, K, (B,), generator=g)


def float64_copy(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model`` without any hook (a hooked model's copy would run the
    original's hooks): a fresh instance of its class with its state, or a deep copy (for a
    modified instance) with the hooks removed."""
    state = {k: v.detach().double() for k, v in model.state_dict().items()}
    try:
        ref = type(model)().double()
        ref.load_state_dict(state)
    except (TypeError, RuntimeError):
        ref = copy.deepcopy(model).double()
    for (_, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        r.requires_grad_(p.requires_grad)
    for m in ref.modules():
        for hooks in (
            m._forward_hooks,
            m._forward_pre_hooks,
            m._backward_hooks,
            m._backward_pre_hooks,
        ):
            hooks.clear()
    return ref


def clipped_sum_oracle(
    model: nn.Module,
    x: torch.Tensor,
    loss_of_sample: Callable[[nn.Module, int], torch.Tensor],
    *,
    c: float = C,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """float64 ``sum_i min(1, c/||g_i||) g_i`` over the trainable parameters, one autograd
    call per sample on a float64 copy without hooks; also the per-sample norms ``||g_i||``.
    This is ``p.grad`` after the private backward (the optimizer divides by the expected batch
    size at ``step()``)."""
    ref = float64_copy(model)
    named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    total = {n: torch.zeros_like(p) for n, p in named}
    norms = []
    for i in range(len(x)):
        grads = torch.autograd.grad(loss_of_sample(ref, i), [p for _, p in named])
        norm = float(torch.sqrt(sum((g**2).sum() for g in grads)))
        norms.append(norm)
        for (n, _), g in zip(named, grads, strict=True):
            total[n] += min(1.0, c / norm) * g
    return total, norms


def assert_grads_equal(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for n, p in model.named_parameters():
        if n in expected:
            torch.testing.assert_close(p.grad.double(), expected[n], rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------
# meta-pytorch/opacus PR 668 (2024-08): the DP loss got tensor arithmetic ("loss + other") so
# that ghost clipping's loss behaves like PyTorch's. Adding a plain batch-level tensor that
# requires grad broadcasts it into every sample's loss.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bookkeeping", [True, False], ids=["book-keeping", "two-passes"])
@pytest.mark.parametrize(
    "combine",
    [
        lambda crit, out, y, model: crit(out, y) + nn.functional.cross_entropy(out, (y + 1) % K),
        lambda crit, out, y, model: crit(out, y) + 0.01 * (model.lin1.weight**2).sum(),
        lambda crit, out, y, model: crit(out, y) * model.lin2.bias.sum().exp(),
    ],
    ids=["plus-batch-mean-loss", "plus-weight-penalty", "times-parameter"],
)
def test_batch_level_tensor_in_the_dp_loss_is_refused(bookkeeping: bool, combine: Any) -> None:
    """Before: ``crit(out, y) + F.cross_entropy(out, y2)`` was accepted. With two backward
    passes the released gradient was ``sum_i c_i g_i + mean(c) sum_j g'_j``: one sample's
    ``g'`` is scaled by the mean clip factor, not its own (measured: a released norm of 962
    for a bound of B C = 2, one sample's input scaled by 1000). With book-keeping the numbers
    happened to be right for this separable term, but a penalty of the weights reached the
    loss of every sample. Now the arithmetic raises a TypeError naming the fix, and the
    per-sample form (two DP losses added, or a (B,) tensor) equals the float64 oracle."""
    torch.manual_seed(0)
    model = MLP()
    engine, module, opt, crit = private(model, lr=0.0, bookkeeping=bookkeeping)
    x, y = batch()
    with pytest.raises(TypeError, match=r"requires grad.*every sample's loss.*weight_decay"):
        combine(crit, module(x), y, model)
    y2 = (y + 1) % K
    # The per-sample forms: two DP losses, and a per-sample tensor of shape (B,).
    expected, _ = clipped_sum_oracle(
        model,
        x,
        lambda ref, i: (
            nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1])
            + nn.functional.cross_entropy(ref(x[i : i + 1].double()), y2[i : i + 1])
        ),
    )
    out = module(x)
    (crit(out, y) + crit(out, y2)).backward()
    assert_grads_equal(model, expected)
    opt.step()
    opt.zero_grad()
    out = module(x)
    per_sample = nn.functional.cross_entropy(out, y2, reduction="none")
    (crit(out, y) + per_sample).backward()
    assert_grads_equal(model, expected)
    opt.step()
    assert len(engine.accountant) == 2


def hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules()
    )


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
    dora = peft.get_peft_model(MLP(), peft.LoraConfig(r=2, target_modules=["lin1"], use_dora=True))
    hooks = hook_count(dora)
    with pytest.raises(
        UnsupportedModuleError, match=r"DoRA.*'base_model.model.lin1'.*use_dora=False"
    ):
        private(dora)
    assert hook_count(dora) == hooks
    torch.manual_seed(0)
    lora = peft.get_peft_model(MLP(), peft.LoraConfig(r=2, target_modules=["lin1"]))
    with torch.no_grad():  # B = 0 at peft's initialisation: make both factors matter
        lora.base_model.model.lin1.lora_B.default.weight.normal_()
    # float64 oracle on a copy of the adapted model made before any hook, one sample at a time
    ref = copy.deepcopy(lora.base_model.model).double()
    x, y = batch()
    ref_named = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    expected = {n: torch.zeros_like(p) for n, p in ref_named.items()}
    for i in range(B):
        loss = nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(ref_named.values()))
        factor = min(1.0, C / float(torch.sqrt(sum((g**2).sum() for g in grads))))
        for n, g in zip(ref_named, grads, strict=True):
            expected[n] += factor * g
    engine, module, opt, crit = private(lora, lr=0.0)
    named = {n: p for n, p in lora.base_model.model.named_parameters() if p.requires_grad}
    assert set(named) == set(expected)
    crit(module(x), y).backward()
    for n, p in named.items():  # float32 step against float64: a few ulps of the gradients
        torch.testing.assert_close(p.grad.double(), expected[n], rtol=1e-4, atol=1e-6)
    opt.step()
    assert len(engine.accountant) == 1


# --------------------------------------------------------------------------------------------
# pytorch/pytorch#117925 (2024-01): module hooks do not run when ``module.forward(x)`` is called
# instead of ``module(x)``.
# --------------------------------------------------------------------------------------------


class ForwardCalledDirectly(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2.forward(torch.tanh(self.lin1(x)))


@pytest.mark.parametrize("bookkeeping", [True, False], ids=["book-keeping", "two-passes"])
def test_submodule_forward_called_directly_is_named_in_the_error(bookkeeping: bool) -> None:
    """``self.lin2.forward(h)`` skips lin2's hooks, so its parameters get a gradient that no
    per-sample norm covers. Before: refused, but the error named only ``F.linear(h,
    model.fc.weight)`` as the cause. Now it also names ``model.fc.forward(h)`` and says to call
    the module itself; nothing is noised or accounted, and after ``zero_grad()`` the step of
    the corrected model equals the float64 oracle."""
    torch.manual_seed(0)
    model = ForwardCalledDirectly()
    engine, module, opt, crit = private(model, lr=0.0, bookkeeping=bookkeeping)
    x, y = batch()
    with pytest.raises(RuntimeError, match=r"'lin2.weight'.*model\.fc\.forward\(h\).*hooks"):
        crit(module(x), y).backward()
    with pytest.raises(RuntimeError):
        opt.step()
    assert len(engine.accountant) == 0
    opt.zero_grad()
    model.forward = MLP.forward.__get__(model)  # the corrected forward: self.lin2(h)
    expected, _ = clipped_sum_oracle(  # the oracle's copy has no hooks: .forward() is exact
        model,
        x,
        lambda ref, i: nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1]),
    )
    crit(module(x), y).backward()
    assert_grads_equal(model, expected)
    opt.step()
    assert len(engine.accountant) == 1


# --------------------------------------------------------------------------------------------
# meta-pytorch/opacus#792 (2025-10): "Fast gradient clipping ignores masking": each sample's
# per-token loss was averaged over all T positions, ignore_index ones included. Opacus' fix
# reads the targets from the second positional argument only.
# --------------------------------------------------------------------------------------------

V, T = 7, 5
SKETCH_K = 8192


class TinyLM(nn.Module):
    """Embedding, then a linear head on (B, T, d): the head's norm is sketched."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.head = nn.Linear(H, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def lm_loader() -> DataLoader:
    ids = torch.randint(0, V, (16, T), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids, ids), batch_size=B)


@pytest.mark.parametrize(
    "call",
    [
        lambda crit, logits, labels: crit(
            logits.reshape(-1, V), labels.reshape(-1), shape=logits.shape
        ),
        lambda crit, logits, labels: crit(
            logits.reshape(-1, V), target=labels.reshape(-1), shape=logits.shape
        ),
        lambda crit, logits, labels: crit(
            input=logits.reshape(-1, V), target=labels.reshape(-1), shape=logits.shape
        ),
    ],
    ids=["positional", "target-keyword", "both-keywords"],
)
def test_per_token_loss_leaves_ignored_positions_out_of_each_mean(call: Any) -> None:
    """Labels with ignore_index = -100 at 3, 5 (all) and 1 of the T = 5 positions of three
    samples. Each sample's loss must be the mean over its own non-ignored positions (0 for the
    fully ignored one). Before: correct by position, but with ``target=`` passed by keyword
    Opacus' ignore_index branch was skipped: sample 0's loss was 0.681 instead of 1.703 (2 of
    5 positions), and no warning (the criterion has an ignore_index). Now the same for all
    three call forms: the per-sample losses equal the float64 masked means to float32 rounding,
    and the per-sample gradient norms equal the float64 oracle's within the sketch's spread
    (k = 8192, see below)."""
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model).double()
    engine = PrivacyEngine()
    module, opt, crit, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=lm_loader(),
        noise_multiplier=SIGMA,
        max_grad_norm=C,
        clipping="randomized",
        sketch_dim=SKETCH_K,
        criterion=nn.CrossEntropyLoss(ignore_index=-100),
    )
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    labels = ids.roll(1, dims=1)
    labels[0, 2:] = -100
    labels[1, :] = -100
    labels[2, 4:] = -100
    oracle_losses, oracle_norms = [], []
    for i in range(B):
        keep = labels[i] != -100
        if keep.any():
            loss = nn.functional.cross_entropy(ref(ids[i : i + 1])[0][keep], labels[i][keep])
            grads = torch.autograd.grad(loss, list(ref.parameters()))
            oracle_losses.append(float(loss))
            oracle_norms.append(float(torch.sqrt(sum((g**2).sum() for g in grads))))
        else:
            oracle_losses.append(0.0)
            oracle_norms.append(0.0)
    logits = module(ids)
    loss = call(crit, logits, labels)
    torch.testing.assert_close(
        loss.loss_per_sample.double(), torch.tensor(oracle_losses, dtype=torch.float64)
    )
    loss.backward()
    norms = module.per_sample_gradient_norms.double()
    # The head's squared norm is a Hutchinson estimate with k Gaussian probes: relative
    # standard deviation at most sqrt(2/k), so the norm's is at most sqrt(1/(2k)) (delta
    # method), 0.0078 at k = 8192; the embedding's part is exact. 6 standard deviations.
    torch.testing.assert_close(
        norms,
        torch.tensor(oracle_norms, dtype=torch.float64),
        rtol=6 * (2 * SKETCH_K) ** -0.5,
        atol=1e-6,
    )
    opt.step()
    assert len(engine.accountant) == 1


def ce_of_sample(x: torch.Tensor, y: torch.Tensor) -> Callable[[nn.Module, int], torch.Tensor]:
    return lambda ref, i: nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1])


# --------------------------------------------------------------------------------------------
# meta-pytorch/opacus#834 (2026-07): len(accountant) returned the number of history entries
# (distinct (sigma, q) pairs), 1 after 100 steps, instead of the number of steps.
# --------------------------------------------------------------------------------------------


def test_len_of_the_accountant_counts_steps_not_history_entries() -> None:
    """The RC accountant's history is compressed as in Opacus (one entry per run of equal
    steps), but ``len`` sums the counts: 100 equal steps give 1 entry and len 100; a change of
    q opens a second entry. Through the engine, three equal optimizer steps give len 3 (the
    trainer integration compares len(accountant) with the planned number of steps)."""
    from opacus_rc.accountants import RCAccountant

    accountant = RCAccountant()
    for _ in range(100):
        accountant.step(noise_multiplier=1.0, sample_rate=0.01)
    assert (len(accountant.history), len(accountant)) == (1, 100)
    for _ in range(7):
        accountant.step(noise_multiplier=1.0, sample_rate=0.02)
    assert (len(accountant.history), len(accountant)) == (2, 107)
    torch.manual_seed(0)
    engine, module, opt, crit = private(MLP())
    x, y = batch()
    for _ in range(3):
        crit(module(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert (len(engine.accountant.history), len(engine.accountant)) == (1, 3)


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
    model = MLP()
    engine, module, opt, crit = private(model, lr=0.0, bookkeeping=bookkeeping)
    x, y = batch()
    model.lin1.weight.requires_grad_(False)
    frozen = model.lin1.weight.detach().clone()
    expected, _ = clipped_sum_oracle(model, x, ce_of_sample(x, y))
    assert "lin1.weight" not in expected
    crit(module(x), y).backward()
    assert model.lin1.weight.grad is None
    assert_grads_equal(model, expected)
    opt.param_groups[0]["lr"] = 0.5
    opt.step()
    assert torch.equal(model.lin1.weight, frozen)
    assert len(engine.accountant) == 1


# --------------------------------------------------------------------------------------------
# meta-pytorch/opacus#740 (2025-03): mixed precision, "RuntimeError: expected scalar type
# BFloat16 but found Float" when activations are bf16 and backprops float32.
# --------------------------------------------------------------------------------------------


class NormMLP(nn.Module):
    """Linear, LayerNorm (Opacus' grad sampler), Linear: rank-2 inputs, exact norms."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.norm = nn.LayerNorm(H)
        self.lin2 = nn.Linear(H, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.norm(torch.tanh(self.lin1(x))))


def test_bf16_model_norms_match_the_oracle_within_bf16_rounding() -> None:
    """A model cast to bfloat16 (weights, activations and gradients bf16, no autocast): the
    step runs, the per-sample norms are float32 and equal the float64 oracle (on the same bf16
    weights, in float64 arithmetic) within bf16 rounding: a relative 2**-8 per rounding, a few
    dozen roundings along the forward and backward of these three layers, so 5%; the update
    is finite and accounted."""
    torch.manual_seed(0)
    model = NormMLP().to(torch.bfloat16)
    x, y = batch()
    x = x.to(torch.bfloat16)
    _, oracle_norms = clipped_sum_oracle(model, x, ce_of_sample(x, y))
    engine, module, opt, crit = private(model)
    crit(module(x), y).backward()
    norms = module.per_sample_gradient_norms
    assert norms.dtype in (torch.float32, torch.float64)
    torch.testing.assert_close(
        norms.double(), torch.tensor(oracle_norms, dtype=torch.float64), rtol=0.05, atol=0.0
    )
    assert min(oracle_norms) > C  # clipping is active
    opt.step()
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in model.parameters())
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
    model = MLP()
    engine, module, opt, crit = private(model)
    x, y = batch()
    state = {k: v.clone() + 0.1 for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    with pytest.raises(RuntimeError, match=r"replaced or tied after the model was made private"):
        crit(module(x), y).backward()
    with pytest.raises(RuntimeError):
        opt.step()
    assert len(engine.accountant) == 0
    torch.manual_seed(0)
    model = MLP()
    engine, module, opt, crit = private(model)
    model.load_state_dict(state)  # in place: the optimizer's parameters
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    crit(module(x), y).backward()
    opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert len(engine.accountant) == 1


# --------------------------------------------------------------------------------------------
# meta-pytorch/opacus PR 664 (2024-08): the privacy engine did not pass max_grad_norm to fast
# gradient clipping, so every run clipped at the default.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_grad_norm", [0.05, 1.5, 50.0])
def test_max_grad_norm_is_the_clipping_bound_used(max_grad_norm: float) -> None:
    """For C = 0.05 (every sample clipped), 1.5 (some) and 50 (none), the module, the optimizer
    and the clipped gradient all use the C given to make_private: ``p.grad`` equals the float64
    oracle ``sum_i min(1, C/||g_i||) g_i``."""
    torch.manual_seed(0)
    model = MLP()
    engine, module, opt, crit = private(model, lr=0.0, max_grad_norm=max_grad_norm)
    assert opt.max_grad_norm == max_grad_norm
    x, y = batch()
    expected, norms = clipped_sum_oracle(model, x, ce_of_sample(x, y), c=max_grad_norm)
    clipped = sum(n > max_grad_norm for n in norms)
    assert clipped == {0.05: B, 50.0: 0}.get(max_grad_norm, clipped)
    crit(module(x), y).backward()
    assert_grads_equal(model, expected)
    opt.step()
    assert len(engine.accountant) == 1


# --------------------------------------------------------------------------------------------
# huggingface/peft PR 3382 (2026-07): an optimizer wrapper whose step(closure) let the closure
# recompute the gradients after the wrapper had changed them (there: the preconditioning was
# silently dropped; for DP the noise and clipping would be, as in meta-pytorch/opacus PR 330).
# --------------------------------------------------------------------------------------------


def test_step_with_a_closure_clips_and_noises_the_closures_gradient() -> None:
    """``opt.step(closure)``, the closure running zero_grad, forward and the DP backward (as
    PyTorch Lightning's automatic optimization does): one accounted step whose update is
    ``-lr * clipped_sum / B`` with the float64 oracle's clipped sum (sigma = 0), the same as
    without a closure."""
    torch.manual_seed(0)
    model = MLP()
    lr = 0.5
    engine, module, opt, crit = private(model, lr=lr)
    x, y = batch()
    expected, _ = clipped_sum_oracle(model, x, ce_of_sample(x, y))
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}

    def closure() -> Any:
        opt.zero_grad()
        loss = crit(module(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    for n, p in model.named_parameters():
        torch.testing.assert_close(
            p.detach().double(), before[n] - lr * expected[n] / B, rtol=1e-5, atol=1e-6
        )
    assert len(engine.accountant) == 1


# --------------------------------------------------------------------------------------------
# meta-pytorch/opacus#673 (2024-09): GradSampleModuleFastGradientClipping silently ignored the
# strict and force_functorch arguments (the user wanted strict=False for BatchNorm).
# --------------------------------------------------------------------------------------------


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, H)
        self.bn = nn.BatchNorm1d(H)
        self.out = nn.Linear(H, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.lin(x)))


@pytest.mark.parametrize("option", ["strict", "force_functorch"])
def test_strict_and_force_functorch_are_refused_by_name_not_ignored(option: str) -> None:
    """Passing ``strict=False`` or ``force_functorch=True`` to make_private with randomized
    clipping raises a TypeError naming the option (never accepted and ignored), before any hook
    is attached; BatchNorm (which mixes the samples of a batch) stays refused with the default
    options."""
    model = NormMLP()
    hooks = hook_count(model)
    value = option == "force_functorch"
    with pytest.raises(TypeError, match=rf"unexpected keyword arguments.*'{option}'"):
        private(model, **{option: value})
    assert hook_count(model) == hooks
    with pytest.raises(Exception, match=r"BatchNorm"):
        private(WithBatchNorm())


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
    model = MLP()
    model.lin1 = parametrization(nn.Linear(D, H, bias=bias))
    hooks = hook_count(model)
    with pytest.raises(
        UnsupportedModuleError,
        match=r"parametrized tensors.*'lin1.weight'.*remove_parametrizations",
    ):
        private(model)
    assert hook_count(model) == hooks
    parametrize.remove_parametrizations(model.lin1, "weight")
    x, y = batch()
    expected, _ = clipped_sum_oracle(model, x, ce_of_sample(x, y))
    engine, module, opt, crit = private(model, lr=0.0)
    crit(module(x), y).backward()
    assert_grads_equal(model, expected)
    opt.step()
    assert len(engine.accountant) == 1
