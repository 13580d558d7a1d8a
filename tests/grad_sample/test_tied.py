"""A weight tied between an input embedding and an LM head (issue 13, item 3).

SmolLM2, Llama 3.2 1B and Gemma tie ``lm_head.weight`` to ``embed_tokens.weight``. For sample
``i`` autograd gives the shared ``W`` the summed gradient ``M_i = E_i + H_i`` (embedding part
plus head part), and the clip factor needs ``||M_i||_F``, not ``sqrt(||E_i||^2 + ||H_i||^2)``.
The module sketches ``M_i`` jointly with one per-sample probe ``Omega_i`` (``d x k``):
``n_hat_i = ||M_i Omega_i||_F^2`` (opacus_rc/grad_sample/tied.py).

Oracles are float64 per-sample gradients from a batch-size-1 backward loop on a float64 copy of
the model (autograd sums the two uses of the tied weight itself).

Tolerance of the statistical checks (k = 4096). For one sketched part, ``n_hat / n`` is a convex
combination of iid ``chi2_k / k`` (docs/privacy/estimators.md#estimators-hutchinson), so ``Var(n_hat
/ n) <= 2 / k``; the total over layers is again such a combination (independent sketches) plus an
exact atom, so its variance is <= 2/k too. The norm ``sqrt(n_hat)`` then has relative standard
deviation <= ``sqrt(2/k) / 2 = 0.011`` (first order), and ``RTOL = 0.06`` is more than five standard
deviations. The sketch generator is seeded, so the tests are deterministic. Each check is paired
with the norm that ignores the cross term ``2 <E_i, H_i>``, which differs from the oracle by more
than ``RTOL``: the check can fail.

Before this, every test here failed at construction with ``NotImplementedError`` ("tied between
modules 'model.embed_tokens' (Embedding), 'lm_head' (Linear)").
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc import PrivacyEngine
from opacus_rc.grad_sample import (
    GradSampleHooksRandomizedClipping,
    GradSampleModuleRandomizedClipping,
)
from opacus_rc.grad_sample.routing import NormPath
from opacus_rc.grad_sample.tied import JointSketch, tied_hutchinson_sqnorm
from opacus_rc.optimizers import DPLossRandomizedClipping, RandomizedClipOptimizer
from opacus_rc.sketching import draw_gaussian_probes

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiny_hf_models as hf  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:a sketch_generator was passed:UserWarning"),  # seeded
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated"),
]

V, B, T = 48, 3, 10
K = 4096
RTOL = 0.06  # > 5 standard deviations of the norm at k = 4096 (module docstring)


def tiny_llama() -> nn.Module:
    model = hf.llama(vocab=V, tie=True, pad_token_id=0).train()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.padding_idx == 0
    return model


def tiny_gpt2() -> nn.Module:
    model = hf.gpt2(vocab=V, tie=True, bos_token_id=1, eos_token_id=1).train()
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def token_ids() -> torch.Tensor:
    """Repeated tokens and Llama's pad id 0 in the text (right padding, and one inside). The
    periodic sample makes the cross term large: its next-token targets are its own inputs."""
    x = torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(1))
    x[0, -3:] = 0
    x[1, 2] = x[1, 5] = x[1, 7]
    x[2] = torch.tensor([5, 9, 5, 9, 0, 9, 5, 9, 5, 9])
    return x


def inputs(x: torch.Tensor) -> dict[str, torch.Tensor]:
    # GPT-2 builds position_ids of shape [1, T] (Opacus issue 841); expanded they are per sample.
    return {"input_ids": x, "position_ids": torch.arange(x.shape[1]).expand(x.shape[0], -1)}


def lm_loss(logits: torch.Tensor, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1), reduction=reduction
    )


def per_sample_grads(
    model: nn.Module, x: torch.Tensor, *, untie: bool = False, reduction: str = "sum"
) -> dict[str, torch.Tensor]:
    """``{name: (B, *shape)}`` float64 per-sample gradients of the trainable parameters.

    ``untie``: the head gets a copy of the shared weight, so that its gradient ``H_i`` and the
    embedding's ``E_i`` come out separately (for the no-cross-term norm).
    """
    ref = copy.deepcopy(model).double()
    if untie:
        ref.lm_head.weight = nn.Parameter(ref.lm_head.weight.detach().clone())
    trainable = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    out: dict[str, list[torch.Tensor]] = {n: [] for n in trainable}
    for i in range(x.shape[0]):
        ref.zero_grad()
        xi = x[i : i + 1]
        loss = lm_loss(ref(**inputs(xi)).logits, xi)
        if reduction == "mean":  # the DP criterion's per-sample loss: mean over tokens
            loss = loss / (x.shape[1] - 1)
        loss.backward()
        for n, p in trainable.items():
            out[n].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    return {n: torch.stack(v) for n, v in out.items()}


def norms_of(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()


def shared_name(model: nn.Module) -> str:
    return next(n for n, p in model.named_parameters() if p is model.lm_head.weight)


# ----------------------------------------------------------------------------------------------
# (a) Per-sample norms at large k against the float64 oracle
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_norms_match_the_oracle_at_large_k(arch: str, caplog: pytest.LogCaptureFixture) -> None:
    """Everything trainable: the tied weight's norm and the total per-sample norm are within
    the sketch's variance of the oracle, and the norm without the cross term is not."""
    model = MODELS[arch]()
    x = token_ids()
    want = per_sample_grads(model, x)
    parts = per_sample_grads(model, x, untie=True)
    shared = shared_name(model)
    w_true = want[shared].flatten(1).norm(dim=1)
    w_naive = torch.stack([parts[shared], parts["lm_head.weight"]], 1).flatten(1).norm(dim=1)
    total_naive = norms_of(parts)
    with caplog.at_level(logging.INFO, logger="opacus_rc.grad_sample.grad_sample_module"):
        gsm = GradSampleModuleRandomizedClipping(
            model,
            max_grad_norm=1e9,
            loss_reduction="sum",
            sketch_dim=K,
            sketch_generator=torch.Generator().manual_seed(0),
        )
    emb = "model.embed_tokens" if arch == "llama" else "transformer.wte"
    assert gsm.norm_routes["lm_head"].path is NormPath.TIED
    assert gsm.norm_routes[emb].path is NormPath.TIED
    assert gsm.norm_routes["lm_head"].accounted(gsm.sketch_spec) == gsm.sketch_spec
    assert gsm.bookkeeping is True  # a trainable tied embedding keeps one backward pass
    assert f"'lm_head' (Linear): tied with '{emb}'" in caplog.text
    lm_loss(gsm(**inputs(x)).logits, x).backward()
    got_w = gsm.norm_samples[shared].double()
    torch.testing.assert_close(got_w, w_true, rtol=RTOL, atol=0)
    torch.testing.assert_close(gsm.get_norm_sample(), norms_of(want), rtol=RTOL, atol=0)
    # The check can fail: ignoring the cross term is off by more than the tolerance.
    assert ((w_naive - w_true).abs() / w_true).max() > 2 * RTOL
    if arch == "llama":
        assert ((total_naive - norms_of(want)).abs() / norms_of(want)).max() > 2 * RTOL
    gsm.cleanup()


