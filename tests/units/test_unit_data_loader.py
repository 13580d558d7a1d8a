"""Unit-level Poisson sampling and accounting (issue 23, item 2).

Rate test: over ``S`` steps of ``N_u`` units at rate ``q``, the number of (unit, step)
inclusions is Binomial(``S N_u``, ``q``) (independent Bernoulli(q) draws), with standard
deviation ``sqrt(S N_u q (1 - q))``; the observed count must lie within 5 of them of ``S N_u
q`` (a two-sided 5-sigma band: a false failure has probability < 1e-6; the generator is seeded,
so the test is deterministic). A sampler at rate ``2 q`` or ``q / 2`` lies far outside it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import TensorDataset

from opacus_rc import PrivacyEngine, UnitDataLoader
from opacus_rc.units import (
    DistributedUnitDataLoader,
    DistributedUnitPoissonSampler,
    UnitBatchMemoryManager,
    UnitPoissonSampler,
    prepare_unit_data_loader,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:noise_multiplier=0"),
    pytest.mark.filterwarnings("ignore:RCAccountant recorded a step without noise"),
]

V, T, C = 11, 4, 5


def dataset(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, V, (n, T), generator=g), torch.arange(n))


def test_units_are_poisson_sampled_at_rate_q() -> None:
    n_units, q, steps = 200, 0.3, 50
    sampler = UnitPoissonSampler(
        members=[[u] for u in range(n_units)],
        sample_rate=q,
        steps=steps,
        generator=torch.Generator().manual_seed(0),
    )
    count = sum(len(b) for b in sampler)
    n = steps * n_units
    sd = math.sqrt(n * q * (1 - q))
    assert abs(count - n * q) < 5 * sd
    assert abs(count - n * 2 * q) > 5 * sd and abs(count - n * q / 2) > 5 * sd


def test_batches_hold_whole_units_with_their_labels() -> None:
    ds = dataset()
    unit_of = torch.arange(40) // 4 * 7  # 10 units (ids 0, 7, 14, ...) of 4 sequences
    loader = UnitDataLoader(
        ds,
        unit_of=unit_of,
        sample_rate=0.5,
        max_sequences_per_unit=3,
        generator=torch.Generator().manual_seed(1),
    )
    assert len(loader) == 2 and loader.num_units == 10
    assert loader.selected[2] == [8, 9, 10]  # "first": the first 3 in dataset order
    seen = 0
    for _ in range(3):
        for x, index, units in loader:
            assert units.dtype == torch.long and units.shape == (len(x),)
            for u in units.unique().tolist():  # every unit complete, labelled 0..U-1
                members = index[units == u]
                unit = int(members[0]) // 4
                assert members.tolist() == loader.selected[unit]
            if len(units):
                assert units.unique().tolist() == list(range(int(units.max()) + 1))
            seen += len(x)
    assert seen > 0


def test_random_selection_is_fixed_per_unit_and_seeded() -> None:
    """Seeded, content-blind, and per unit: a unit's selection does not change when another
    unit is added to the dataset (add/remove adjacency, docs/privacy/units.md)."""

    def loader(n: int, unit_of: torch.Tensor) -> UnitDataLoader:
        return UnitDataLoader(
            dataset(n),
            unit_of=unit_of,
            sample_rate=1.0,
            max_sequences_per_unit=5,
            selection="random",
            selection_seed=3,
        )

    a = loader(40, torch.full((40,), 9))
    b = loader(40, torch.full((40,), 9))
    assert a.selected == b.selected and a.selected[0] != list(range(5))
    assert len(a.selected[0]) == 5
    ((x, index, units),) = list(a)
    assert index.tolist() == a.selected[0] and units.tolist() == [0] * 5
    # Unit 3 (12 sequences) added before unit 9 in the dataset and in the unit order.
    c = loader(52, torch.cat([torch.full((12,), 3), torch.full((40,), 9)]))
    assert c.selected[1] == [i + 12 for i in a.selected[0]]


def test_empty_step_yields_an_empty_batch() -> None:
    loader = UnitDataLoader(
        dataset(4),
        unit_of=[0, 0, 1, 1],
        sample_rate=1e-9,
        steps=1,
        generator=torch.Generator().manual_seed(0),
    )
    ((x, index, units),) = list(loader)
    assert x.shape == (0, T) and units.shape == (0,)


def test_dict_batches_get_a_units_key() -> None:
    class Dicts(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": torch.full((T,), i)}

    loader = UnitDataLoader(Dicts(), unit_of=[5, 5, 6, 6, 6, 7], sample_rate=1.0)
    (batch,) = list(loader)
    assert batch["units"].tolist() == [0, 0, 1, 1, 1, 2]


def make_private(loader: UnitDataLoader, noise: float = 1.0, **kwargs: Any):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, 6), nn.Linear(6, C))
    engine = PrivacyEngine(accountant="rc")
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=noise,
        max_grad_norm=1.0,
        clipping="randomized",
        criterion=nn.CrossEntropyLoss(),
        **kwargs,
    )
    return engine, *out


def train(engine, m, opt, crit, loader, epochs: int = 1) -> int:
    steps = 0
    for _ in range(epochs):
        for x, index, units in loader:
            opt.zero_grad()
            out = m(x)
            y = (index[:, None] + torch.arange(T)) % C
            loss = crit(out.reshape(-1, C), y.reshape(-1), shape=out.shape, units=units)
            loss.backward()
            assert m.per_sample_gradient_norms.shape == (int(units.numel() and units.max() + 1),)
            opt.step()
            steps += 1
    return steps


def test_engine_accounts_the_unit_rate_and_divides_by_expected_units() -> None:
    unit_of = torch.arange(40) // 3  # 14 units
    loader = UnitDataLoader(
        dataset(),
        unit_of=unit_of,
        sample_rate=0.25,
        generator=torch.Generator().manual_seed(0),
        expected_batch_size=3,  # public: the expected units per step (issue 30)
    )
    engine, m, opt, crit, dl = make_private(loader)
    assert dl is loader  # used as is, not re-sampled per sequence
    assert opt.expected_batch_size == 3  # the public number of units, not 40 * 0.25 sequences
    steps = train(engine, m, opt, crit, dl, epochs=2)
    assert steps == 8
    ((sigma, q, n, spec),) = [tuple(h) for h in engine.accountant.history]
    assert (sigma, q, n) == (1.0, 0.25, 8) and spec["sketch_dim"] == 32
    assert math.isfinite(engine.get_epsilon(1e-5))


def test_sigma_zero_is_recorded_at_infinite_epsilon() -> None:
    loader = UnitDataLoader(
        dataset(), unit_of=torch.arange(40) // 4, sample_rate=0.5, expected_batch_size=5
    )
    engine, m, opt, crit, dl = make_private(loader, noise=0.0)
    train(engine, m, opt, crit, dl)
    assert engine.get_epsilon(1e-5) == math.inf


def test_a_unit_split_across_physical_batches_is_refused() -> None:
    loader = UnitDataLoader(
        dataset(), unit_of=torch.arange(40) // 8, sample_rate=1.0, expected_batch_size=5
    )
    engine, m, opt, crit, dl = make_private(loader)
    with (
        BatchMemoryManager(data_loader=dl, max_physical_batch_size=12, optimizer=opt) as mem,
        pytest.raises(ValueError, match="split across physical batches"),
    ):
        next(iter(mem))


def test_unit_loader_needs_randomized_clipping() -> None:
    loader = UnitDataLoader(
        dataset(), unit_of=torch.arange(40) // 4, sample_rate=0.5, expected_batch_size=5
    )
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="needs clipping='randomized'"):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )


def test_virtual_steps_of_whole_units_give_the_same_update() -> None:
    """UnitBatchMemoryManager: a logical batch of units run as several physical batches of
    whole units (each at most 5 sequences, unless one unit is larger) gives the same noiseless
    update and the same accounting as the logical batch at once. The model's norms are all
    exact (embedding, layer norm), so the probes' order cannot matter."""
    unit_of = torch.tensor([u for u in range(12) for _ in range(1 + u % 4)])  # sizes 1..4
    n = len(unit_of)
    results = []
    for physical in (None, 5):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(V, C), nn.LayerNorm(C))
        loader = UnitDataLoader(
            dataset(n),
            unit_of=unit_of,
            sample_rate=0.5,
            generator=torch.Generator().manual_seed(4),
            expected_batch_size=6,
        )
        engine = PrivacyEngine(accountant="rc")
        m, opt, crit, dl = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=0.05,
            clipping="randomized",
            criterion=nn.CrossEntropyLoss(),
        )
        sizes = []
        if physical is None:
            train(engine, m, opt, crit, dl)
        else:
            with UnitBatchMemoryManager(
                data_loader=dl, max_physical_batch_size=physical, optimizer=opt
            ) as mem:
                for x, index, units in mem:
                    sizes.append(len(x))
                    out = m(x)
                    y = (index[:, None] + torch.arange(T)) % C
                    crit(out.reshape(-1, C), y.reshape(-1), shape=out.shape, units=units).backward()
                    opt.step()
                    opt.zero_grad()
            assert max(sizes) <= 5 and len(sizes) > len(dl)  # really split, never a unit
        results.append(
            (
                torch.cat([p.detach().flatten() for p in model.parameters()]),
                engine.accountant.history,
            )
        )
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    assert results[0][1] == results[1][1]
    torch.manual_seed(0)
    init = torch.cat([p.detach().flatten() for p in nn.Sequential(nn.Embedding(V, C)).parameters()])
    moved = (results[0][0][: init.numel()] - init).abs().max()
    assert moved > 1e-3  # the steps did move the parameters


