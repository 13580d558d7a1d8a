"""Issue 14, round two: reports from Opacus' and its peers' trackers (2024-2026), tried here.

Each test is a small reproduction of a public report (cited by repository#number in its
docstring and in CATALOGUE.md, block "Issue 14, peers' trackers"), plus the three leftovers of
the new-user test (item 2 of the helper brief). Numbers are checked against float64 oracles;
where the right answer is an error, the error and its advice are checked, and the step after it
is shown to work.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc.privacy_engine import PrivacyEngine

D, H, CLASSES, T, B = 5, 6, 3, 4, 4
C = 1.0  # max_grad_norm


class FlatMLP(nn.Module):
    """MLP on (B, D): rank-2 inputs, so every norm is exact and runs compare exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)))


def data(n: int = 16, *, seq: bool = False, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, T, D) if seq else (n, D), generator=g) * 3
    return TensorDataset(x, torch.randint(0, CLASSES, (n,), generator=g))


def private(
    model: nn.Module, *, engine: Any = None, seq: bool = False, **kwargs: Any
) -> tuple[Any, ...]:
    engine = PrivacyEngine() if engine is None else engine
    args: dict[str, Any] = {
        "noise_multiplier": 1.0,
        "max_grad_norm": C,
        "clipping": "randomized",
        "sketch_dim": 8,
    }
    args.update(kwargs)
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data(seq=seq), batch_size=B),
        **args,
    )
    return (engine, *out)


def batch(*, seq: bool = False, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ds = data(B, seq=seq, seed=seed)
    return ds.tensors[0].clone(), ds.tensors[1].clone()


def clipped_sum_oracle(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """float64 ``sum_i min(1, C/||g_i||) g_i`` of ``model``'s per-sample cross-entropy
    gradients, by one autograd call per sample: ``p.grad`` after the private backward (the
    optimizer divides by the expected batch size at ``step()``)."""
    ref = FlatMLP().double()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for i in range(len(x)):
        loss = nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(ref.parameters()))
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        factor = min(1.0, C / float(norm))
        for t, g in zip(total, grads, strict=True):
            t += factor * g
    return total


# --------------------------------------------------------------------------------------------
# Leftovers of the new-user test
# --------------------------------------------------------------------------------------------


def test_passed_sketch_generator_warns_once_at_the_callers_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A user-supplied ``sketch_generator`` used to give two warnings: a UserWarning from the
    module at construction (attributed to Opacus' privacy_engine.py) and a log WARNING from the
    accountant at the first step. Now one UserWarning, at the caller's line, says both facts
    (secret=False; accounted with the 'revealed' threat model); the accounting is unchanged."""
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, module, opt, crit, _ = private(
            FlatMLP(), sketch_generator=torch.Generator().manual_seed(3)
        )
    said = [w for w in caught if "sketch_generator" in str(w.message)]
    assert len(said) == 1
    assert said[0].filename == __file__
    assert "'revealed' threat model" in str(said[0].message)
    caplog.clear()
    with caplog.at_level("WARNING"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, y = batch()
        crit(module(x), y).backward()
        opt.step()
    assert "revealed" not in caplog.text
    assert not [w for w in caught if "sketch" in str(w.message)]
    assert engine.accountant.history[-1][3]["secret"] is False  # accounted as revealed


@pytest.mark.parametrize(
    "kwargs, advice",
    [
        ({"retain_graph": True}, r"retain_graph=True.*unclipped.*\(loss \+ other\)"),
        ({"gradient": torch.tensor(2.0)}, r"scale the loss instead"),
        ({"create_graph": True}, r"create_graph=True"),
        ({"inputs": []}, r"freeze"),
    ],
    ids=["retain_graph", "gradient", "create_graph", "inputs"],
)
def test_backward_arguments_it_cannot_honour_are_refused_clearly(
    kwargs: dict[str, Any], advice: str
) -> None:
    """``loss.backward(retain_graph=True)`` used to raise a bare ``TypeError: backward() got an
    unexpected keyword argument 'retain_graph'`` (as Opacus' ``DPTensorFastGradientClipping``,
    whose ``backward()`` takes no argument). Honouring it is unsafe: measured on this model, a
    plain backward through the kept graph added its unclipped gradient to ``lin2``'s clipped
    one before any hook could object, and the two-pass step released it. So it, and the other
    ``Tensor.backward`` arguments that cannot be honoured, get a ``TypeError`` that says what to
    do, and a refused step (nothing noised or accounted); after ``zero_grad()`` training
    continues. ``retain_graph=False`` is accepted and gives the float64 oracle's gradient."""
    engine, module, opt, crit, _ = private(FlatMLP())
    x, y = batch()
    with pytest.raises(TypeError, match=advice):
        crit(module(x), y).backward(**kwargs)
    assert all(p.grad is None for p in module.parameters())
    with pytest.raises(RuntimeError, match="nothing is accounted"):
        opt.step()
    assert len(engine.accountant) == 0
    opt.zero_grad()
    expected = clipped_sum_oracle(module._module, x, y)
    crit(module(x), y).backward(retain_graph=False)
    for p, e in zip(module.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad.double(), e, rtol=1e-5, atol=1e-7)
    opt.step()
    assert len(engine.accountant) == 1


def test_per_token_loss_of_shape_b_t_without_shape_says_what_to_pass() -> None:
    """A criterion that returns per-token losses of shape (B, T) (``nn.CrossEntropyLoss`` on
    logits laid out (B, V, T)) without ``shape=`` used to give PyTorch's bare "grad can be
    implicitly created only for scalar outputs". It now says to flatten and pass
    ``shape=logits.shape``; doing so works and is accounted."""
    model = FlatMLP()
    engine, module, opt, crit, _ = private(model, seq=True)
    x, _ = batch(seq=True)
    tokens = torch.randint(0, CLASSES, (B, T), generator=torch.Generator().manual_seed(2))
    logits = module(x)  # (B, T, CLASSES)
    with pytest.raises(ValueError, match=r"shape \(4, 4\).*shape=logits.shape"):
        crit(logits.transpose(1, 2), tokens).backward()
    opt.zero_grad()
    logits = module(x)
    crit(logits.reshape(-1, CLASSES), tokens.reshape(-1), shape=logits.shape).backward()
    opt.step()
    assert len(engine.accountant) == 1