# ----------------------------------------------------------------------------------------------
# (b) The joint probe math, exactly, with explicit probes
# ----------------------------------------------------------------------------------------------


def _factors(dtype: torch.dtype = torch.float64, scale: float = 1.0) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(3)
    Bs, Th, Te, d, Vs = 2, 5, 6, 4, 9
    A = torch.randn(Bs, Th, d, generator=g, dtype=torch.float64)
    G = torch.randn(Bs, Th, Vs, generator=g, dtype=torch.float64) * scale
    ids = torch.tensor([[1, 3, 3, 0, 8, 3], [0, 0, 2, 5, 2, 7]])
    ge = torch.randn(Bs, Te, d, generator=g, dtype=torch.float64) * scale
    omega = torch.randn(Bs, d, 3, generator=g, dtype=torch.float64) / 3**0.5
    return A.to(dtype), G.to(dtype), ids, ge.to(dtype), omega, Vs


def _summed_gradient(A, G, ids, ge, V_, pad):
    """``M_i = G_i^T A_i + sum_{t: x_t != pad} e_{x_t} g_t^T``, formed explicitly (float64)."""
    M = torch.einsum("btv,btd->bvd", G.double(), A.double())
    for i in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            if int(ids[i, t]) != pad:
                M[i, ids[i, t]] += ge[i, t].double()
    return M


