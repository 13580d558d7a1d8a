"""The DP loss (``DPLossRandomizedClipping`` and the per-sample losses it is given): shapes it
cannot match to the batch, backward arguments it cannot honour, accumulation, arithmetic on the
loss and masked criteria are refused or warned about clearly (tests/reliability/CATALOGUE.md).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from tests import private_mlp

pytestmark = pytest.mark.filterwarnings("ignore:a sketch_generator was passed")


class _MaskedCE(nn.Module):
    """A criterion that masks padding itself and has no ignore_index attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.reduction = "mean"

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(logits, target.clamp(min=0), reduction="none")
        loss = loss * (target >= 0)
        return loss if self.reduction == "none" else loss.mean()


def test_per_token_loss_without_shape_raises() -> None:
    """A per-token loss (B*T values) without ``shape=``: B clip factors cannot be matched to
    B*T losses; Opacus would fail in a broadcast (or, for B = 1, silently pass)."""
    model = private_mlp.SeqMLP()
    model.forward = lambda x: model.lin2(torch.tanh(model.lin1(x)))  # (B, T, CLASSES)
    engine, module, opt, crit, _ = private_mlp.private(model)
    x, _ = private_mlp.batch()
    logits = module(x)
    tokens = torch.zeros(4 * private_mlp.T, dtype=torch.long)
    with pytest.raises(ValueError, match="pass shape=logits.shape"):
        crit(logits.reshape(-1, private_mlp.CLASSES), tokens).backward()
    opt.zero_grad()
    crit(
        module(x).reshape(-1, private_mlp.CLASSES),
        tokens,
        shape=(4, private_mlp.T, private_mlp.CLASSES),
    ).backward()
    opt.step()
    assert len(engine.accountant) == 1


# --------------------------------------------------------------------------------------------
# gradient accumulation and BatchMemoryManager (Opacus #683, PR 707)
# --------------------------------------------------------------------------------------------


def test_second_backward_without_step_raises() -> None:
    """Opacus' two-pass loss zeroes gradients between its passes, so accumulating two
    backward() calls silently drops the first (#683). Here it raises and points to
    BatchMemoryManager; after step() or zero_grad() backward works again."""
    model = private_mlp.SeqMLP()
    engine, module, opt, crit, _ = private_mlp.private(model)
    x, y = private_mlp.batch()
    crit(module(x), y).backward()
    with pytest.raises(RuntimeError, match="BatchMemoryManager"):
        crit(module(x), y).backward()
    opt.step()
    opt.zero_grad()
    crit(module(x), y).backward()
    opt.step()
    assert len(engine.accountant) == 2


def test_loss_arithmetic_keeps_the_checks() -> None:
    """``loss * w + c`` (weighted or combined losses) keeps the randomized-clipping backward,
    with its checks (here: accumulation)."""
    from opacus_rc.optimizers import DPTensorRandomizedClipping

    model = private_mlp.SeqMLP()
    engine, module, opt, crit, _ = private_mlp.private(model)
    x, y = private_mlp.batch()
    loss = 0.5 * crit(module(x), y) / 2 + 1.0 - 0.0
    assert isinstance(loss, DPTensorRandomizedClipping)
    loss.backward()
    with pytest.raises(RuntimeError, match="BatchMemoryManager"):
        (-crit(module(x), y)).backward()
    opt.step()
    assert len(engine.accountant) == 1


def test_criterion_without_ignore_index_warns_once() -> None:
    """Issue 14, item 7: with shape=, Opacus averages a per-token loss over all positions when
    the criterion has no ignore_index (masked positions' zero losses count in the mean); this
    warns once, naming the fix. nn.CrossEntropyLoss does not warn."""
    torch.manual_seed(0)
    model = private_mlp.SeqMLP()
    x, y = private_mlp.batch()
    per_token = torch.full((4, 3), -1, dtype=torch.long)
    per_token[:, 0] = y
    for criterion, warns in ((nn.CrossEntropyLoss(ignore_index=-1), False), (_MaskedCE(), True)):
        engine, module, opt, crit, _ = private_mlp.private(
            copy.deepcopy(model), criterion=criterion
        )
        logits = module(x).unsqueeze(1).expand(4, 3, private_mlp.CLASSES)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                crit(logits.reshape(-1, private_mlp.CLASSES), per_token.reshape(-1), shape=(4, 3))
        hits = [w for w in caught if "has no ignore_index attribute" in str(w.message)]
        assert len(hits) == (1 if warns else 0)
        module.discard_recorded()
