"""Closed-form exact per-sample norms of normalisation layers (issue 34, item 2).

Oracle: each sample's parameter gradients computed alone (a batch of one), in float64.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from opacus_rc.grad_sample import (
    CLIPPED_SUM_FUNCTIONS,
    EXACT_NORM_TYPES,
    SKETCHED_NORM_SAMPLERS,
    GradSampleModuleRandomizedClipping,
)
from opacus_rc.grad_sample.norm_layers import (
    compute_norm_layer_clipped_sum,
    compute_norm_layer_norm_sample,
    norm_layer_per_sample_grads,
    register_loaded_transformers_norms,
)
from opacus_rc.grad_sample.norms import STASH_GRAD_SAMPLERS
from opacus_rc.grad_sample.routing import NormPath
from opacus_rc.optimizers import DPLossRandomizedClipping, RandomizedClipOptimizer


def _llama_rms_norm(d: int) -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    config = LlamaConfig(
        hidden_size=d, num_attention_heads=1, num_key_value_heads=1, rms_norm_eps=1e-5
    )
    return LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "LayerNorm": (lambda: nn.LayerNorm(6), (6,)),
    "LayerNorm/no-bias": (lambda: nn.LayerNorm(6, bias=False), (6,)),
    "LayerNorm/2d": (lambda: nn.LayerNorm((3, 4), eps=1e-3), (3, 4)),
    "LayerNorm/2d-no-bias": (lambda: nn.LayerNorm((3, 4), bias=False), (3, 4)),
    "RMSNorm": (lambda: nn.RMSNorm(6), (6,)),
    "RMSNorm/eps": (lambda: nn.RMSNorm((3, 4), eps=1e-2), (3, 4)),
    "LlamaRMSNorm": (lambda: _llama_rms_norm(6), (6,)),
}


def _randomise(layer: nn.Module, seed: int) -> nn.Module:
    """Parameters away from their 1 / 0 initialisation (so a wrong term cannot cancel)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return layer


def _oracle(layer: nn.Module, x: torch.Tensor, G: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: (B, *shape)}``: each sample's parameter gradients, computed alone."""
    grads: dict[str, list[torch.Tensor]] = {n: [] for n, p in layer.named_parameters()}
    for i in range(x.shape[0]):
        layer.zero_grad(set_to_none=True)
        (layer(x[i : i + 1]) * G[i : i + 1]).sum().backward()
        for n, p in layer.named_parameters():
            if p.requires_grad:
                grads[n].append(p.grad.clone())
    return {n: torch.stack(g) for n, g in grads.items() if g}


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("positions", [(), (5,), (2, 3)])
def test_closed_form_equals_per_sample_oracle(name: str, positions: tuple[int, ...]) -> None:
    """Per-sample gradients, norms and the clipped sum against the per-sample oracle (float64);
    token dimensions: none, one, two."""
    make, shape = LAYERS[name]
    layer = _randomise(make().double(), seed=1)
    g = torch.Generator().manual_seed(2)
    B = 4
    x = 3 * torch.randn(B, *positions, *shape, generator=g, dtype=torch.float64) + 0.5
    G = torch.randn(x.shape, generator=g, dtype=torch.float64)
    oracle = _oracle(layer, x, G)
    assert set(oracle) == {n for n, p in layer.named_parameters()}
    params = dict(layer.named_parameters())
    got = norm_layer_per_sample_grads(layer, [x], G)
    assert {id(p) for p in got} == {id(params[n]) for n in oracle}
    norms = compute_norm_layer_norm_sample(
        layer, [x], G, estimator=None, sketch_dim=1, generator=None
    )
    coef = torch.rand(B, generator=g, dtype=torch.float64)
    sums = compute_norm_layer_clipped_sum(layer, [x], G, coef)
    for n, ref in oracle.items():
        p = params[n]
        torch.testing.assert_close(got[p], ref, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(norms[p], ref.flatten(1).norm(dim=1), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(
            sums[p], torch.einsum("b,b...->...", coef, ref), rtol=1e-10, atol=1e-12
        )
        assert sums[p].dtype == p.dtype and sums[p].shape == p.shape


def test_frozen_and_parameterless_layers_give_nothing() -> None:
    """A frozen weight is left out (the bias kept); elementwise_affine=False has no entry."""
    x, G = torch.randn(2, 3, 6), torch.randn(2, 3, 6)
    layer = nn.LayerNorm(6)
    layer.weight.requires_grad_(False)
    assert list(norm_layer_per_sample_grads(layer, [x], G)) == [layer.bias]
    assert norm_layer_per_sample_grads(nn.LayerNorm(6, elementwise_affine=False), [x], G) == {}
    assert norm_layer_per_sample_grads(nn.RMSNorm(6, elementwise_affine=False), [x], G) == {}


def test_float32_close_to_float64_oracle() -> None:
    """float32 inputs: float32 norms within float32 rounding of the float64 oracle."""
    layer = _randomise(nn.RMSNorm(64), seed=3)
    x, G = torch.randn(3, 50, 64), torch.randn(3, 50, 64)
    oracle = _oracle(copy.deepcopy(layer).double(), x.double(), G.double())["weight"]
    norms = compute_norm_layer_norm_sample(
        layer, [x], G, estimator=None, sketch_dim=1, generator=None
    )
    assert norms[layer.weight].dtype == torch.float32
    torch.testing.assert_close(
        norms[layer.weight].double(), oracle.flatten(1).norm(dim=1), rtol=1e-5, atol=0
    )


def test_shape_mismatch_is_refused_with_the_shapes() -> None:
    with pytest.raises(ValueError, match=r"normalized shape \(6,\)"):
        norm_layer_per_sample_grads(nn.LayerNorm(6), [torch.randn(2, 5)], torch.randn(2, 5))
    with pytest.raises(ValueError, match="one factor per sample"):
        compute_norm_layer_clipped_sum(
            nn.LayerNorm(6), [torch.randn(2, 6)], torch.randn(2, 6), torch.ones(3)
        )


def test_registered_exact_with_a_clipped_sum() -> None:
    """(transformers imported) LlamaRMSNorm and Qwen2RMSNorm are exact samplers with clipped
    sums and stashable per-sample gradients; registering again is a no-op; nn.LayerNorm and
    nn.RMSNorm are left to Opacus' closed-form grad samplers."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    llama = type(_llama_rms_norm(4))
    register_loaded_transformers_norms()
    assert register_loaded_transformers_norms() == []
    for t in (llama, Qwen2RMSNorm):
        assert SKETCHED_NORM_SAMPLERS[t] is compute_norm_layer_norm_sample
        assert CLIPPED_SUM_FUNCTIONS[t] is compute_norm_layer_clipped_sum
        assert t in EXACT_NORM_TYPES
        assert STASH_GRAD_SAMPLERS[t] is norm_layer_per_sample_grads
    for t in (nn.LayerNorm, nn.RMSNorm):
        assert t not in SKETCHED_NORM_SAMPLERS


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.rms = nn.RMSNorm(6)
        self.llama = _llama_rms_norm(6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.llama(self.rms(self.ln(self.lin(x))))).mean(1)


def test_module_routes_llama_rms_norm_exact_and_its_norms_match_the_oracle(
    microbatch_norms: Callable,
) -> None:
    """Inside the randomized-clipping module LlamaRMSNorm takes the exact closed form (it was
    functorch), LayerNorm and RMSNorm Opacus' grad samplers, all with book-keeping; every
    norm equals the oracle's."""
    torch.manual_seed(0)
    model = Block().double()
    for m in (model.ln, model.rms, model.llama):
        _randomise(m, seed=4)
    reference = copy.deepcopy(model)
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, loss_reduction="sum")
    routes = gsm.norm_routes
    assert routes["llama"].path is NormPath.EXACT
    assert routes["ln"].path is routes["rms"].path is NormPath.GRAD_SAMPLER
    assert all(routes[n].supports_bookkeeping for n in ("ln", "rms", "llama"))
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    gsm(x).pow(2).sum().backward()
    oracle = microbatch_norms(reference, x, lambda o: o.pow(2).sum())
    for name in ("ln.weight", "ln.bias", "rms.weight", "llama.weight"):
        torch.testing.assert_close(gsm.norm_samples[name], oracle[name], rtol=1e-8, atol=1e-12)


class TwiceNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = _llama_rms_norm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(self.norm(x))).mean(1)


