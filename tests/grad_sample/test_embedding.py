"""Exact per-sample norms and the book-keeping clipped sum of ``nn.Embedding`` (issue 13 item 2,
issue 14 item 1).

The oracle is autograd itself: a float64 copy of the layer (or model) and one backward pass per
sample, so ``padding_idx`` is treated exactly as autograd treats it (the padding row gets no
gradient). Opacus' ghost norm counts that row; the tiny-Llama test below fails with it (on the
main branch before this sampler, the total per-sample norms were 5.9x, 12.7x and 6.1x the
oracle's: the pad positions are next-token targets with large gradients).

Tolerances: the sampler accumulates in float32 (float64 for float64 inputs); a sum of ``n``
float32 terms has relative error about ``n * 2^-24`` in the worst case, ``<= 1e-5`` for the
``n <= 100`` terms per group and sample used here, so 1e-5 relative is the bound asked for
(issue 13) and float64 inputs are held to 1e-12.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc.grad_sample import (
    CLIPPED_SUM_FUNCTIONS,
    EXACT_NORM_TYPES,
    MODULE_CHECKS,
    SKETCHED_NORM_SAMPLERS,
    GradSampleModuleRandomizedClipping,
    check_embedding,
    compute_embedding_clipped_sum,
    compute_embedding_norm_sample,
    register_sketched_norm_sampler,
)
from opacus_rc.optimizers import DPLossRandomizedClipping, RandomizedClipOptimizer
from opacus_rc.privacy_engine import PrivacyEngine

pytestmark = pytest.mark.filterwarnings("ignore:a sketch_generator was passed")

V, D = 11, 6


def oracle(
    layer: nn.Embedding, ids: torch.Tensor, G: torch.Tensor, coef: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample gradient norms and ``sum_i c_i grad_i`` of a float64 copy, by autograd,
    one sample at a time."""
    ref = copy.deepcopy(layer).double()
    B = ids.shape[0]
    coef = torch.ones(B, dtype=torch.float64) if coef is None else coef.double()
    norms, total = [], torch.zeros_like(ref.weight)
    for i in range(B):
        ref.zero_grad()
        (ref(ids[i : i + 1]) * G[i : i + 1].double()).sum().backward()
        norms.append(ref.weight.grad.norm())
        total += coef[i] * ref.weight.grad
    return (torch.stack(norms) if norms else torch.zeros(0, dtype=torch.float64)), total