def test_joint_sketch_equals_the_sketched_summed_gradient_exactly() -> None:
    """n_hat_i = ||M_i Omega_i||_F^2 for explicit probes, with repeated ids and padding; with
    Omega = I (k = d) it is ||M_i||_F^2, which differs from ||E_i||^2 + ||H_i||^2; the order of
    the two parts does not matter."""
    A, G, ids, ge, omega, V_ = _factors()
    M = _summed_gradient(A, G, ids, ge, V_, pad=0)
    want = torch.einsum("bvd,bdk->bvk", M, omega).pow(2).sum((1, 2))
    got = tied_hutchinson_sqnorm(A, G, ids, ge, sketch_dim=3, padding_idx=0, probes=omega)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    eye = torch.eye(4, dtype=torch.float64).expand(2, 4, 4)
    exact = tied_hutchinson_sqnorm(A, G, ids, ge, sketch_dim=4, padding_idx=0, probes=eye)
    torch.testing.assert_close(exact, M.pow(2).sum((1, 2)), rtol=1e-12, atol=0)
    H = torch.einsum("btv,btd->bvd", G, A)
    E = M - H
    assert ((exact - (E.pow(2).sum((1, 2)) + H.pow(2).sum((1, 2)))).abs() / exact).min() > 0.01
    # Without padding_idx the padding positions count.
    M_nopad = _summed_gradient(A, G, ids, ge, V_, pad=-1)
    got = tied_hutchinson_sqnorm(A, G, ids, ge, sketch_dim=3, probes=omega)
    torch.testing.assert_close(got, torch.einsum("bvd,bdk->bvk", M_nopad, omega).pow(2).sum((1, 2)))
    # Embedding part first, then the head's: same sketch.
    for order in ((0, 1), (1, 0)):
        sketch = JointSketch(omega, num_embeddings=V_)
        for part in order:
            if part == 0:
                sketch.add_linear(A, G)
            else:
                sketch.add_embedding(ids, ge, padding_idx=0)
        torch.testing.assert_close(sketch.norm().pow(2), want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e30])
def test_joint_sketch_float32_in_range(scale: float) -> None:
    """float32 factors scaled by 1e30 (or 1e-30) give the float64 result to float32 rounding:
    the power-of-two scaling keeps every intermediate in range (unscaled, 1e30^2 overflows)."""
    A, G, ids, ge, omega, V_ = _factors(torch.float32, scale)
    M = _summed_gradient(A, G, ids, ge, V_, pad=0)
    want = torch.einsum("bvd,bdk->bvk", M, omega).pow(2).sum((1, 2))
    sketch = JointSketch(omega.float(), num_embeddings=V_)
    sketch.add_linear(A, G)
    sketch.add_embedding(ids, ge, padding_idx=0)
    got = sketch.norm()
    assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
    torch.testing.assert_close(got.double(), want.sqrt(), rtol=1e-5, atol=0)


