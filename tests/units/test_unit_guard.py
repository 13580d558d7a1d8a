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
        dataset(),
        unit_of=UNIT_OF,
        sample_rate=1.0,
        generator=torch.Generator().manual_seed(0),
        expected_batch_size=4,  # public: the 4 units, all sampled
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


# ----------------------------------------------------------------------------------------------
# UnitBatchMemoryManager(split_units=True): each batch's unit_split must be the one yielded
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["omitted", "none", "whole", "plain_tuple"])
def test_a_cut_batch_without_its_own_unit_split_is_refused(bad: str) -> None:
    """The unit of 8 sequences cut into physical batches of 2: without its UnitSplit each part
    was clipped alone (2.02 C for the unit, accounted as one). Refused at the first criterion
    call: omitted, None, UnitSplit(False, False) on a batch that cuts the unit, or a plain
    tuple equal to the yielded one (not the manager's UnitSplit)."""
    from opacus_rc.units import UnitBatchMemoryManager, UnitSplit

    engine, model, m, opt, crit, dl = private(unit_loader())
    before = params(model)
    with UnitBatchMemoryManager(
        data_loader=dl, max_physical_batch_size=2, optimizer=opt, split_units=True
    ) as mem:
        x, index, units, split = next(iter(mem))
    assert split == UnitSplit(False, True)  # the first 2 of the unit of 8
    kw = {
        "omitted": {},
        "none": {"unit_split": None},
        "whole": {"unit_split": UnitSplit(False, False)},
        "plain_tuple": {"unit_split": (False, True)},
    }[bad]
    with pytest.raises(ValueError, match=r"UnitBatchMemoryManager\(split_units=True\) yielded"):
        loss_of(m, crit, x, index, units=units, **kw)
    assert not engine.accountant.history
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_a_cut_run_with_the_yielded_splits_is_one_accounted_step() -> None:
    from opacus_rc.units import UnitBatchMemoryManager

    engine, model, m, opt, crit, dl = private(unit_loader())
    parts = 0
    with UnitBatchMemoryManager(
        data_loader=dl, max_physical_batch_size=2, optimizer=opt, split_units=True
    ) as mem:
        for x, index, units, split in mem:
            loss_of(m, crit, x, index, units=units, unit_split=split).backward()
            opt.step()
            opt.zero_grad()
            parts += 1
    assert parts == 7  # 14 sequences in batches of 2
    assert [tuple(h)[1:3] for h in engine.accountant.history] == [(1.0, 1)]


def test_a_split_that_says_cut_on_a_whole_unit_batch_is_refused() -> None:
    from opacus_rc.units import UnitBatchMemoryManager, UnitSplit

    engine, model, m, opt, crit, dl = private(unit_loader())
    with UnitBatchMemoryManager(data_loader=dl, max_physical_batch_size=8, optimizer=opt) as mem:
        x, index, units = next(iter(mem))
    with pytest.raises(ValueError, match="with whole units"):
        loss_of(m, crit, x, index, units=units, unit_split=UnitSplit(False, True))
    assert not engine.accountant.history


def test_two_backwards_with_units_name_the_unit_manager() -> None:
    """Opacus' BatchMemoryManager is refused for a UnitDataLoader: the advice for two
    backward passes without a step names UnitBatchMemoryManager."""
    from opacus_rc.grad_sample.private_step import StepProtocolError

    engine, model, m, opt, crit, dl = private(unit_loader())
    ((x, index, units),) = list(dl)
    loss_of(m, crit, x, index, units=units).backward()
    with pytest.raises(StepProtocolError, match="UnitBatchMemoryManager"):
        loss_of(m, crit, x, index, units=units).backward()


def test_the_record_is_written_in_the_iterating_process_with_workers() -> None:
    """num_workers=1: the batches are collated in a worker process, the record is written
    where the loader is iterated, so the check still holds (and still refuses)."""
    loader = UnitDataLoader(
        dataset(),
        unit_of=UNIT_OF,
        sample_rate=1.0,
        steps=2,
        generator=torch.Generator().manual_seed(0),
        num_workers=1,
        expected_batch_size=4,
    )
    engine, model, m, opt, crit, dl = private(loader)
    for step, (x, index, units) in enumerate(dl):
        if step == 0:
            loss_of(m, crit, x, index, units=units).backward()
            opt.step()
            opt.zero_grad()
        else:
            with pytest.raises(ValueError, match="does not group"):
                loss_of(m, crit, x, index, units=torch.zeros_like(units))
    assert [tuple(h)[1:3] for h in engine.accountant.history] == [(1.0, 1)]
