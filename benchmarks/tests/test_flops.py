"""FLOP counts of the benchmarked norm methods against their closed forms (exact equality).

``FlopCounterMode`` counts matrix products at 2 FLOPs per multiply-add. The Hutchinson sampler
(``opacus_rc.grad_sample.linear``) does two batched products per layer, ``U = G Omega``
(``2BTpk``) and ``V^T = U^T A`` (``2BTdk``): ``2BTk(p + d)`` in total, whichever side is sketched.
Its bias norm is exact, ``||sum_t G_t||``: a reduction over ``T`` and no matrix product, so the
matrix-product count does not change with the bias; with sum reductions counted too
(``B (T - 1) p`` additions for the bias) the bias adds exactly that.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import count_flops
from benchmarks.norm_methods import closed_form_flops, get_method
from opacus_rc.grad_sample.linear import compute_linear_sketched_norm_sample
from opacus_rc.sketching import hutchinson_sqnorm

aten = torch.ops.aten

SHAPES = [  # (B, T, d, p, k)
    (2, 16, 8, 8, 4),
    (3, 33, 20, 12, 5),  # p < d: output side sketched
    (1, 7, 6, 40, 3),  # p > d: input side sketched
    (4, 64, 32, 32, 32),
]


def _sampler_flops(B, T, d, p, k, *, bias, custom_mapping=None, extra_dims=()):
    torch.manual_seed(0)
    layer = nn.Linear(d, p, bias=bias)
    A = torch.randn(B, *extra_dims, T, d)
    G = torch.randn(B, *extra_dims, T, p)
    gen = torch.Generator().manual_seed(1)
    with FlopCounterMode(display=False, custom_mapping=custom_mapping or {}) as counter:
        norms = compute_linear_sketched_norm_sample(
            layer, [A], G, estimator=hutchinson_sqnorm, sketch_dim=k, generator=gen
        )
    return counter.get_total_flops(), norms, layer, G


@pytest.mark.parametrize("B,T,d,p,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_hutchinson_sampler_flops_closed_form(B, T, d, p, k, bias):
    flops, norms, layer, G = _sampler_flops(B, T, d, p, k, bias=bias)
    assert flops == 2 * B * T * k * (p + d)
    assert flops == closed_form_flops("hutchinson", B=B, T=T, d=d, p=p, k=k, bias=bias)
    if bias:  # the bias norm is exact
        torch.testing.assert_close(norms[layer.bias], G.sum(1).norm(dim=1))


def test_hutchinson_sampler_flops_rank4_input_is_flattened():
    # (B, H, T, d) inputs are flattened to (B, H*T, d): the count uses T' = H*T.
    flops, *_ = _sampler_flops(2, 5, 8, 6, 4, bias=True, extra_dims=(3,))
    assert flops == 2 * 2 * (3 * 5) * 4 * (6 + 8)


def _sum_additions(a_shape, dim=None, keepdim=False, *args, out_shape=None, **kwargs):
    """Additions of a sum reduction: one fewer than the summed elements, per output."""
    n_in = 1
    for s in a_shape:
        n_in *= s
    n_out = 1
    for s in out_shape:
        n_out *= s
    return n_in - n_out


@pytest.mark.parametrize("B,T,d,p,k", SHAPES)
def test_hutchinson_sampler_bias_term_exact(B, T, d, p, k):
    mapping = {aten.sum: _sum_additions}
    with_bias, *_ = _sampler_flops(B, T, d, p, k, bias=True, custom_mapping=mapping)
    without, *_ = _sampler_flops(B, T, d, p, k, bias=False, custom_mapping=mapping)
    assert with_bias - without == B * (T - 1) * p


@pytest.mark.parametrize("method", ["ghost", "fgc", "mixed", "hutchinson", "hutch++"])
@pytest.mark.parametrize("B,T,d,p,k", SHAPES)
def test_benchmark_closed_forms(method, B, T, d, p, k):
    layer = nn.Linear(d, p)
    A = torch.randn(B, T, d)
    G = torch.randn(B, T, p)
    fn = get_method(method)
    gen = torch.Generator().manual_seed(0)
    _, flops = count_flops(lambda: fn(layer, A, G, k=k, generator=gen))
    assert flops == closed_form_flops(method, B=B, T=T, d=d, p=p, k=k, bias=True)


def test_issue_floor_numbers():
    """The floors of issue 5 at T=4096, d=p=1024, k=32, B=4 from the closed forms."""
    kw = {"B": 4, "T": 4096, "d": 1024, "p": 1024, "bias": True}
    ours = closed_form_flops("hutchinson", k=32, **kw)
    assert ours * 100 <= closed_form_flops("ghost", k=None, **kw)
    assert ours * 8 <= closed_form_flops("fgc", k=None, **kw)