class TiedLM(nn.Module):
    """Embedding -> frozen mixing Linear -> trainable LayerNorm -> head tied to the embedding,
    with its own trainable bias. The tied weight is the only sketched parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, 8, padding_idx=0)
        self.mix = nn.Linear(8, 8)
        self.mix.requires_grad_(False)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, V)
        self.head.weight = self.emb.weight

    def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
        logits = self.head(self.norm(torch.tanh(self.mix(self.emb(input_ids)))))
        return type("Out", (), {"logits": logits})


@pytest.mark.parametrize("wrap", [True, False])
def test_module_computes_the_joint_sketch_with_its_probes(wrap: bool) -> None:
    """Through the module's hooks (wrapping, or the hooks-only twin): the tied weight's norm
    is exactly ||M_i Omega_i||_F, with Omega_i the first probes the module's generator draws
    (the head's backward runs first), and the head's bias and the LayerNorm keep their own
    exact norms."""
    model = TiedLM()
    x = token_ids()
    want = per_sample_grads(model, x)
    k = 5
    omega = draw_gaussian_probes(B, 8, k, generator=torch.Generator().manual_seed(4), device="cpu")
    M = want["emb.weight"]
    w_sketch = torch.einsum("bvd,bdk->bvk", M, omega.double()).pow(2).sum((1, 2)).sqrt()
    cls = GradSampleModuleRandomizedClipping if wrap else GradSampleHooksRandomizedClipping
    gsm = cls(
        model,
        max_grad_norm=1e9,
        loss_reduction="sum",
        sketch_dim=k,
        sketch_generator=torch.Generator().manual_seed(4),
    )
    lm_loss((gsm if wrap else model)(input_ids=x).logits, x).backward()
    got = gsm.norm_samples
    torch.testing.assert_close(got["emb.weight"].double(), w_sketch, rtol=1e-5, atol=0)
    for name in ("head.bias", "norm.weight", "norm.bias"):
        torch.testing.assert_close(
            got[name].double(), want[name].flatten(1).norm(dim=1), rtol=1e-5, atol=0
        )
    total = torch.stack(
        [w_sketch, *(want[n].flatten(1).norm(dim=1) for n in got if n != "emb.weight")]
    )
    torch.testing.assert_close(gsm.get_norm_sample(), total.norm(dim=0), rtol=1e-5, atol=0)
    gsm.cleanup()


# ----------------------------------------------------------------------------------------------
# (c) sigma = 0: the clipped gradient, book-keeping and two passes
# ----------------------------------------------------------------------------------------------


def clipped_step(
    model: nn.Module, *, max_grad_norm: float, bookkeeping: bool | str
) -> tuple[torch.Tensor, dict[str, torch.Tensor], bool]:
    """One private step at sigma = 0 (fixed sketch seed): ``(n_hat, {name: p.grad}, one
    pass?)``, the gradients read before the optimizer divides them by the batch size."""
    gsm = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=max_grad_norm,
        sketch_dim=16,
        sketch_generator=torch.Generator().manual_seed(7),
        bookkeeping=bookkeeping,
    )
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        grad_sample_module=gsm,
        noise_multiplier=0.0,
        expected_batch_size=B,
    )
    crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss(), "mean")
    x = token_ids()
    logits = gsm(**inputs(x)).logits[:, :-1]
    crit(logits.reshape(-1, V), x[:, 1:].reshape(-1), shape=(B, T - 1)).backward()
    out = gsm.per_sample_gradient_norms.clone(), gsm.bookkeeping
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    gsm.cleanup()
    return out[0], grads, out[1]


@pytest.mark.parametrize("bookkeeping", [True, False])
def test_clipped_gradient_equals_the_oracle(bookkeeping: bool) -> None:
    """Tiny tied Llama, everything trainable, sigma = 0: p.grad = sum_i min(1, C/n_hat_i) g_i
    with the module's own n_hat_i, for every parameter (the tied weight gets the clipped sum of
    both uses)."""
    model = tiny_llama()
    want = per_sample_grads(model, token_ids(), reduction="mean")
    C = float(norms_of(want).median())  # some samples clipped, some not
    n_hat, grads, one_pass = clipped_step(model, max_grad_norm=C, bookkeeping=bookkeeping)
    assert one_pass is bookkeeping
    coef = (C / (n_hat + 1e-6)).clamp(max=1.0)
    assert bool((coef < 1).any()) and bool((coef == 1).any())
    assert set(grads) == set(want)
    for name, g in want.items():
        clipped = torch.einsum("b,b...->...", coef, g)
        torch.testing.assert_close(grads[name].double(), clipped, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("bookkeeping", ["always", False])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_same_step(bookkeeping: Any, reentrant: bool) -> None:
    """HF gradient checkpointing on a tied model: the same norms and clipped gradients as
    without it (same probes, drawn in the same backward order). With bookkeeping=True a
    checkpointed step keeps per-sample gradients where they are smaller (exact norms, fewer
    probes): checked against the oracle in test_checkpointing.py (GPT-2 tied and untied)."""
    want_norms, want, _ = clipped_step(tiny_llama(), max_grad_norm=0.05, bookkeeping=bookkeeping)
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    norms, got, _ = clipped_step(model, max_grad_norm=0.05, bookkeeping=bookkeeping)
    torch.testing.assert_close(norms, want_norms, rtol=1e-5, atol=1e-7)
    assert set(got) == set(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-7, msg=name)


# ----------------------------------------------------------------------------------------------
# (d) What stays refused
# ----------------------------------------------------------------------------------------------


class Pair(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(7, 4)
        self.a = nn.Linear(4, 7)
        self.b = nn.Linear(4, 7)
        if kind == "two_linears":
            self.b.weight = self.a.weight
        elif kind == "three_owners":
            self.a.weight = self.emb.weight
            self.b.weight = self.emb.weight
        elif kind == "tied_bias":
            self.a.weight = self.emb.weight
            self.b.bias = self.a.bias
        elif kind == "two_embeddings":
            self.b = nn.Embedding(7, 4)  # type: ignore[assignment]
            self.b.weight = self.emb.weight
        elif kind == "linear_subclass":
            self.a = type("MyLinear", (nn.Linear,), {})(4, 7)
            self.a.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        out = self.a(h)
        return out + (self.b(x) if self.kind == "two_embeddings" else self.b(h))


REFUSED = {
    "two_linears": r"'a' \(Linear\), 'b' \(Linear\)",
    "three_owners": r"'emb' \(Embedding\), 'a' \(Linear\), 'b' \(Linear\)",
    "tied_bias": r"'emb' \(Embedding\), 'a' \(Linear\)",  # the head's bias is shared too
    "two_embeddings": r"'emb' \(Embedding\), 'b' \(Embedding\)",
    "linear_subclass": r"'emb' \(Embedding\), 'a' \(MyLinear\)",
}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_other_tyings_stay_refused(kind: str, assert_no_hooks: Callable) -> None:
    """Every tying but one embedding weight = one Linear weight raises at construction, naming
    the modules and saying what is supported; no hook is left behind."""
    model = Pair(kind)
    with pytest.raises(
        NotImplementedError,
        match=rf"tied between modules {REFUSED[kind]};.*except for the weight of one nn.Embedding",
    ):
        GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0)
    assert_no_hooks(model)


class Reuse(nn.Module):
    def __init__(self, twice: str) -> None:
        super().__init__()
        self.twice = twice
        self.emb = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + (self.emb(x) if self.twice == "emb" else 0)
        out = self.head(h)
        return out + (self.head(h) if self.twice == "head" else 0)


@pytest.mark.parametrize("twice", ["emb", "head"])
def test_second_use_of_a_tied_module_raises(twice: str) -> None:
    """One forward per tied module per step: a second use of either raises, naming it."""
    gsm = GradSampleModuleRandomizedClipping(Reuse(twice), max_grad_norm=1.0)
    name = {"emb": r"'emb' \(Embedding\)", "head": r"'head' \(Linear\)"}[twice]
    with pytest.raises(NotImplementedError, match=rf"module {name} ran more than once"):
        gsm(torch.tensor([[1, 2, 3]]))
    assert gsm.private_step.phase.value == "idle"
    gsm.cleanup()


def test_one_tied_module_without_backward_refuses_the_step(fake_engine: Any) -> None:
    """Only the head runs (inputs_embeds instead of input_ids): the tied weight's gradient has
    no embedding part this step, and the norm of the head's part alone is not accounted as the
    weight's: backward raises naming both modules, and nothing is stepped or accounted."""
    model = tiny_llama()
    x = token_ids()
    module, opt, crit, _ = fake_engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x), batch_size=B),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=8,
        poisson_sampling=False,
    )
    embeds = torch.randn(B, T, 16)
    logits = module(inputs_embeds=embeds).logits[:, :-1]
    theta = model.lm_head.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"(?s)'lm_head'.*other module's backward did not run"):
        crit(logits.reshape(-1, V), x[:, 1:].reshape(-1), shape=(B, T - 1)).backward()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="(?i)no step is taken and nothing is accounted"):
        opt.step()
    assert len(fake_engine.accountant) == 0 and torch.equal(model.lm_head.weight, theta)
    opt.zero_grad()  # and the next (complete) step works
    logits = module(**inputs(x)).logits[:, :-1]
    crit(logits.reshape(-1, V), x[:, 1:].reshape(-1), shape=(B, T - 1)).backward()
    opt.step()
    assert len(fake_engine.accountant) == 1


