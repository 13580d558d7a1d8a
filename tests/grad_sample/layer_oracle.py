"""One private step of a small model checked against the float64 one-sample-at-a-time oracle:
per-sample norms (exact, or within the sketch's tolerance), the clipped sum and the released
update. Shared by the routing sweep over every registered layer type and the embedding-bag,
checkpointing and forward-input tests of tests/grad_sample/.

Every number is checked against a float64 oracle that runs one autograd backward per sample on
a float64 copy of the model (no hooks, no checkpointing).

Tolerances:

* exact norms (Opacus' grad samplers, functorch, opacus_rc's exact samplers, rank-2
  ``nn.Linear``): float32 arithmetic against float64, ``EXACT_RTOL = 1e-4`` (a few hundred
  float32 operations per entry, each with relative error ``2^-24 = 6e-8``);
* sketched norms (``nn.Linear`` on rank-3 inputs, Hutchinson with ``k`` probes): for one
  sketched weight ``n_hat^2 / n^2`` is ``chi2_k / k``, or a convex combination of such
  variables with exact parts (docs/privacy/estimators.md), so ``Var(n_hat^2 / n^2) <= 2 / k``:
  relative standard deviation ``sqrt(2 / k)`` of the squared norm, 0.0156 at ``k = 8192``.
  ``sketch_rtol(k) = 6 sqrt(2 / k)`` on the squared norm is six standard deviations (a two-sided
  normal tail of 2e-9 per comparison, for a few hundred comparisons with fixed seeds);
* the clipped sum: the engine's ``p.grad`` after the private backward is compared with
  ``sum_i c_i g_i`` from the oracle's float64 per-sample gradients ``g_i`` and the engine's own
  clip factors ``c_i = min(1, C / (n_hat_i + 1e-6))`` (rtol 1e-4: float32 sums of float32
  products), and with the oracle's own clipped sum (its factors from the true norms) to within
  the bound the norm tolerance gives: ``|c_i - c*_i| <= c*_i |n_i / n_hat_i - 1|``;
* the released update at ``sigma = 0`` (no noise; the accountant records epsilon = inf):
  ``p.grad`` after ``optimizer.step()`` is the clipped sum divided by the expected batch size.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc.privacy_engine import PrivacyEngine

B = 4


EXACT_RTOL = 1e-4


def sketch_rtol(k: int) -> float:
    """Six standard deviations of ``n_hat^2 / n^2`` (``<= sqrt(2 / k)``, module docstring)."""
    return 6 * math.sqrt(2 / k)


def private(
    model: nn.Module,
    *,
    C: float,
    k: int = 8192,
    bookkeeping: bool | str = True,
    sigma: float = 1.0,
    seed: int | None = 0,
    batch_first: bool = True,
) -> tuple[Any, ...]:
    """``(engine, module, optimizer, criterion)`` with randomized clipping (sketch ``k``)."""
    engine = PrivacyEngine()
    ds = TensorDataset(torch.zeros(4 * B, 1), torch.zeros(4 * B, dtype=torch.long))
    module, opt, crit, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0),
        data_loader=DataLoader(ds, batch_size=B),
        noise_multiplier=sigma,
        max_grad_norm=C,
        clipping="randomized",
        sketch_dim=k,
        bookkeeping=bookkeeping,
        batch_first=batch_first,
        criterion=nn.CrossEntropyLoss(),
        sketch_generator=None if seed is None else torch.Generator().manual_seed(seed),
    )
    return engine, module, opt, crit


def per_sample_oracle(
    model: nn.Module, loss_of: Callable[[nn.Module, int], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``{name: (B, *shape)}`` float64 per-sample gradients of ``loss_of(ref, i)``, one
    backward per sample on a float64 copy."""
    ref = copy.deepcopy(model).double()
    params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    out: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    for i in range(B):
        grads = torch.autograd.grad(loss_of(ref, i), list(params.values()), allow_unused=True)
        for (n, p), g in zip(params.items(), grads, strict=True):
            out[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(v) for n, v in out.items()}


def total_norms(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)


def check_step(
    model: nn.Module,
    module: Any,
    want: dict[str, torch.Tensor],
    *,
    C: float,
    rtol_sq: float,
) -> torch.Tensor:
    """Norms and the clipped sum (``p.grad`` after the private backward) against the oracle.

    Returns the clip factors the engine used.
    """
    true = total_norms(want)
    got = module.get_norm_sample().double()
    zero = true == 0  # e.g. an empty bag: no gradient, norm exactly 0
    assert bool((got[zero] == 0).all()), (got, true)
    ratio = torch.where(zero, torch.ones_like(got), got / true).square()
    assert bool(((ratio - 1).abs() <= rtol_sq).all()), (got, true)
    coef = (C / (got + 1e-6)).clamp(max=1.0)
    coef_true = (C / (true + 1e-6)).clamp(max=1.0)
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert set(grads) == set(want)
    rel = (ratio.sqrt() - 1).abs().max() / (1 - (ratio.sqrt() - 1).abs().max())
    for name, g in want.items():
        assert grads[name] is not None, name
        torch.testing.assert_close(
            grads[name].double(), torch.einsum("b,b...->...", coef, g), rtol=1e-4, atol=1e-7
        )
        # Against the oracle's own clipped sum: |c_i - c*_i| <= c*_i |n_i / n_hat_i - 1|.
        gap = (grads[name].double() - torch.einsum("b,b...->...", coef_true, g)).norm()
        bound = sum(float(coef_true[i] * rel * g[i].norm()) for i in range(len(g)))
        assert float(gap) <= bound + 1e-6 * (1 + float(g.norm())), name
    return coef


def tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        use_cache=False,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).train()