def test_a_plain_unit_loader_with_a_distributed_model_is_refused() -> None:
    """Every rank would sample (and train on) every sampled unit: each unit counted W times."""
    loader = UnitDataLoader(dataset(), unit_of=torch.arange(40) // 4, sample_rate=0.5)
    with pytest.raises(ValueError, match="DistributedUnitDataLoader"):
        prepare_unit_data_loader(loader, engine=PrivacyEngine(), distributed=True, randomized=True)


def test_a_distributed_unit_loader_without_a_distributed_model_is_refused() -> None:
    loader = DistributedUnitDataLoader(
        dataset(), unit_of=torch.arange(40) // 4, sample_rate=0.5, num_replicas=2, rank=1
    )
    with pytest.raises(ValueError, match="not distributed"):
        prepare_unit_data_loader(loader, engine=PrivacyEngine(), distributed=False, randomized=True)
    with pytest.raises(ValueError, match="num_replicas and rank"):
        DistributedUnitDataLoader(dataset(), unit_of=torch.arange(40) // 4, sample_rate=0.5)
    with pytest.raises(ValueError, match="0 <= rank < num_replicas"):
        DistributedUnitDataLoader(
            dataset(), unit_of=torch.arange(40) // 4, sample_rate=0.5, num_replicas=2, rank=2
        )


def test_same_seed_ranks_partition_the_single_process_batch() -> None:
    """With one seed on every rank, the ranks' batches are disjoint, hold whole units, and
    their union is the batch the single-process loader draws with that seed, at every step
    (units of 1 to 4 sequences, ``max_sequences_per_unit=3``)."""
    ds = dataset()
    unit_of = torch.tensor([i % 13 for i in range(40)])  # 13 units of 3 or 4, interleaved
    common = {"unit_of": unit_of, "sample_rate": 0.4, "max_sequences_per_unit": 3, "steps": 6}
    single = UnitDataLoader(ds, generator=torch.Generator().manual_seed(5), **common)
    ranks = [
        DistributedUnitDataLoader(
            ds, num_replicas=2, rank=r, generator=torch.Generator().manual_seed(5), **common
        )
        for r in range(2)
    ]
    assert all(len(dl) == len(single) == 6 and dl.num_units == 13 for dl in ranks)
    nonempty = 0
    for batches in zip(single, *ranks):
        (_, idx, _), *parts = batches
        got = []
        for r, (_, ridx, runits) in enumerate(parts):
            for u in runits.unique().tolist():
                members = ridx[runits == u].tolist()
                unit = unit_of[members[0]].item()
                assert unit % 2 == r  # unit u on rank u % 2 only
                assert members == ranks[r].selected[unit]  # whole, selected
            got += ridx.tolist()
            nonempty += int(len(ridx) > 0)
        assert sorted(got) == sorted(idx.tolist())
    assert nonempty >= 8  # both ranks drew units on most steps


def test_independent_rank_generators_sample_every_unit_at_rate_q() -> None:
    """Independent generators per rank: each unit is in a step with probability q, on its own
    rank. The count of (unit, step) inclusions over both ranks is Binomial(S N_u, q), checked
    in the 5-sigma band of the module docstring (rates 2q and q/2 lie outside it)."""
    n_units, q, steps = 200, 0.3, 50
    members = [[u] for u in range(n_units)]
    count = 0
    for r in range(2):
        sampler = DistributedUnitPoissonSampler(
            members=members,
            sample_rate=q,
            num_replicas=2,
            rank=r,
            steps=steps,
            generator=torch.Generator().manual_seed(100 + r),
        )
        for batch in sampler:
            assert all(u % 2 == r for u in batch)
            count += len(batch)
    n = steps * n_units
    sd = math.sqrt(n * q * (1 - q))
    assert abs(count - n * q) < 5 * sd
    assert abs(count - n * 2 * q) > 5 * sd and abs(count - n * q / 2) > 5 * sd


def test_an_empty_step_is_noised_and_accounted() -> None:
    """No unit sampled: a B = 0 forward and backward with units of shape (0,) is a noise-only
    step, accounted like any other (docs/privacy/mechanism.md), at the rate the units are
    drawn at (0.25, not 1 / steps = 0.5: ``steps`` is only the number of steps)."""

    def loader() -> UnitDataLoader:
        return UnitDataLoader(
            dataset(8),
            unit_of=torch.arange(8) // 2,
            sample_rate=0.25,
            steps=2,
            generator=torch.Generator().manual_seed(9),
            expected_batch_size=1,
        )

    assert [units.numel() for _, _, units in loader()] == [0, 0]  # both empty (this seed)
    engine, m, opt, crit, dl = make_private(loader())
    before = [p.detach().clone() for p in m.parameters()]
    assert train(engine, m, opt, crit, dl) == 2
    assert all(not torch.equal(b, p) for b, p in zip(before, m.parameters()))  # noised
    assert [tuple(h)[1:3] for h in engine.accountant.history] == [(0.25, 2)]


@pytest.mark.parametrize(("sample_rate", "steps"), [(0.5, 4), (0.25, 2), (0.3, 7)])
def test_steps_set_the_number_of_steps_not_the_accounted_rate(
    sample_rate: float, steps: int
) -> None:
    """UnitDataLoader(steps=S) draws units at q whatever S is: the accountant records
    1 / int(1 / q) >= q (Opacus' DPDataLoader rate), never 1 / S (0.25 < 0.5 for q = 0.5,
    S = 4), and the divisor is int(U / int(1 / q)) for the public dataset_size=U units."""
    loader = UnitDataLoader(
        dataset(),
        unit_of=torch.arange(40) // 2,
        sample_rate=sample_rate,
        steps=steps,
        generator=torch.Generator().manual_seed(0),
    )
    engine, m, opt, crit, dl = make_private(loader, dataset_size=20)
    assert len(dl) == steps
    assert train(engine, m, opt, crit, dl) == steps
    rate = 1 / int(1 / sample_rate)
    assert [tuple(h)[1:3] for h in engine.accountant.history] == [(rate, steps)]
    assert opt.expected_batch_size == int(20 * rate)


def test_make_private_with_epsilon_searches_at_the_unit_rate() -> None:
    """q = 0.25, steps = 8, epochs = 2: the search is over 16 steps at 0.25 (not 0.125), so
    the run's epsilon after 16 steps is the target (the user's run got 7.49 for a target 4)."""
    loader = UnitDataLoader(
        dataset(),
        unit_of=torch.arange(40) // 2,
        sample_rate=0.25,
        steps=8,
        generator=torch.Generator().manual_seed(0),
        expected_batch_size=5,
    )
    model = nn.Sequential(nn.Embedding(V, 6), nn.Linear(6, C))
    engine = PrivacyEngine(accountant="rc")
    m, opt, crit, dl = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        target_epsilon=4.0,
        target_delta=1e-3,
        epochs=2,
        max_grad_norm=1.0,
        clipping="randomized",
        criterion=nn.CrossEntropyLoss(),
    )
    assert train(engine, m, opt, crit, dl, epochs=2) == 16
    assert [tuple(h)[1:3] for h in engine.accountant.history] == [(0.25, 16)]
    assert 3.9 < engine.get_epsilon(1e-3) <= 4.0


@pytest.mark.parametrize("split_units", [False, True])
def test_virtual_steps_of_a_distributed_unit_loader_are_refused(split_units: bool) -> None:
    """UnitBatchMemoryManager with a DistributedUnitDataLoader is refused, naming what to do:
    each rank would split its own units into its own number of physical batches (DDP's and
    FSDP2's per-backward collectives misalign) and a cut unit's buffer is not sharded."""
    loader = DistributedUnitDataLoader(
        dataset(), unit_of=torch.arange(40) // 4, sample_rate=0.5, num_replicas=2, rank=0
    )
    with pytest.raises(NotImplementedError, match="DistributedUnitDataLoader") as info:
        UnitBatchMemoryManager(
            data_loader=loader, max_physical_batch_size=4, optimizer=None, split_units=split_units
        )
    assert "add ranks or lower the sample rate" in str(info.value)


@pytest.mark.parametrize(
    ("sample_rate", "steps", "dataset_size", "with_epsilon"),
    [(0.01, None, 20, False), (0.01, None, 20, True), (0.25, None, 3, False)],
)
def test_a_unit_loader_expecting_no_unit_per_step_is_refused(
    sample_rate: float, steps: int | None, dataset_size: int | None, with_epsilon: bool
) -> None:
    """A public dataset_size of 20 units at q = 0.01 (or of 3 at q = 0.25): the divisor
    int(U q) is 0, the first step would divide the noisy sum by 0 (NaN parameters,
    still accounted). Refused at make_private, naming the fix."""
    loader = UnitDataLoader(
        dataset(), unit_of=torch.arange(40) // 2, sample_rate=sample_rate, steps=steps
    )
    model = nn.Sequential(nn.Embedding(V, 6), nn.Linear(6, C))
    engine = PrivacyEngine(accountant="rc")
    common = {
        "module": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "data_loader": loader,
        "max_grad_norm": 1.0,
        "clipping": "randomized",
        "criterion": nn.CrossEntropyLoss(),
        "dataset_size": dataset_size,
    }
    with pytest.raises(ValueError, match="expected number of units per step.*is 0.*sample_rate"):
        if with_epsilon:
            engine.make_private_with_epsilon(
                **common, target_epsilon=4.0, target_delta=1e-3, epochs=1
            )
        else:
            engine.make_private(**common, noise_multiplier=1.0)
    assert not engine.accountant.history


@pytest.mark.parametrize(
    "unit_of",
    [
        torch.arange(40).double() / 2,  # 0.0, 0.5, 1.0, ...: int() would merge 0.0 and 0.5
        [i / 2 for i in range(40)],
        [str(i // 2) for i in range(40)],
        torch.zeros(40, dtype=torch.bool),
    ],
    ids=["float_tensor", "float_list", "str_list", "bool_tensor"],
)
def test_non_integer_unit_ids_are_refused(unit_of: Any) -> None:
    """Before: float ids were truncated by int() (1.5 and 1.0 one unit: two units merged, whose
    joint clipped sum is not bounded by C per original unit); now a TypeError names the fix."""
    with pytest.raises(TypeError, match="unit_of must hold integer unit ids"):
        UnitDataLoader(dataset(), unit_of=unit_of, sample_rate=0.25)


def test_integer_unit_ids_of_any_integer_type_are_accepted() -> None:
    """numpy and torch integer ids give the same units as Python ints."""
    ids = [i // 2 for i in range(40)]
    want = UnitDataLoader(dataset(), unit_of=ids, sample_rate=0.25).num_units
    assert want == 20
    for unit_of in (
        np.array(ids),
        torch.tensor(ids, dtype=torch.int32),
        [np.int64(u) for u in ids],
    ):
        assert UnitDataLoader(dataset(), unit_of=unit_of, sample_rate=0.25).num_units == want


@pytest.mark.parametrize("steps", [2.5, 2.0, True, "3"])
def test_non_integer_steps_are_refused(steps: Any) -> None:
    """Before: steps=2.5 was truncated to 2 without a word."""
    with pytest.raises(TypeError, match="steps must be an integer >= 1 or None"):
        UnitDataLoader(dataset(), unit_of=torch.arange(40) // 2, sample_rate=0.25, steps=steps)
