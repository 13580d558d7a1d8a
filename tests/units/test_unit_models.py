"""Unit-level clipping on tiny Hugging Face models (issue 23, item 1): tied embeddings (Llama,
GPT-2), activation checkpointing, LoRA (peft).

Same oracle and tolerance as tests/units/test_unit_clipping.py (its module docstring derives
``RTOL = 0.06`` at ``k = 4096``: more than five standard deviations of a sketched norm). Each
check is paired with the per-sequence norm (no cross terms between a unit's sequences), which
is off by more than ``RTOL``: the checks can fail.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.optimizers import DPLossRandomizedClipping, RandomizedClipOptimizer

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiny_hf_models as hf  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:a sketch_generator was passed:UserWarning"),
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated"),
]

V, T = 48, 8
K = 4096
RTOL = 0.06
UNITS = torch.tensor([1, 0, 1, 0, 2])  # sizes 2, 2, 1; interleaved


def tiny_llama(tied: bool = True) -> nn.Module:
    return hf.llama(vocab=V, tie=tied, pad_token_id=0).train()


def tiny_gpt2() -> nn.Module:
    return hf.gpt2(vocab=V, tie=True).train()


def token_ids() -> torch.Tensor:
    x = torch.randint(1, V, (len(UNITS), T), generator=torch.Generator().manual_seed(1))
    x[2] = x[0]  # unit 1: a repeated sequence (large cross term)
    x[3, :4] = x[1, :4]
    x[4, -2:] = 0  # pad ids
    return x


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)  # per-sample position ids
    return model(input_ids=x, position_ids=pos).logits[:, :-1]


def seq_losses(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    per_token = nn.functional.cross_entropy(
        logits.reshape(-1, V), x[:, 1:].reshape(-1), reduction="none"
    )
    return per_token.view(x.shape[0], -1).mean(1)


def grads_of(model: nn.Module, x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``(G, P)`` float64 gradient of each group's summed loss (one autograd call per group)."""
    ref = copy.deepcopy(model).double()
    params = [p for p in ref.parameters() if p.requires_grad]
    rows = []
    for u in range(int(groups.max()) + 1):
        idx = torch.nonzero(groups == u).flatten()
        grads = torch.autograd.grad(seq_losses(forward(ref, x[idx]), x[idx]).sum(), params)
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


def unit_step(model: nn.Module, x: torch.Tensor, *, c: float, bookkeeping: Any = True) -> Any:
    m = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=c,
        sketch_dim=K,
        sketch_generator=torch.Generator().manual_seed(0),
        bookkeeping=bookkeeping,
    )
    opt = RandomizedClipOptimizer(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0),
        grad_sample_module=m,
        noise_multiplier=0.0,
        expected_batch_size=3,
    )
    crit = DPLossRandomizedClipping(m, opt, nn.CrossEntropyLoss(), "mean")
    logits = forward(m, x)
    loss = crit(logits.reshape(-1, V), x[:, 1:].reshape(-1), shape=logits.shape, units=UNITS)
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    norms = m.per_sample_gradient_norms.clone()
    m.cleanup()
    return norms, grad


def check_against_oracle(model: nn.Module, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x = token_ids()
    G = grads_of(model, x, UNITS)
    oracle = G.norm(dim=1)
    per_seq = grads_of(model, x, torch.arange(len(UNITS))).pow(2).sum(1)
    naive = torch.zeros(3, dtype=torch.float64).index_add(0, UNITS, per_seq).sqrt()
    assert ((naive - oracle).abs() / oracle).max() > RTOL  # the check below can fail
    c = float(oracle.min()) / 2  # every unit clipped
    norms, grad = unit_step(model, x, c=c, **kwargs)
    torch.testing.assert_close(norms, oracle, rtol=RTOL, atol=0)
    factors = (c / (norms + 1e-6)).clamp(max=1.0)
    want = (factors[:, None] * G).sum(0)
    torch.testing.assert_close(grad.double(), want, rtol=1e-3, atol=1e-6)
    return norms, grad


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tied_embeddings_per_unit_norms_and_clipped_sum(arch: str) -> None:
    """The tied embedding/LM head's joint sketch, the RMSNorm/LayerNorm and Conv1D (functorch,
    grad-sampler) and padding-idx embedding routes, all per unit."""
    check_against_oracle(tiny_llama() if arch == "llama" else tiny_gpt2())


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_same_unit_step(reentrant: bool) -> None:
    """HF gradient checkpointing: the same per-unit norms and clipped gradient as without
    (two-pass, so that both runs draw the same probes in the same order)."""
    want = unit_step(tiny_llama(), token_ids(), c=0.05, bookkeeping=False)
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    got = unit_step(model, token_ids(), c=0.05, bookkeeping=False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-7)


def test_activation_checkpointing_with_bookkeeping_matches_the_oracle() -> None:
    """Book-keeping in a checkpointed step (per-sample-gradient stash where smaller)."""
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    check_against_oracle(model, bookkeeping="always")


def test_lora_per_unit_norms_and_clipped_sum() -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
    )
    model = peft.get_peft_model(tiny_llama(tied=False), config)
    for name, p in model.named_parameters():  # B = 0 at init: move it so both factors matter
        if "lora_B" in name:
            with torch.no_grad():
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    check_against_oracle(model)