def test_llama_rms_norm_used_twice_in_one_forward_is_refused_naming_it() -> None:
    """The exact path refuses a second use in one forward (as for nn.Linear), naming the
    module, rather than clipping one use only. (Under functorch its per-sample gradients were
    summed; HF models call each norm once.)"""
    gsm = GradSampleModuleRandomizedClipping(TwiceNormed(), max_grad_norm=1.0)
    with pytest.raises(NotImplementedError, match=r"'norm' \(LlamaRMSNorm\) ran more than once"):
        gsm(torch.randn(2, 3, 6))


class _Rsqrts(TorchDispatchMode):
    """Counts ``aten.rsqrt`` calls (the closed form's normalisation of the input)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.n += func.overloadpacket is torch.ops.aten.rsqrt
        return func(*args, **(kwargs or {}))


class NormedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = _randomise(_llama_rms_norm(6), seed=5)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.lin(x))).mean(1)


@pytest.mark.parametrize("batch", [1, 3])
def test_book_keeping_computes_the_closed_form_once_and_clips_it(batch: int) -> None:
    """With book-keeping, an exact norm layer's per-sample gradients, computed for its norm,
    are also its clipped sum's stash: the private backward normalises the layer's input once
    (one ``rsqrt``; the model's own backward takes none), and every clipped gradient is the
    oracle's ``sum_i c_i g_i`` with the step's factors (each sample's gradient computed alone,
    in float64)."""
    torch.manual_seed(0)
    model = NormedHead()
    x, y = torch.randn(batch, 4, 6), torch.randint(0, 3, (batch,))
    ref = copy.deepcopy(model).double()
    want = []
    for i in range(batch):
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1]).backward()
        want.append([p.grad.clone() for p in ref.parameters()])
    C = 0.5 * min(float(torch.cat([g.flatten() for g in w]).norm()) for w in want)
    gsm = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=C,
        loss_reduction="sum",
        sketch_dim=4096,
        sketch_generator=torch.Generator().manual_seed(1),
    )
    assert gsm.norm_routes["norm"].path is NormPath.EXACT
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        grad_sample_module=gsm,
        noise_multiplier=0.0,
        expected_batch_size=batch,
        loss_reduction="sum",
    )
    crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss(reduction="sum"), "sum")
    loss = crit(gsm(x), y)
    counter = _Rsqrts()
    with counter:
        loss.backward()
    assert counter.n == 1
    coef = (C / (gsm.per_sample_gradient_norms.double() + 1e-6)).clamp(max=1)
    assert bool((coef < 1).all())
    for j, p in enumerate(model.parameters()):
        clipped = sum(coef[i] * want[i][j] for i in range(batch))
        torch.testing.assert_close(p.grad.double(), clipped, rtol=1e-5, atol=1e-7)