def make_ids(shape: tuple[int, ...], *, pad: int | None, seed: int = 0) -> torch.Tensor:
    """Ids with many repeats (V = 11) and the padding id in every sample."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, shape, generator=g)
    if pad is not None and ids.numel():
        p = pad % V
        flat = ids.view(shape[0], -1)
        flat[:, 0] = p
        flat[:, -1] = p
    return ids


def norms_of(layer: nn.Embedding, ids: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    return compute_embedding_norm_sample(
        layer, [ids], G, estimator=None, sketch_dim=1, generator=None
    )[layer.weight]


# ------------------------------------------------------------------------------------------------
# The sampler and the clipped sum against the oracle
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(5, 9), (1, 9), (7,), (3, 2, 4)])
@pytest.mark.parametrize("pad", [None, 0, 4, -1, -V])
def test_norms_and_clipped_sum_equal_the_oracle(
    pad: int | None, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    layer = nn.Embedding(V, D, padding_idx=pad)
    ids = make_ids(shape, pad=pad)
    G = torch.randn(*shape, D, dtype=dtype)
    coef = torch.rand(shape[0], dtype=dtype)
    want_norm, want_sum = oracle(layer, ids, G, coef)
    got = norms_of(layer, ids, G)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), want_norm, rtol=rtol, atol=0)
    summed = compute_embedding_clipped_sum(layer, [ids], G, coef)[layer.weight]
    assert summed.dtype == layer.weight.dtype and summed.shape == (V, D)
    torch.testing.assert_close(summed.double(), want_sum, rtol=rtol, atol=1e-6)
    if pad is not None:
        assert torch.count_nonzero(summed[pad]) == 0
        # The padding row is what Opacus' ghost norm wrongly counts: it is not zero here.
        assert bool((ids == pad % V).any())


def test_padding_row_with_nonfinite_gradient_is_ignored_as_by_autograd() -> None:
    """A NaN/inf output gradient at a padding position does not reach the weight gradient."""
    layer = nn.Embedding(V, D, padding_idx=2)
    ids = torch.tensor([[2, 1, 1, 2], [3, 2, 5, 3]])
    G = torch.randn(2, 4, D)
    G[0, 0] = float("nan")
    G[1, 1] = float("inf")
    want_norm, want_sum = oracle(layer, ids, torch.where(ids.unsqueeze(-1) == 2, 0.0, G))
    torch.testing.assert_close(norms_of(layer, ids, G).double(), want_norm, rtol=1e-5, atol=0)
    summed = compute_embedding_clipped_sum(layer, [ids], G, torch.ones(2))[layer.weight]
    torch.testing.assert_close(summed.double(), want_sum, rtol=1e-5, atol=1e-6)
    # Away from the padding row, a non-finite gradient gives a non-finite norm (refused later).
    G[0, 1] = float("inf")
    assert not torch.isfinite(norms_of(layer, ids, G)[0])


def test_bf16_gradients_accumulate_in_float32() -> None:
    """bf16 inputs, long sequences of one repeated id: 1e-5 relative to the float64 oracle on
    the same (bf16-exact) values. Accumulating in bf16 would be off by ~1e-2 (8-bit mantissa)."""
    torch.manual_seed(1)
    layer = nn.Embedding(V, D, padding_idx=0).to(torch.bfloat16)
    ids = torch.randint(0, 3, (3, 100))
    G = torch.randn(3, 100, D).to(torch.bfloat16)
    coef = torch.rand(3)
    want_norm, want_sum = oracle(layer, ids, G, coef)  # a float64 copy
    got = norms_of(layer, ids, G)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want_norm, rtol=1e-5, atol=0)
    summed = compute_embedding_clipped_sum(layer, [ids], G, coef)[layer.weight]
    assert summed.dtype == torch.bfloat16
    # One bf16 rounding of the float32 result: relative 2^-8 per entry.
    torch.testing.assert_close(summed.double(), want_sum, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("value", [1e-40, 1e-30, 1e30, 1e36])
def test_tiny_and_huge_gradients_neither_underflow_nor_overflow(value: float) -> None:
    """Per-sample power-of-two scaling: subnormal and near-overflow float32 gradients give the
    oracle's norm (a single sample of huge gradients next to a normal one)."""
    layer = nn.Embedding(V, D)
    ids = torch.tensor([[1, 1, 2, 3], [4, 4, 4, 5]])
    G = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(0))
    G[0] *= value
    want, _ = oracle(layer, ids, G)
    torch.testing.assert_close(norms_of(layer, ids, G).double(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("shape", [(0, 5), (0,), (3, 0)])
def test_empty_batch_and_empty_sequences(shape: tuple[int, ...]) -> None:
    layer = nn.Embedding(V, D, padding_idx=0)
    ids = torch.zeros(shape, dtype=torch.long)
    G = torch.zeros(*shape, D)
    got = norms_of(layer, ids, G)
    assert got.shape == (shape[0],) and torch.count_nonzero(got) == 0
    summed = compute_embedding_clipped_sum(layer, [ids], G, torch.ones(shape[0]))[layer.weight]
    assert summed.shape == (V, D) and torch.count_nonzero(summed) == 0


def test_no_host_synchronisation_and_no_probe() -> None:
    """On ``meta`` tensors (no data: any ``.item()``, ``bool()`` or data-dependent output size
    such as ``torch.unique`` raises), both functions run and give the right shapes; the sketch
    generator is never touched."""
    layer = nn.Embedding(V, D, padding_idx=0, device="meta")
    ids = torch.empty(4, 7, dtype=torch.long, device="meta")
    G = torch.empty(4, 7, D, device="meta")
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    got = compute_embedding_norm_sample(
        layer, [ids], G, estimator=None, sketch_dim=8, generator=gen
    )
    assert got[layer.weight].shape == (4,) and got[layer.weight].device.type == "meta"
    assert torch.equal(gen.get_state(), state)
    summed = compute_embedding_clipped_sum(layer, [ids], G, torch.empty(4, device="meta"))
    assert summed[layer.weight].shape == (V, D)


def test_frozen_weight_and_bad_shapes() -> None:
    layer = nn.Embedding(V, D)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"do not match an output gradient of shape \(2, 3, 5\)"):
        norms_of(layer, ids, torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match=r"integer ids"):
        norms_of(layer, ids.float(), torch.zeros(2, 3, D))
    with pytest.raises(ValueError, match="one factor per sample"):
        compute_embedding_clipped_sum(layer, [ids], torch.zeros(2, 3, D), torch.ones(3))
    layer.padding_idx = V  # set by hand, out of range
    with pytest.raises(ValueError, match=r"padding_idx=11 is outside \[-11, 11\)"):
        norms_of(layer, ids, torch.zeros(2, 3, D))
    layer.weight.requires_grad_(False)
    assert compute_embedding_norm_sample(layer, [ids], torch.zeros(2, 3, D)) == {}
    assert compute_embedding_clipped_sum(layer, [ids], torch.zeros(2, 3, D), torch.ones(2)) == {}


# ------------------------------------------------------------------------------------------------
# Registration, refusals, logging
# ------------------------------------------------------------------------------------------------


def test_registered_as_exact_with_a_clipped_sum_and_a_check() -> None:
    assert SKETCHED_NORM_SAMPLERS[nn.Embedding] is compute_embedding_norm_sample
    assert CLIPPED_SUM_FUNCTIONS[nn.Embedding] is compute_embedding_clipped_sum
    assert MODULE_CHECKS[nn.Embedding] is check_embedding
    assert nn.Embedding in EXACT_NORM_TYPES and nn.Linear not in EXACT_NORM_TYPES


def test_exact_flag_of_the_registry() -> None:
    class MyEmb(nn.Embedding):
        pass

    try:
        register_sketched_norm_sampler(MyEmb, exact=True)(compute_embedding_norm_sample)
        assert MyEmb in EXACT_NORM_TYPES
        register_sketched_norm_sampler(MyEmb, force=True)(compute_embedding_norm_sample)
        assert MyEmb not in EXACT_NORM_TYPES  # re-registered as sketched
        with pytest.raises(TypeError, match="exact must be a bool"):
            register_sketched_norm_sampler(MyEmb, force=True, exact=1)  # type: ignore[arg-type]
    finally:
        SKETCHED_NORM_SAMPLERS.pop(MyEmb, None)
        EXACT_NORM_TYPES.discard(MyEmb)


class EmbModel(nn.Module):
    """Embedding -> Linear -> LayerNorm -> mean over T -> Linear head."""

    def __init__(self, **emb_kwargs: Any) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, **emb_kwargs)
        self.lin = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.lin(self.emb(x)))).mean(1))


