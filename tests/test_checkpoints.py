"""Checkpoints: Opacus' engine save/load of model, optimizer and RC accountant (with the sketch
specs in its history) resume training and report the same epsilon as an uninterrupted run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import (
    DataLoader,
    TensorDataset,
)

from opacus_rc.privacy_engine import PrivacyEngine
from opacus_rc.sketching import SketchSpec
from tests.engine import private_loaders

D, H, CLASSES, T = 5, 6, 3, 4
DELTA = 1e-5


class SeqMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x))).mean(1)


def setup(sketch_dim: int = 32) -> tuple[PrivacyEngine, nn.Module, Any, Any, Any, Any]:
    torch.manual_seed(0)
    model = SeqMLP()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(16, T, D, generator=g), torch.randint(0, 3, (16,), generator=g)
    )
    engine = PrivacyEngine()
    module, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        data_loader=DataLoader(data, batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=sketch_dim,
    )
    return engine, model, module, opt, crit, loader


def train(module: Any, opt: Any, crit: Any, loader: Any, steps: int) -> None:
    done = 0
    while done < steps:
        for x, y in loader:
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
            done += 1
            if done == steps:
                return


def test_resume_reports_the_uninterrupted_epsilon(tmp_path: Any) -> None:
    """3 steps, save, new engine/model/optimizer, load, 2 more steps: the model, the momentum
    buffers and the accountant history (with its sketch specs) are restored, and epsilon equals
    that of an uninterrupted 5-step run; the checkpoint loads with weights_only=True."""
    engine, model, module, opt, crit, loader = setup()
    train(module, opt, crit, loader, 5)
    eps_uninterrupted = engine.get_epsilon(DELTA)

    engine, model, module, opt, crit, loader = setup()
    train(module, opt, crit, loader, 3)
    path = tmp_path / "rc.ckpt"
    engine.save_checkpoint(path=path, module=module, optimizer=opt)
    saved_params = {k: v.clone() for k, v in model.state_dict().items()}
    saved_momentum = [opt.state[p]["momentum_buffer"].clone() for p in opt.params]
    ckpt = torch.load(path, weights_only=True)
    spec = SketchSpec("hutchinson", 32).to_dict()
    assert ckpt["privacy_accountant_state_dict"]["history"] == [(1.0, 0.25, 3, spec)]

    engine2, model2, module2, opt2, crit2, loader2 = setup()
    train(module2, opt2, crit2, loader2, 1)  # diverge first: loading must overwrite this
    engine2.load_checkpoint(path=path, module=module2, optimizer=opt2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, saved_params[k])
    for p, m in zip(opt2.params, saved_momentum, strict=True):
        assert torch.equal(opt2.state[p]["momentum_buffer"], m)
    assert len(engine2.accountant) == 3
    train(module2, opt2, crit2, loader2, 2)
    assert engine2.accountant.history == [(1.0, 0.25, 5, spec)]
    assert engine2.get_epsilon(DELTA) == pytest.approx(eps_uninterrupted, abs=1e-12)


def test_resume_with_another_sketch_dim_composes_both(tmp_path: Any) -> None:
    """The specs travel with the steps: resuming with k = 16 after k = 32 gives a
    heterogeneous history, accounted per segment (more than 32 throughout, less than 16)."""
    engine, model, module, opt, crit, loader = setup(sketch_dim=32)
    train(module, opt, crit, loader, 2)
    engine.save_checkpoint(path=tmp_path / "a.ckpt", module=module, optimizer=opt)
    engine16, model16, module16, opt16, crit16, loader16 = setup(sketch_dim=16)
    engine16.load_checkpoint(path=tmp_path / "a.ckpt", module=module16, optimizer=opt16)
    train(module16, opt16, crit16, loader16, 2)
    history = engine16.accountant.history
    assert [h[3]["sketch_dim"] for h in history] == [32, 16] and [h[2] for h in history] == [2, 2]
    mixed = engine16.get_epsilon(DELTA)
    for k in (32, 16):
        engine16.accountant.history = [(1.0, 0.25, 4, SketchSpec("hutchinson", k).to_dict())]
        bound = engine16.get_epsilon(DELTA)
        assert (mixed > bound) if k == 32 else (mixed < bound)


# ----------------------------------------------------------------------------------------------
# Item 12: checkpoint weights for the plain model
# ----------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Secure RNG turned off")
def test_checkpoint_weights_load_into_the_plain_model(tmp_path: Any) -> None:
    """Issue 20 item 12: the checkpoint's ``module_state_dict`` keys carry ``_module.``, so
    ``plain.load_state_dict(...)`` raised ``Missing key(s) in state_dict: "lin1.weight", ...``.
    ``unwrap_state_dict`` gives the plain model's keys: loaded strictly, the weights and the
    outputs equal the trained private model's."""
    from opacus_rc import unwrap_state_dict

    engine, (module, optimizer, criterion, loader) = private_loaders.private(
        DataLoader(private_loaders.dataset(12), batch_size=private_loaders.B)
    )
    for x, y in loader:
        if len(y):
            criterion(module(x), y).backward()
            optimizer.step()
        else:
            optimizer.noise_only_step()
        optimizer.zero_grad()
    path = tmp_path / "run.ckpt"
    engine.save_checkpoint(path=path, module=module, optimizer=optimizer)
    saved = torch.load(path, weights_only=True)["module_state_dict"]
    assert all(key.startswith("_module.") for key in saved)

    plain = private_loaders.MLP()
    with pytest.raises(RuntimeError, match="Missing key"):
        plain.load_state_dict(saved)
    plain.load_state_dict(unwrap_state_dict(saved))  # strict
    trained = dict(module._module.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(p, trained[name]), name
    x = private_loaders.dataset(3, seed=5).tensors[0]
    assert torch.equal(plain(x), module(x))
    assert list(unwrap_state_dict(plain.state_dict())) == list(plain.state_dict())


@pytest.mark.filterwarnings("ignore:Secure RNG turned off")
def test_unwrap_state_dict_refuses_a_mixed_state_dict() -> None:
    from opacus_rc import unwrap_state_dict

    state = {"_module.lin1.weight": torch.zeros(1), "lin2.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="only some keys carry the '_module.' prefix"):
        unwrap_state_dict(state)
    twice = {"_module._module.lin1.weight": torch.zeros(1)}
    assert list(unwrap_state_dict(twice)) == ["lin1.weight"]
