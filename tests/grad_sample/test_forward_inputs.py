"""What the forward hook stores of one call (issue 20 item 6, round 3).

Opacus' forward hook sees the positional inputs only, so ``fc(input=x)`` stored nothing and the
backward failed with ``IndexError: list index out of range``. The randomized-clipping module
binds keyword arguments to their positions in ``forward``'s signature; these tests check the
binding's edge cases directly on the stored activations, and the error for what cannot be
stored (the numbers against the oracle are in the keyword tests below and in
tests/grad_sample/test_routing.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import (
    DataLoader,
    TensorDataset,
)

from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.grad_sample.checkpointing import NoEarlyStop
from opacus_rc.privacy_engine import PrivacyEngine
from tests.engine import private_loaders
from tests.grad_sample import layer_oracle


class Scaled(nn.Module):
    """A leaf layer (functorch path) with an optional non-tensor argument."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return x * self.weight * scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.scaled = Scaled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled(x=self.fc(input=x))


def stored(gsm: GradSampleModuleRandomizedClipping, module: nn.Module) -> list[torch.Tensor]:
    acts = module.activations[-1]
    gsm.private_step.reset()
    return acts


def test_keywords_are_stored_at_their_positions_and_defaults_are_not() -> None:
    torch.manual_seed(0)
    model = Net()
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, sketch_dim=4)
    x = torch.randn(2, 3)
    out = gsm(x)
    with torch.no_grad():
        h = model.fc(x)
    (a,) = model.fc.activations[-1]
    torch.testing.assert_close(a, x)
    (b,) = model.scaled.activations[-1]  # scale=2.0 left at its default: not stored
    torch.testing.assert_close(b, h)
    assert out.shape == (2, 3)
    gsm.private_step.reset()
    gsm.cleanup()


def test_a_non_tensor_input_is_refused_naming_the_module() -> None:
    model = Net()
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, sketch_dim=4)
    with pytest.raises(TypeError, match=r"'scaled' \(Scaled\) was called with a float as input 1"):
        model.scaled(torch.randn(2, 3), 3.0)
    assert not getattr(model.scaled, "activations", None)
    with torch.no_grad():  # not recorded: anything goes
        model.scaled(torch.randn(2, 3), 3.0)
    gsm.cleanup()


def test_arguments_that_do_not_match_the_signature_are_refused() -> None:
    model = Net()
    gsm = GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, sketch_dim=4)
    with pytest.raises(TypeError):  # PyTorch's own error from the call itself
        model.fc(inputs=torch.randn(2, 3))
    gsm.cleanup()


def test_no_early_stop_is_entered_once_and_left_after_a_failed_forward() -> None:
    """Nested modules enter the context once (the outermost); a forward that raises leaves
    every entry (the hooks run with always_call), so nothing stays entered after the call."""
    outer = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    handles: list = []
    seen: list[list[bool]] = []
    no_stop = NoEarlyStop([outer, outer[0]], handles, active=lambda: True)

    def probe(_m: nn.Module, _args: object) -> None:
        seen.append([ctx is not None for _, ctx in no_stop._contexts])

    handles.append(outer[0][0].register_forward_pre_hook(probe))
    outer(torch.randn(1, 2))
    assert seen == [[True, False]] and no_stop._contexts == []
    with pytest.raises(RuntimeError):
        outer(torch.randn(1, 3))
    assert no_stop._contexts == []
    for h in handles:
        h.remove()


# ----------------------------------------------------------------------------------------------
# Item 10: an empty Poisson batch on a Hugging Face model
# ----------------------------------------------------------------------------------------------


def tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


@pytest.mark.filterwarnings("ignore:Secure RNG turned off")
def test_empty_poisson_batch_on_an_hf_model_says_what_to_do() -> None:
    """Issue 20 item 10: an empty Poisson batch crashed inside the model (``cannot reshape
    tensor of 0 elements``). Now the error says it was an empty batch and names
    ``optimizer.noise_only_step()`` and ``rand_on_empty=True``; the original error is its
    cause, nothing recorded is left behind, and the noise-only step is then noised and
    accounted."""
    model = tiny_llama()
    ids = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(0))
    engine = PrivacyEngine()
    module, optimizer, _, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(ids, ids), batch_size=2),
        noise_multiplier=private_loaders.SIGMA,
        max_grad_norm=private_loaders.C,
        clipping="randomized",
        sketch_dim=4,
    )
    empty = ids[:0]
    with pytest.raises(RuntimeError, match="empty batch") as info:
        module(input_ids=empty, attention_mask=torch.ones_like(empty))
    message = str(info.value)
    assert "optimizer.noise_only_step()" in message and "rand_on_empty=True" in message
    assert info.value.__cause__ is not None
    optimizer.noise_only_step()
    assert len(engine.accountant.history) == 1


# ------------------------------------------------------------------------------------------------
# Item 6: a layer called with keyword arguments
# ------------------------------------------------------------------------------------------------


class Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(5, 6)
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(input=self.norm(input=self.fc(input=x)))


class KeywordOnly(nn.Module):
    """A leaf layer (functorch path) whose forward takes a keyword-only tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x * self.weight * scale


@pytest.mark.filterwarnings("ignore:a sketch_generator was passed:UserWarning")
@pytest.mark.filterwarnings("ignore:book-keeping \\(one backward pass\\) is off:UserWarning")
@pytest.mark.parametrize("bookkeeping", [True, False])
def test_layers_called_with_keyword_arguments(bookkeeping: bool) -> None:
    """``self.fc(input=x)`` gave a bare ``IndexError: list index out of range`` in backward
    (Opacus' forward hook sees positional inputs only). The keyword inputs are now bound to
    their positions: the norms and the clipped sum equal the oracle's."""
    model = Keywords()
    g = torch.Generator().manual_seed(2)
    x, y = (
        torch.randn(layer_oracle.B, 5, generator=g) * 2,
        torch.randint(0, 3, (layer_oracle.B,), generator=g),
    )

    def loss_of(ref: nn.Module, i: int) -> torch.Tensor:
        return nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1])

    want = layer_oracle.per_sample_oracle(model, loss_of)
    C = float(layer_oracle.total_norms(want).median())
    _, module, opt, crit = layer_oracle.private(model, C=C, bookkeeping=bookkeeping)
    crit(module(x), y).backward()
    layer_oracle.check_step(model, module, want, C=C, rtol_sq=2 * layer_oracle.EXACT_RTOL)
    opt.step()


@pytest.mark.filterwarnings("ignore:a sketch_generator was passed:UserWarning")
@pytest.mark.filterwarnings("ignore:book-keeping \\(one backward pass\\) is off:UserWarning")
def test_keyword_only_tensor_argument_is_refused_naming_the_module() -> None:
    """A keyword-only argument cannot reach the per-sample gradient (Opacus replays the layer
    on its positional inputs): refused before the backward, naming the module and argument."""
    model = nn.Sequential()
    model.add_module("scaled", KeywordOnly())
    model.add_module("head", nn.Linear(4, 3))
    _, module, opt, crit = layer_oracle.private(model, C=1.0)
    x = torch.randn(layer_oracle.B, 4)
    with pytest.raises(TypeError, match=r"'scaled' \(KeywordOnly\).*keyword-only.*\['scale'\]"):
        module.scaled(x, scale=torch.full((layer_oracle.B, 1), 2.0))
    assert not getattr(model.scaled, "activations", None)  # nothing left recorded
