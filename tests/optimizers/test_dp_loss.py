"""The DP loss (``DPLossRandomizedClipping`` and the per-sample losses it is given): shapes it
cannot match to the batch, backward arguments it cannot honour, accumulation, arithmetic on the
loss and masked criteria are refused or warned about clearly (tests/reliability/CATALOGUE.md).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc.privacy_engine import PrivacyEngine
from tests import flat_mlp, float64_oracle, private_mlp

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
        module.private_step.reset()


def clipped_sum_oracle(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """float64 ``sum_i min(1, C/||g_i||) g_i`` of ``model``'s per-sample cross-entropy
    gradients, by one autograd call per sample: ``p.grad`` after the private backward (the
    optimizer divides by the expected batch size at ``step()``)."""
    ref = flat_mlp.FlatMLP().double()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for i in range(len(x)):
        loss = nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(ref.parameters()))
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        factor = min(1.0, flat_mlp.C / float(norm))
        for t, g in zip(total, grads, strict=True):
            t += factor * g
    return total


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
    engine, module, opt, crit, _ = flat_mlp.private(flat_mlp.FlatMLP())
    x, y = flat_mlp.batch()
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
    model = flat_mlp.FlatMLP()
    engine, module, opt, crit, _ = flat_mlp.private(model, seq=True)
    x, _ = flat_mlp.batch(seq=True)
    tokens = torch.randint(
        0, flat_mlp.CLASSES, (flat_mlp.B, flat_mlp.T), generator=torch.Generator().manual_seed(2)
    )
    logits = module(x)  # (B, T, CLASSES)
    with pytest.raises(ValueError, match=r"shape \(4, 4\).*shape=logits.shape"):
        crit(logits.transpose(1, 2), tokens).backward()
    opt.zero_grad()
    logits = module(x)
    crit(logits.reshape(-1, flat_mlp.CLASSES), tokens.reshape(-1), shape=logits.shape).backward()
    opt.step()
    assert len(engine.accountant) == 1


# --------------------------------------------------------------------------------------------
# meta-pytorch/opacus#792 (2025-10): "Fast gradient clipping ignores masking": each sample's
# per-token loss was averaged over all T positions, ignore_index ones included. Opacus' fix
# reads the targets from the second positional argument only.
# --------------------------------------------------------------------------------------------

V, T = 7, 5


SKETCH_K = 8192


class TinyLM(nn.Module):
    """Embedding, then a linear head on (B, T, d): the head's norm is sketched."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, float64_oracle.H)
        self.head = nn.Linear(float64_oracle.H, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def lm_loader() -> DataLoader:
    ids = torch.randint(0, V, (16, T), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids, ids), batch_size=float64_oracle.B)


# --------------------------------------------------------------------------------------------
# meta-pytorch/opacus PR 668 (2024-08): the DP loss got tensor arithmetic ("loss + other") so
# that ghost clipping's loss behaves like PyTorch's. Adding a plain batch-level tensor that
# requires grad broadcasts it into every sample's loss.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bookkeeping", [True, False], ids=["book-keeping", "two-passes"])
@pytest.mark.parametrize(
    "combine",
    [
        lambda crit, out, y, model: (
            crit(out, y) + nn.functional.cross_entropy(out, (y + 1) % float64_oracle.K)
        ),
        lambda crit, out, y, model: crit(out, y) + 0.01 * (model.lin1.weight**2).sum(),
        lambda crit, out, y, model: crit(out, y) * model.lin2.bias.sum().exp(),
    ],
    ids=["plus-batch-mean-loss", "plus-weight-penalty", "times-parameter"],
)
def test_batch_level_tensor_in_the_dp_loss_is_refused(bookkeeping: bool, combine: Any) -> None:
    """Before: ``crit(out, y) + F.cross_entropy(out, y2)`` was accepted. With two backward
    passes the released gradient was ``sum_i c_i g_i + mean(c) sum_j g'_j``: one sample's
    ``g'`` is scaled by the mean clip factor, not its own (measured: a released norm of 962
    for a bound of B C = 2, one sample's input scaled by 1000). With book-keeping the numbers
    happened to be right for this separable term, but a penalty of the weights reached the
    loss of every sample. Now the arithmetic raises a TypeError naming the fix, and the
    per-sample form (two DP losses added, or a (B,) tensor) equals the float64 oracle."""
    torch.manual_seed(0)
    model = float64_oracle.MLP()
    engine, module, opt, crit = float64_oracle.private(model, lr=0.0, bookkeeping=bookkeeping)
    x, y = float64_oracle.batch()
    with pytest.raises(TypeError, match=r"requires grad.*every sample's loss.*weight_decay"):
        combine(crit, module(x), y, model)
    y2 = (y + 1) % float64_oracle.K
    # The per-sample forms: two DP losses, and a per-sample tensor of shape (B,).
    expected, _ = float64_oracle.clipped_sum_oracle(
        model,
        x,
        lambda ref, i: (
            nn.functional.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1])
            + nn.functional.cross_entropy(ref(x[i : i + 1].double()), y2[i : i + 1])
        ),
    )
    out = module(x)
    (crit(out, y) + crit(out, y2)).backward()
    float64_oracle.assert_grads_equal(model, expected)
    opt.step()
    opt.zero_grad()
    out = module(x)
    per_sample = nn.functional.cross_entropy(out, y2, reduction="none")
    (crit(out, y) + per_sample).backward()
    float64_oracle.assert_grads_equal(model, expected)
    opt.step()
    assert len(engine.accountant) == 2


