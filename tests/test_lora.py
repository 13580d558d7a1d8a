"""DP-LoRA with peft under randomized clipping + spectral denoising, and the issue-820 guard.

Model: a tiny random ``LlamaForCausalLM`` (2 layers, hidden 32, vocab 64) with peft LoRA (r = 4)
on ``q_proj`` and ``v_proj``; the real SmolLM2 runs only in the tutorial smoke test.

What is proved here:

* the sketched norm sampler runs on exactly the LoRA factors (``nn.Linear`` children of peft's
  ``lora.Linear``) and never on a frozen base layer; frozen weights get no gradient and do not
  move; the LoRA factors are denoised as separate matrices;
* both device-placement orders (``.to(device)`` before and after ``get_peft_model``) train and
  pass the guard on CPU;
* the guard (:class:`opacus_rc.lora.LoRAUpdateGuard`, and ``make_private(check_lora_update=True)``)
  raises on a zero update, a non-finite update and an optimizer that does not hold the adapters,
  and accepts a model only if it has trainable adapters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, get_peft_model  # noqa: E402

from opacus_rc import PrivacyEngine, attach_post_processing_hook  # noqa: E402
from opacus_rc.grad_sample import registry  # noqa: E402
from opacus_rc.lora import LoRAUpdateError, LoRAUpdateGuard, lora_factors  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:a sketch_generator was passed"),
    pytest.mark.filterwarnings("ignore:.*non-full backward hook"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
]

VOCAB, T, N, BATCH = 64, 12, 32, 8


def tiny_llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).train()


def lora(model: nn.Module) -> nn.Module:
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(model, config)


def tokens(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (N, T), generator=g)


def lm_step(module: nn.Module, criterion: Any, optimizer: Any, x: torch.Tensor) -> None:
    """One causal-LM step: per-sequence loss (the privacy unit is a sequence)."""
    logits = module(input_ids=x).logits[:, :-1]
    loss = criterion(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1), shape=(x.shape[0], T - 1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def make_private(model: nn.Module, *, lr: float = 0.05, **kwargs: Any) -> tuple[Any, ...]:
    engine = PrivacyEngine()
    trainable = [p for p in model.parameters() if p.requires_grad]
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(trainable, lr=lr),
        data_loader=DataLoader(TensorDataset(tokens()), batch_size=BATCH),
        criterion=nn.CrossEntropyLoss(),
        noise_multiplier=0.5,
        max_grad_norm=1.0,
        clipping="randomized",
        noise_generator=torch.Generator().manual_seed(2),
        sketch_generator=torch.Generator().manual_seed(3),
        sketch_dim=8,
        **kwargs,
    )
    return (engine, *out)


def test_sketched_norms_only_for_lora_factors_and_factors_denoised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = lora(tiny_llama())
    sampled: list[nn.Module] = []
    sampler = registry.SKETCHED_NORM_SAMPLERS[nn.Linear]

    def spy(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        sampled.append(layer)
        return sampler(layer, *args, **kwargs)

    monkeypatch.setitem(registry.SKETCHED_NORM_SAMPLERS, nn.Linear, spy)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine, module, optimizer, criterion, _ = make_private(
        model, denoise="spectral", check_lora_update=True
    )
    lm_step(module, criterion, optimizer, tokens(5)[:BATCH])

    lora_linears = {
        id(m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".lora_" in n
    }
    assert len(lora_linears) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert {id(m) for m in sampled} == lora_linears  # never a base layer or lm_head
    assert len(sampled) == len(lora_linears)  # once each: one forward per step
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None and torch.equal(p, frozen[name]), name
    # Each factor is denoised as its own matrix (A: (4, 32), B: (32 or 16, 4)); no other
    # parameter is trainable, so every record is a LoRA factor and none was skipped.
    records = engine.denoiser.last_report.records
    shapes = sorted(r.shape for r in records)
    assert shapes == sorted([(4, 32)] * 4 + [(32, 4)] * 2 + [(16, 4)] * 2)
    assert {r.status for r in records} <= {"denoised", "below_threshold"}
    # B starts at 0 (peft), so the first update is carried by B: both factors of every adapter
    # moved, and the guard saw a finite non-zero update.
    report = engine.lora_update_guard.last_report
    assert report is not None and len(report.update_norms) == 4
    assert 0 < report.min_norm <= report.max_norm < math.inf


@pytest.mark.parametrize("order", ["to_before_get_peft_model", "to_after_get_peft_model"])
def test_both_device_placement_orders_train_on_cpu(order: str) -> None:
    base = tiny_llama()
    # "after" is the order of Opacus issue 820; on CPU .to() keeps the tensors, so both work.
    before = order == "to_before_get_peft_model"
    model = lora(base.to("cpu")) if before else lora(base).to("cpu")
    x = tokens(5)[:BATCH]
    with torch.no_grad():
        logits_before = model(input_ids=x).logits.clone()
    engine, module, optimizer, criterion, _ = make_private(
        model, denoise="spectral", check_lora_update=True
    )
    for step in range(2):
        lm_step(module, criterion, optimizer, tokens(6 + step)[:BATCH])
    assert engine.lora_update_guard.last_report.min_norm > 0
    with torch.no_grad():
        logits_after = model(input_ids=x).logits
    # The adapters the forward uses changed, so the model's outputs changed.
    assert (logits_after - logits_before).abs().max() > 1e-4


def test_guard_catches_a_zero_update() -> None:
    """lr = 0: the step runs, epsilon is spent, but the adapters never change (issue 820's
    symptom). The guard raises out of the first optimizer.step()."""
    model = lora(tiny_llama())
    engine, module, optimizer, criterion, _ = make_private(model, lr=0.0, check_lora_update=True)
    with pytest.raises(LoRAUpdateError, match=r"exactly zero for .*4 of 4 adapters.*issue 820"):
        lm_step(module, criterion, optimizer, tokens(5)[:BATCH])


def test_guard_catches_a_non_finite_update() -> None:
    model = lora(tiny_llama())
    engine, module, optimizer, criterion, _ = make_private(model, check_lora_update=True)
    poisoned = next(p for n, p in model.named_parameters() if "lora_B" in n)

    def poison(opt: Any) -> None:  # a released gradient with an overflow
        poisoned.grad[0, 0] = float("inf")

    attach_post_processing_hook(optimizer, poison)
    with pytest.raises(LoRAUpdateError, match=r"non-finite .*1 of 4 adapters"):
        lm_step(module, criterion, optimizer, tokens(5)[:BATCH])


def test_guard_catches_an_optimizer_without_the_adapters() -> None:
    """The direct form of the disconnect: the optimizer holds other tensors than the forward
    pass uses (here, the adapters of a copy of the model)."""
    model = lora(tiny_llama())
    other = lora(tiny_llama())
    guard = LoRAUpdateGuard(model)
    with pytest.raises(LoRAUpdateError, match=r"does not hold the LoRA factors.*\(4 adapter"):
        guard.check_optimizer(torch.optim.SGD([p for p in other.parameters() if p.requires_grad]))
    guard.check_optimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad]))


def test_guard_passes_after_a_real_step_and_reports_each_adapter() -> None:
    model = lora(tiny_llama())
    guard = LoRAUpdateGuard(model)
    assert guard.adapter_names == tuple(lora_factors(model))
    assert len(guard.adapter_names) == 4 and all("[default]" in n for n in guard.adapter_names)
    # Manual oracle: set B to a known value and compare with ||scaling * B A||_F.
    with torch.no_grad():
        for _A, B in lora_factors(model).values():
            B.fill_(0.01)
    report = guard.check()
    for name, (A, B) in lora_factors(model).items():
        expected = (2.0 * (B.double() @ A.double())).norm().item()  # scaling = alpha / r = 2
        assert report.update_norms[name] == pytest.approx(expected, rel=1e-12)


def test_guard_needs_trainable_adapters(assert_no_hooks: Callable) -> None:
    with pytest.raises(ValueError, match="no trainable peft LoRA adapter"):
        LoRAUpdateGuard(tiny_llama())
    model = lora(tiny_llama())
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable peft LoRA adapter"):
        LoRAUpdateGuard(model)
