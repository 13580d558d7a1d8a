"""Activation checkpointing under randomized clipping (issue 13, item 1).

A recomputed forward is not a reuse: with HF ``gradient_checkpointing_enable()`` (both
``use_reentrant`` values) and with ``torch.utils.checkpoint`` directly, the per-sample norms
and the clipped gradients equal those of the same step without checkpointing, in book-keeping
and two-pass mode. The probes come from one seeded generator per run, drawn in the same
backward order, so the sketched norms agree to float rounding (the float64 oracle is not
needed: the non-checkpointed run is itself checked against it in test_hf_models.py). Before
this, non-reentrant checkpointing raised "ran more than once ... (a reused module or tied
weights)" and reentrant + book-keeping raised PyTorch's "checkpoint is not compatible with
.grad() or when an `inputs` parameter is passed to .backward()".
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.optimizers import DPLossRandomizedClipping, RandomizedClipOptimizer

transformers = pytest.importorskip("transformers")

VOCAB, B, T = 32, 3, 7


def tiny_llama(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        use_cache=False,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).train()


def one_step(
    model: nn.Module, *, bookkeeping: bool | str, checkpointed: bool = False
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One private step at sigma = 0 with a fixed sketch; returns (norms, clipped gradients)."""
    gsm = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=0.05,
        sketch_dim=16,
        sketch_generator=torch.Generator().manual_seed(7),
        bookkeeping=bookkeeping,
    )
    assert gsm.bookkeeping is bool(bookkeeping)
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        grad_sample_module=gsm,
        noise_multiplier=0.0,
        expected_batch_size=B,
    )
    crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss(), "mean")
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    logits = gsm(input_ids=ids).logits[:, :-1]
    crit(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), shape=(B, T - 1)).backward()
    # The policy: checkpointed steps take two passes unless bookkeeping="always".
    one_pass = bookkeeping == "always" or (bookkeeping is True and not checkpointed)
    assert gsm.step_bookkeeping is one_pass
    norms = gsm.per_sample_gradient_norms.clone()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    gsm.cleanup()
    return norms, grads


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("bookkeeping", [True, False, "always"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gradient_checkpointing_gives_the_same_step(bookkeeping: Any, reentrant: bool) -> None:
    base = tiny_llama()
    want_norms, want = one_step(copy.deepcopy(base), bookkeeping=bookkeeping)
    model = copy.deepcopy(base)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    norms, got = one_step(model, bookkeeping=bookkeeping, checkpointed=True)
    # Same probes, same data: equal up to float32 summation order in the recomputation.
    torch.testing.assert_close(norms, want_norms, rtol=1e-5, atol=1e-7)
    assert set(got) == set(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-7, msg=name)


class Blocks(nn.Module):
    """An input layer, then two MLP blocks, each checkpointed with torch.utils.checkpoint
    directly (reentrant checkpointing gives no gradient to a region none of whose inputs
    requires one, so the blocks see the input layer's output)."""

    def __init__(self, *, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8)) for _ in range(2)
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            if self.reentrant is None:
                x = x + block(x)
            else:
                x = x + torch_checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x).mean(1)


@pytest.mark.parametrize("bookkeeping", [True, False])
@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_directly(bookkeeping: bool, reentrant: bool) -> None:
    torch.manual_seed(0)
    plain = Blocks(reentrant=None)
    ckpt = copy.deepcopy(plain)
    ckpt.reentrant = reentrant
    x = torch.randn(B, T, 8)
    y = torch.randint(0, 3, (B,))
    out = []
    for model in (plain, ckpt):
        gsm = GradSampleModuleRandomizedClipping(
            model,
            max_grad_norm=0.1,
            sketch_dim=8,
            sketch_generator=torch.Generator().manual_seed(3),
            bookkeeping=bookkeeping,
        )
        opt = RandomizedClipOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            grad_sample_module=gsm,
            noise_multiplier=0.0,
            expected_batch_size=B,
        )
        crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss(), "mean")
        crit(gsm(x), y).backward()
        norms = gsm.per_sample_gradient_norms.clone()
        out.append((norms, [p.grad.clone() for p in model.parameters()]))
        opt.step()
        gsm.cleanup()
    (n0, g0), (n1, g1) = out
    torch.testing.assert_close(n1, n0, rtol=1e-5, atol=1e-7)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_checkpointed_forward_keeps_no_activations() -> None:
    """The memory checkpointing saves is kept: after the forward, no hooked module inside a
    non-reentrant checkpoint region holds stored inputs (they are recorded when the backward
    recomputes the region); the module outside (the head) does."""
    torch.manual_seed(0)
    model = Blocks(reentrant=False)
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, sketch_dim=4)
    gsm(torch.randn(B, T, 8))
    inside = [m for blk in model.blocks for m in blk if isinstance(m, nn.Linear)]
    assert all(not getattr(m, "activations", None) for m in inside)
    assert len(model.head.activations) == 1 and len(model.inp.activations) == 1
    gsm.cleanup()