@pytest.mark.parametrize(
    "call",
    [
        lambda crit, logits, labels: crit(
            logits.reshape(-1, V), labels.reshape(-1), shape=logits.shape
        ),
        lambda crit, logits, labels: crit(
            logits.reshape(-1, V), target=labels.reshape(-1), shape=logits.shape
        ),
        lambda crit, logits, labels: crit(
            input=logits.reshape(-1, V), target=labels.reshape(-1), shape=logits.shape
        ),
    ],
    ids=["positional", "target-keyword", "both-keywords"],
)
def test_per_token_loss_leaves_ignored_positions_out_of_each_mean(call: Any) -> None:
    """Labels with ignore_index = -100 at 3, 5 (all) and 1 of the T = 5 positions of three
    samples. Each sample's loss must be the mean over its own non-ignored positions (0 for the
    fully ignored one). Before: correct by position, but with ``target=`` passed by keyword
    Opacus' ignore_index branch was skipped: sample 0's loss was 0.681 instead of 1.703 (2 of
    5 positions), and no warning (the criterion has an ignore_index). Now the same for all
    three call forms: the per-sample losses equal the float64 masked means to float32 rounding,
    and the per-sample gradient norms equal the float64 oracle's within the sketch's spread
    (k = 8192, see below)."""
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model).double()
    engine = PrivacyEngine()
    module, opt, crit, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=lm_loader(),
        noise_multiplier=float64_oracle.SIGMA,
        max_grad_norm=float64_oracle.C,
        clipping="randomized",
        sketch_dim=SKETCH_K,
        criterion=nn.CrossEntropyLoss(ignore_index=-100),
    )
    ids = torch.randint(0, V, (float64_oracle.B, T), generator=torch.Generator().manual_seed(3))
    labels = ids.roll(1, dims=1)
    labels[0, 2:] = -100
    labels[1, :] = -100
    labels[2, 4:] = -100
    oracle_losses, oracle_norms = [], []
    for i in range(float64_oracle.B):
        keep = labels[i] != -100
        if keep.any():
            loss = nn.functional.cross_entropy(ref(ids[i : i + 1])[0][keep], labels[i][keep])
            grads = torch.autograd.grad(loss, list(ref.parameters()))
            oracle_losses.append(float(loss))
            oracle_norms.append(float(torch.sqrt(sum((g**2).sum() for g in grads))))
        else:
            oracle_losses.append(0.0)
            oracle_norms.append(0.0)
    logits = module(ids)
    loss = call(crit, logits, labels)
    torch.testing.assert_close(
        loss.loss_per_sample.double(), torch.tensor(oracle_losses, dtype=torch.float64)
    )
    loss.backward()
    norms = module.per_sample_gradient_norms.double()
    # The head's squared norm is a Hutchinson estimate with k Gaussian probes: relative
    # standard deviation at most sqrt(2/k), so the norm's is at most sqrt(1/(2k)) (delta
    # method), 0.0078 at k = 8192; the embedding's part is exact. 6 standard deviations.
    torch.testing.assert_close(
        norms,
        torch.tensor(oracle_norms, dtype=torch.float64),
        rtol=6 * (2 * SKETCH_K) ** -0.5,
        atol=1e-6,
    )
    opt.step()
    assert len(engine.accountant) == 1