@pytest.mark.parametrize(
    ("kwargs", "frozen", "match"),
    [
        ({"max_norm": 1.0}, False, r"max_norm=1.0\) renormalises"),
        ({"max_norm": 1.0}, True, r"max_norm=1.0\) renormalises"),  # frozen weights change too
        ({"scale_grad_by_freq": True}, False, "scale_grad_by_freq=True"),
        ({"sparse": True}, False, r"sparse=True\) is not supported"),
    ],
)
def test_unsupported_options_refused_before_any_forward(
    kwargs: dict[str, Any], frozen: bool, match: str, assert_no_hooks: Callable
) -> None:
    model = EmbModel(**kwargs)
    model.emb.weight.requires_grad_(not frozen)
    before = model.emb.weight.detach().clone()
    with pytest.raises(ValueError, match=match):
        GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0)
    assert_no_hooks(model)
    assert torch.equal(model.emb.weight, before)


def test_frozen_embedding_options_that_only_touch_gradients_are_allowed() -> None:
    model = EmbModel(scale_grad_by_freq=True, sparse=True)
    model.emb.weight.requires_grad_(False)
    GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0).cleanup()


def test_logged_as_exact_and_keeps_bookkeeping(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="opacus_rc.grad_sample.grad_sample_module"):
        gsm = GradSampleModuleRandomizedClipping(EmbModel(padding_idx=0), max_grad_norm=1.0)
    paths = {r.args[0]: r.args[2] for r in caplog.records if len(r.args or ()) == 3}
    assert paths["emb"] == "exact (opacus_rc sampler, no sketch)"
    assert paths["lin"].startswith("sketched")
    assert gsm.bookkeeping is True
    gsm.cleanup()


# ------------------------------------------------------------------------------------------------
# Through the module and the engine
# ------------------------------------------------------------------------------------------------


