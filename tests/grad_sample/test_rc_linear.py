"""Sketched nn.Linear norm sampler against exact per-sample norms
(docs/privacy/estimators.md#estimators-hutchinson)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from opacus_rc.grad_sample import (
    SKETCHED_NORM_SAMPLERS,
    GradSampleModuleRandomizedClipping,
    compute_linear_sketched_norm_sample,
    register_sketched_norm_sampler,
)
from opacus_rc.grad_sample.linear import sketched_weight_norm_of_gradients
from opacus_rc.sketching import GRADIENT_ESTIMATORS, hutchinson_sqnorm, hutchpp_sqnorm

D_IN, D_OUT = 5, 6
K_LARGE = 4096
# At k = 4096, W = n_hat/n has sd <= sqrt(2/k) = 0.0221, so the norm ratio sqrt(W) has
# sd <= 0.011 (delta method); 5% is >= 4.5 sd for every sample
# (docs/privacy/estimators.md#estimators-hutchinson).
REL_TOL = 0.05


class LinearOnly(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(D_IN, D_OUT, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def per_sample_loss(out: torch.Tensor) -> torch.Tensor:
    """A non-linear per-sample loss so that G_i varies along the sequence: sum(tanh(out)^2)."""
    return torch.tanh(out).pow(2).flatten(1).sum(1)


def input_of_rank(rank: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    shape = {
        2: (batch, D_IN),
        3: (batch, 7, D_IN),
        4: (batch, 3, 4, D_IN),
        5: (batch, 2, 3, 2, D_IN),
    }
    return torch.randn(shape[rank], generator=gen)


@pytest.mark.parametrize("rank", [2, 3, 4, 5])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [0, 1, 2, 3, 4])
@pytest.mark.filterwarnings("ignore:a sketch_generator was passed")
def test_norms_match_microbatch_oracle(
    rank: int,
    bias: bool,
    loss_reduction: str,
    batch: int,
    microbatch_norms: Callable[..., dict[str, torch.Tensor]],
) -> None:
    """Per-parameter and total per-sample norms vs a float64 batch-size-1 loop.

    Rank 2 and all biases are exact (float32 rounding only); sketched weights (rank >= 3) are
    within 5% at k = 4096. Rank > 3 exercises the flattening that Opacus' ghost sampler lacks.
    """
    gen = torch.Generator().manual_seed(1000 * rank + 10 * batch + bias)
    torch.manual_seed(rank)
    model = LinearOnly(bias)
    reference = copy.deepcopy(model)  # before hooks are attached
    x = input_of_rank(rank, batch, gen)
    gsm = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=1.0,
        sketch_dim=K_LARGE,
        sketch_generator=torch.Generator().manual_seed(batch + 7 * rank),
        loss_reduction=loss_reduction,
    )
    losses = per_sample_loss(gsm(x))
    (losses.mean() if loss_reduction == "mean" else losses.sum()).backward()
    norms = gsm.get_norm_sample()
    assert norms.shape == (batch,)
    if batch == 0:
        assert gsm.get_clipping_coef().shape == (0,)
        return
    oracle = microbatch_norms(reference, x, per_sample_loss)
    w_norm = gsm.norm_samples["lin.weight"].double()
    w_tol = 1e-5 if rank == 2 else REL_TOL
    torch.testing.assert_close(w_norm, oracle["lin.weight"], rtol=w_tol, atol=1e-6)
    if bias:
        torch.testing.assert_close(
            gsm.norm_samples["lin.bias"].double(), oracle["lin.bias"], rtol=1e-5, atol=1e-6
        )
    torch.testing.assert_close(norms, oracle["__total__"], rtol=w_tol, atol=1e-6)


def test_sketched_sampler_matches_estimator_on_flattened_input() -> None:
    """Rank-4 input: the weight norm is sqrt(estimator(A.reshape(B,T',d), G.reshape(B,T',p)))
    with the very same probes (same generator state)."""
    gen = torch.Generator().manual_seed(3)
    layer = nn.Linear(D_IN, D_OUT)
    A = torch.randn(3, 2, 4, D_IN, generator=gen)
    G = torch.randn(3, 2, 4, D_OUT, generator=gen)
    for estimator in (hutchinson_sqnorm, hutchpp_sqnorm):
        out = compute_linear_sketched_norm_sample(
            layer, [A], G, estimator=estimator, sketch_dim=3,
            generator=torch.Generator().manual_seed(9),
        )  # fmt: skip
        ref = estimator(
            A.reshape(3, 8, D_IN), G.reshape(3, 8, D_OUT), sketch_dim=3,
            generator=torch.Generator().manual_seed(9),
        ).sqrt()  # fmt: skip
        torch.testing.assert_close(out[layer.weight], ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(out[layer.bias], G.sum((1, 2)).norm(dim=1), rtol=1e-6, atol=0)


def test_frozen_weight_draws_no_probes() -> None:
    layer = nn.Linear(D_IN, D_OUT)
    layer.weight.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    A, G = torch.randn(2, 4, D_IN), torch.randn(2, 4, D_OUT)
    out = compute_linear_sketched_norm_sample(
        layer, [A], G, estimator=hutchinson_sqnorm, sketch_dim=8, generator=gen
    )
    assert set(out) == {layer.bias}
    assert torch.equal(gen.get_state(), state)
    layer.weight.requires_grad_(True)
    layer.bias.requires_grad_(False)
    out = compute_linear_sketched_norm_sample(
        layer, [A], G, estimator=hutchinson_sqnorm, sketch_dim=8, generator=gen
    )
    assert set(out) == {layer.weight}
    assert not torch.equal(gen.get_state(), state)


def test_huge_gradients_give_finite_accurate_norms() -> None:
    """Per-sample norms near 1e30 in float32 (squared: 1e60, beyond float32): the exact
    power-of-two rescaling keeps the estimate finite and within 5% (k = 4096, see REL_TOL)."""
    gen = torch.Generator().manual_seed(1)
    A = torch.randn(3, 6, D_IN, generator=gen) * 1e14
    G = torch.randn(3, 6, D_OUT, generator=gen) * 1e15
    G[1] *= 1e-30  # a tiny sample next to huge ones
    layer = nn.Linear(D_IN, D_OUT)
    out = compute_linear_sketched_norm_sample(
        layer, [A], G, estimator=hutchinson_sqnorm, sketch_dim=K_LARGE, generator=gen
    )
    exact = (G.double().transpose(1, 2) @ A.double()).flatten(1).norm(dim=1)
    w = out[layer.weight]
    assert w.dtype == torch.float32 and torch.isfinite(w).all()
    torch.testing.assert_close(w.double(), exact, rtol=REL_TOL, atol=0)
    assert math.isfinite(out[layer.bias].max().item())


@pytest.mark.parametrize("estimator", [hutchinson_sqnorm, hutchpp_sqnorm])
def test_huge_gradients_finite_in_the_gradient_form_too(estimator: Callable) -> None:
    """The same samples as above through the per-sample-gradient stash's norm
    (``sketched_weight_norm_of_gradients``): Hutchinson sums its sketch's squares in float64,
    Hutch++ scales each sample by a power of two; both finite and within 5% (k = 4096)."""
    gen = torch.Generator().manual_seed(1)
    A = torch.randn(3, 6, D_IN, generator=gen) * 1e14
    G = torch.randn(3, 6, D_OUT, generator=gen) * 1e15
    G[1] *= 1e-30
    M = (G.double().transpose(1, 2) @ A.double()).float()  # (3, p, d), entries ~1e29
    exact = M.double().flatten(1).norm(dim=1)
    w = sketched_weight_norm_of_gradients(
        M, estimator=GRADIENT_ESTIMATORS[estimator], sketch_dim=K_LARGE, generator=gen
    )
    assert w.dtype == torch.float32 and torch.isfinite(w).all()
    torch.testing.assert_close(w.double(), exact, rtol=REL_TOL, atol=0)


def test_registry_rejects_duplicates_and_non_modules() -> None:
    assert SKETCHED_NORM_SAMPLERS[nn.Linear] is compute_linear_sketched_norm_sample
    with pytest.raises(ValueError, match="duplicate registration.*Linear.*force=True"):
        register_sketched_norm_sampler(nn.Linear)(lambda *a, **k: {})
    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_sketched_norm_sampler(int)
    with pytest.raises(TypeError, match="at least one module type"):
        register_sketched_norm_sampler()

    class MyLinear(nn.Linear):
        pass

    try:
        register_sketched_norm_sampler(MyLinear)(compute_linear_sketched_norm_sample)
        assert SKETCHED_NORM_SAMPLERS[MyLinear] is compute_linear_sketched_norm_sample

        def replacement(*args: object, **kwargs: object) -> dict:
            return {}

        register_sketched_norm_sampler(MyLinear, force=True)(replacement)
        assert SKETCHED_NORM_SAMPLERS[MyLinear] is replacement
    finally:
        SKETCHED_NORM_SAMPLERS.pop(MyLinear, None)


def test_opacus_registries_untouched() -> None:
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.grad_sample.linear import compute_linear_norm_sample

    assert (
        GradSampleModuleFastGradientClipping.NORM_SAMPLERS[nn.Linear] is compute_linear_norm_sample
    )