# ----------------------------------------------------------------------------------------------
# (e) The tied weight frozen
# ----------------------------------------------------------------------------------------------


def test_frozen_tied_weight_needs_no_norm() -> None:
    """Frozen embedding = frozen head (one tensor): no tied route, no norm for it, and the
    other parameters' norms match the oracle."""
    model = tiny_llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    x = token_ids()
    want = per_sample_grads(model, x)
    gsm = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=1e9,
        loss_reduction="sum",
        sketch_dim=K,
        sketch_generator=torch.Generator().manual_seed(0),
    )
    assert all(r.path is not NormPath.TIED for r in gsm.norm_routes.values())
    assert "lm_head" not in gsm.norm_routes
    lm_loss(gsm(**inputs(x)).logits, x).backward()
    assert "model.embed_tokens.weight" not in gsm.norm_samples
    torch.testing.assert_close(gsm.get_norm_sample(), norms_of(want), rtol=RTOL, atol=0)
    gsm.cleanup()


def test_tied_weight_frozen_after_make_private(fake_engine: Any) -> None:
    """Freezing the tied weight after make_private (allowed for any parameter): it gets no
    gradient and no update, and the step clips and accounts the others."""
    model = tiny_llama()
    x = token_ids()
    module, opt, crit, _ = fake_engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x), batch_size=B),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=8,
        poisson_sampling=False,
    )
    model.lm_head.weight.requires_grad_(False)
    theta = model.lm_head.weight.detach().clone()
    logits = module(**inputs(x)).logits[:, :-1]
    crit(logits.reshape(-1, V), x[:, 1:].reshape(-1), shape=(B, T - 1)).backward()
    assert model.lm_head.weight.grad is None
    assert "model.embed_tokens.weight" not in module.norm_samples
    opt.step()
    assert len(fake_engine.accountant) == 1
    assert torch.equal(model.lm_head.weight, theta)