def _dp_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, bookkeeping: bool, C: float
) -> tuple[Any, dict[str, torch.Tensor]]:
    gsm = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=C,
        sketch_dim=4,
        sketch_generator=torch.Generator().manual_seed(9),
        bookkeeping=bookkeeping,
    )
    assert gsm.bookkeeping is bookkeeping
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        grad_sample_module=gsm,
        noise_multiplier=0.0,
        max_grad_norm=C,
        expected_batch_size=len(y),
    )
    crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss())
    crit(gsm(x), y).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return gsm, grads


def test_module_bookkeeping_equals_two_passes_and_oracle() -> None:
    """Only the embedding and the LayerNorm train (all norms exact): the clip factors and the
    clipped gradient sum equals the float64 oracle ``sum_i min(1, C / (n_i + 1e-6)) grad_i``, with
    book-keeping and with two passes."""
    torch.manual_seed(0)
    base = EmbModel(padding_idx=3)
    for p in (*base.lin.parameters(), *base.head.parameters()):
        p.requires_grad_(False)
    x = make_ids((6, 8), pad=3)
    y = torch.randint(0, 3, (6,))
    ce = nn.functional.cross_entropy
    per_sample = per_sample_oracle(base, 6, lambda ref, i: ce(ref(x[i : i + 1]), y[i : i + 1]))
    n_exact = total_norms(per_sample)
    C = float(n_exact.median())  # about half the samples clipped
    c = (C / (n_exact + 1e-6)).clamp(max=1.0)
    # p.grad after the DP backward is the clipped sum; optimizer.step() divides by B.
    want = {n: torch.tensordot(c, g, dims=1) for n, g in per_sample.items()}
    for bookkeeping in (True, False):
        gsm, grads = _dp_step(copy.deepcopy(base), x, y, bookkeeping=bookkeeping, C=C)
        torch.testing.assert_close(gsm.per_sample_gradient_norms, n_exact, rtol=1e-5, atol=0)
        assert set(grads) == set(want)
        for n, g in grads.items():
            torch.testing.assert_close(g.double(), want[n], rtol=1e-5, atol=1e-7, msg=n)
        gsm.cleanup()


def per_sample_oracle(
    model: nn.Module, n: int, loss_of: Callable[[nn.Module, int], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``{name: (n, *shape) float64 per-sample gradients}`` of the trainable parameters of a
    float64 copy of ``model``; ``loss_of(ref, i)`` is sample ``i``'s loss alone."""
    ref = copy.deepcopy(model).double()
    trainable = {name: p for name, p in ref.named_parameters() if p.requires_grad}
    out: dict[str, list[torch.Tensor]] = {name: [] for name in trainable}
    for i in range(n):
        ref.zero_grad()
        loss_of(ref, i).backward()
        for name, p in trainable.items():
            out[name].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    return {name: torch.stack(v) for name, v in out.items()}


def total_norms(per_sample: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()


def test_bf16_autocast_through_the_module() -> None:
    """Under bf16 autocast the embedding's norm is float32 and close to the float64 oracle.
    The downstream Linear runs in bf16, so the output gradient itself carries bf16 rounding
    (relative 2^-8 per op, a few ops deep): tolerance 5e-2."""
    torch.manual_seed(0)
    model = EmbModel(padding_idx=0)
    for p in (*model.lin.parameters(), *model.head.parameters(), *model.norm.parameters()):
        p.requires_grad_(False)
    x = make_ids((4, 8), pad=0)
    y = torch.randint(0, 3, (4,))
    ce = nn.functional.cross_entropy
    want = per_sample_oracle(model, 4, lambda ref, i: ce(ref(x[i : i + 1]), y[i : i + 1]))
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1e9, loss_reduction="sum")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gsm(x)
    ce(out.float(), y, reduction="sum").backward()
    got = gsm.norm_samples["emb.weight"]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), total_norms(want), rtol=5e-2, atol=0)
    gsm.cleanup()


