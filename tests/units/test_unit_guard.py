"""The criterion's ``units=`` and ``unit_split=`` are checked against what the loader yielded
(docs/privacy/units.md#units-limits; the user report's section A, items 2, 3 and 6).

Per-unit clipping bounds a unit's contribution by ``C`` only if ``units=`` groups the batch's
sequences as the unit loader sampled them: without ``units=`` a unit of 8 sequences
contributed 2.93 C (each sequence clipped alone) while accounted as one unit; ``units=`` under
a per-sequence loader does not bound a *sequence's* contribution by ``C``. Each refusal is
raised at the criterion call, before any backward, noise or accounting: the tests assert the
accountant recorded nothing and the parameters did not move.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc import PrivacyEngine, UnitDataLoader

pytestmark = [
    pytest.mark.filterwarnings("ignore:noise_multiplier=0"),
    pytest.mark.filterwarnings("ignore:RCAccountant recorded a step without noise"),
    pytest.mark.filterwarnings("ignore:the accountant's epsilon assumes Poisson"),
]

V, T, C = 11, 4, 5
UNIT_OF = torch.tensor([0] * 8 + [1, 1, 2, 3, 3, 3])  # a unit of 8 sequences, then 1 to 3


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = len(UNIT_OF)
    return TensorDataset(torch.randint(0, V, (n, T), generator=g), torch.arange(n))


def private(loader: DataLoader):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, 6), nn.Linear(6, C))
    engine = PrivacyEngine(accountant="rc")
    m, opt, crit, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        criterion=nn.CrossEntropyLoss(),
        poisson_sampling=isinstance(loader, UnitDataLoader),
    )
    return engine, model, m, opt, crit, dl


def unit_loader() -> UnitDataLoader:
    return UnitDataLoader(
        dataset(), unit_of=UNIT_OF, sample_rate=1.0, generator=torch.Generator().manual_seed(0)
    )


def loss_of(m, crit, x, index, **kw):
    out = m(x)
    y = (index[:, None] + torch.arange(T)) % C
    return crit(out.reshape(-1, C), y.reshape(-1), shape=out.shape, **kw)


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("bad", ["omitted", "each_own", "all_merged", "other_grouping"])
def test_units_that_are_not_the_loaders_batch_are_refused(bad: str) -> None:
    engine, model, m, opt, crit, dl = private(unit_loader())
    before = params(model)
    ((x, index, units),) = list(dl)
    assert units.tolist() == UNIT_OF.tolist()  # sample_rate=1: every unit, in order
    kw = {
        "omitted": {},
        "each_own": {"units": torch.arange(len(units))},
        "all_merged": {"units": torch.zeros_like(units)},
        "other_grouping": {"units": torch.tensor([0] * 4 + [1] * 4 + [2, 2, 3, 4, 4, 4])},
    }[bad]
    match = "without units=" if bad == "omitted" else "does not group the batch's sequences"
    with pytest.raises(ValueError, match=match):
        loss_of(m, crit, x, index, **kw).backward()
    opt.zero_grad()
    assert not engine.accountant.history
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_relabelled_units_are_the_same_partition_and_are_accepted() -> None:
    """Labels 0..3 renamed 3..0 (any labels name the same units): accepted, four units
    clipped, one step accounted."""
    engine, model, m, opt, crit, dl = private(unit_loader())
    ((x, index, units),) = list(dl)
    loss_of(m, crit, x, index, units=3 - units).backward()
    assert m.per_sample_gradient_norms.shape == (4,)
    opt.step()
    assert [tuple(h)[1:3] for h in engine.accountant.history] == [(1.0, 1)]


def test_units_with_a_per_sequence_loader_are_refused() -> None:
    """units= under per-sequence sampling: accounted per sequence, yet one sequence's removal
    can change its unit's clipped sum by up to 2 C. Refused, not warned."""
    loader = DataLoader(dataset(), batch_size=len(UNIT_OF))
    engine, model, m, opt, crit, dl = private(loader)
    before = params(model)
    x, index = next(iter(dl))
    with pytest.raises(ValueError, match="per-sequence data loader"):
        loss_of(m, crit, x, index, units=UNIT_OF)
    assert not engine.accountant.history
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    engine, model, m, opt, crit, dl = private(loader)
    loss_of(m, crit, x, index).backward()  # without units=: per-sequence DP, as accounted
    opt.step()
    assert len(engine.accountant.history) == 1