# ----------------------------------------------------------------------------------------------
# (f) The engine: one step accounted once, with the spec
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["rc", "fake"])
@pytest.mark.parametrize("sketch", ["hutchinson", "hutch++"])
def test_make_private_step_is_accounted_once_with_the_spec(
    fake_engine: Any, engine: str, sketch: str
) -> None:
    """make_private(clipping="randomized") on a tied Llama, everything trainable: one pass,
    every parameter normed, one step accounted once with the module's spec (the real RC
    accountant's history, and the test accountant's record of what the optimizer reported)."""
    pe = PrivacyEngine() if engine == "rc" else fake_engine
    model = tiny_llama()
    x = token_ids()
    theta = model.lm_head.weight.detach().clone()
    module, opt, crit, _ = pe.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x), batch_size=B),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch=sketch,
        sketch_dim=8,
        poisson_sampling=False,
    )
    assert module.bookkeeping is True
    route = module.norm_routes["lm_head"]
    assert route.path is NormPath.TIED and route.accounted(module.sketch_spec) == module.sketch_spec
    logits = module(**inputs(x)).logits[:, :-1]
    crit(logits.reshape(-1, V), x[:, 1:].reshape(-1), shape=(B, T - 1)).backward()
    assert module.bookkeeping is True
    assert set(module.norm_samples) == {n for n, _ in model.named_parameters()}
    opt.step()
    if engine == "rc":
        assert [entry[3] for entry in pe.accountant.history] == [module.sketch_spec.to_dict()]
    else:
        assert pe.accountant.specs == [module.sketch_spec]
    assert len(pe.accountant) == 1
    assert not torch.equal(model.lm_head.weight, theta)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert bool(torch.isfinite(model.lm_head.weight).all())