def test_engine_sigma0_bookkeeping_equals_two_passes(fake_engine: Any) -> None:
    """make_private(clipping="randomized") with a trainable untied embedding (padding id in the
    text), every layer trainable, sigma = 0 (test-only accountant): one backward pass, and the
    parameters after two steps equal those of the two-pass path (same sketch seed)."""
    torch.manual_seed(0)
    base = EmbModel(padding_idx=0)
    x = make_ids((8, 8), pad=0)
    y = torch.randint(0, 3, (8,))
    data = TensorDataset(make_ids((32, 8), pad=0, seed=5), torch.randint(0, 3, (32,)))
    after = {}
    for bookkeeping in (True, False):
        model = copy.deepcopy(base)
        engine = PrivacyEngine(accountant="prv")
        engine.accountant = type(fake_engine.accountant)()  # test-only: allows sigma = 0
        module, opt, crit, _ = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(data, batch_size=8),
            noise_multiplier=0.0,
            max_grad_norm=0.05,
            clipping="randomized",
            sketch_dim=4,
            sketch_generator=torch.Generator().manual_seed(1),
            bookkeeping=bookkeeping,
        )
        assert module.bookkeeping is bookkeeping
        for _ in range(2):
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert bool((module.per_sample_gradient_norms > 0.05).any())
        after[bookkeeping] = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert not torch.equal(after[True]["emb.weight"], base.emb.weight)
    assert torch.equal(after[True]["emb.weight"][0], base.emb.weight[0])  # padding row
    for n, p in after[True].items():
        torch.testing.assert_close(p, after[False][n], rtol=1e-5, atol=1e-6, msg=n)


# ------------------------------------------------------------------------------------------------
# Tiny Hugging Face Llama: pad id in the text
# ------------------------------------------------------------------------------------------------


def _tiny_llama(seed: int = 0) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        pad_token_id=0,
        tie_word_embeddings=False,
        use_cache=False,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).train()


def _llama_ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, 64, (3, 12), generator=g)
    x[:, -4:] = 0  # right padding: the pad id appears in every sample's text
    x[1, 2] = 0
    return x


def test_tiny_llama_pad_id_in_text_total_norm_is_exact() -> None:
    """LlamaForCausalLM (untied), embed_tokens(padding_idx=0) and the RMSNorms trainable (all
    exact), the Linear layers frozen: the engine's total per-sample norm equals the float64
    oracle to 1e-5 relative. With Opacus' ghost norm (which counts the padding row) it was 5.9x
    to 12.7x the oracle."""
    model = _tiny_llama()
    for name, p in model.named_parameters():
        p.requires_grad_("embed_tokens" in name or "norm" in name)
    x = _llama_ids()

    def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1), reduction="sum"
        )

    per_sample = per_sample_oracle(
        model, 3, lambda ref, i: lm_loss(ref(input_ids=x[i : i + 1]).logits, x[i : i + 1])
    )
    n_exact = total_norms(per_sample)
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1e9, loss_reduction="sum")
    assert gsm.bookkeeping is True
    lm_loss(gsm(input_ids=x).logits, x).backward()
    torch.testing.assert_close(gsm.get_norm_sample(), n_exact, rtol=1e-5, atol=0)
    gsm.cleanup()


def test_tiny_llama_all_trainable_keeps_one_backward(fake_engine: Any) -> None:
    """Every parameter trainable, the embedding untied: make_private keeps book-keeping, and the
    clipped gradients equal the two-pass path's (same sketch seed, sigma = 0)."""
    x = _llama_ids()
    grads = {}
    for bookkeeping in (True, False):
        model = _tiny_llama()
        engine = PrivacyEngine(accountant="prv")
        engine.accountant = type(fake_engine.accountant)()  # test-only: allows sigma = 0
        module, opt, crit, _ = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, x[:, 0]), batch_size=3),
            noise_multiplier=0.0,
            max_grad_norm=0.5,
            clipping="randomized",
            sketch_dim=8,
            sketch_generator=torch.Generator().manual_seed(2),
            poisson_sampling=False,
            bookkeeping=bookkeeping,
        )
        assert module.bookkeeping is bookkeeping
        logits = module(input_ids=x).logits[:, :-1]
        crit(logits.reshape(-1, 64), x[:, 1:].reshape(-1), shape=logits.shape).backward()
        grads[bookkeeping] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert grads[True]["model.embed_tokens.weight"].abs().sum() > 0
    assert torch.count_nonzero(grads[True]["model.embed_tokens.weight"][0]) == 0
    for n, g in grads[False].items():
        torch.testing.assert_close(grads[True][n], g, rtol=1e-5, atol=1e-7, msg=n)
