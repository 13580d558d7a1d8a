"""One :class:`~opacus_rc.mechanism.Mechanism` per run: public, the same on neighbours, and the
only source of the step's DP event (issue 31, item 3).

The neighbouring datasets are those of the harness (:mod:`tests.privacy.neighbouring`): ``D``
and ``D`` minus its last record (or unit).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from opacus_rc.accountants.events import RandomizedClipDpEvent
from opacus_rc.engine.schedule import public_sizes
from opacus_rc.integrations.train_data import trainer_schedule
from opacus_rc.mechanism import Mechanism, PublicSizes
from opacus_rc.optimizers import RandomizedClipOptimizer
from opacus_rc.units import UnitDataLoader
from tests.privacy.neighbouring import (
    BATCH,
    C_MLP,
    C_TOKENS,
    LOADER_SEED,
    MLP,
    N_RECORDS,
    UNIT_RATE,
    UNIT_SEED,
    UNIT_SIZES,
    Indexed,
    TokenModel,
    V,
    _collate_pairs,
    _make_private,
    _mlp_items,
    _unit_data,
)

SIGMA = 1.3


def engine_run(n: int, *, dataset_size: int | None) -> tuple[Any, Any, Any, Any, Any]:
    """The engine on ``n`` records of the harness' MLP, one step taken."""
    loader = DataLoader(
        Indexed(_mlp_items(n)),
        batch_size=BATCH,
        collate_fn=_collate_pairs,
        generator=torch.Generator().manual_seed(LOADER_SEED),
    )
    engine, m, opt, crit, dl = _make_private(
        MLP(),
        loader,
        noise_multiplier=SIGMA,
        max_grad_norm=C_MLP,
        sketch_dim=2,
        dataset_size=dataset_size,
    )
    x, y, _ = next(iter(dl))
    crit(m(x), y).backward()
    opt.step()
    return engine, m, opt, crit, dl


@pytest.mark.parametrize("dataset_size", [None, N_RECORDS])
def test_the_mechanism_of_d_and_d_minus_one_record_is_equal(dataset_size: int | None) -> None:
    """8 and 7 records at batch 4 (with and without the public size 8): equal mechanisms, with
    the values of the table of docs/privacy/mechanism.md written out (q = 1/ceil(8/4) = 1/2, two
    steps an epoch, divisor B = 4, the user's sigma and C, the seeded sketch accounted as
    revealed); the optimizer holds the same record and divides and noises with it."""
    runs = [engine_run(n, dataset_size=dataset_size) for n in (N_RECORDS, N_RECORDS - 1)]
    (engine, _, opt, _, dl), (neighbour, *_) = runs
    mechanism = engine.mechanism
    assert isinstance(mechanism, Mechanism)
    assert mechanism == neighbour.mechanism
    assert mechanism.sizes == PublicSizes(
        sample_rate=1 / 2,
        expected_batch_size=BATCH,
        accounted_rate=1 / 2,
        steps_per_epoch=2,
        privacy_unit="record",
        world_size=1,
    )
    assert (mechanism.noise_multiplier, mechanism.max_grad_norm) == (SIGMA, C_MLP)
    assert mechanism.sketch_spec.sketch_dim == 2 and not mechanism.sketch_spec.secret
    assert mechanism.threat_model == "revealed"
    assert opt.mechanism is mechanism
    assert (opt.expected_batch_size, opt.noise_multiplier, opt.max_grad_norm) == (
        BATCH,
        SIGMA,
        C_MLP,
    )
    assert (dl.sample_rate, len(dl)) == (mechanism.sample_rate, mechanism.steps_per_epoch)


def test_the_mechanism_detects_a_rate_from_the_private_count() -> None:
    """The comparison can fail: 13 and 12 records at batch 4 without a public size give
    q = 1/4 and 1/3 (the number of records treated as public, as Opacus); with the public
    size 13 both get 1/4, and the engine's sizes are the Trainer's (one function)."""
    private = [
        public_sizes(DataLoader(range(n), batch_size=4), dataset_size=None) for n in (13, 12)
    ]
    assert private[0] != private[1]
    assert [s.sample_rate for s in private] == [1 / 4, 1 / 3]
    public = [public_sizes(DataLoader(range(n), batch_size=4), dataset_size=13) for n in (13, 12)]
    assert public[0] == public[1]
    assert (public[0].accounted_rate, public[0].steps_per_epoch) == (1 / 4, 4)
    for n in (13, 12):
        assert trainer_schedule(n, expected_batch_size=4, dataset_size=13).sizes == public[0]


def test_the_mechanism_of_d_and_d_minus_one_unit_is_equal() -> None:
    """A unit loader of expected_batch_size 2 over the harness' units and over one unit less:
    equal mechanisms, privacy unit "unit", each step accounted at the loader's rate
    1 / int(1 / q); the accountant's event after one step is the mechanism's."""
    mechanisms, events = [], []
    for neighbour in (False, True):
        items, unit_of = _unit_data(neighbour)
        loader = UnitDataLoader(
            items,
            unit_of=unit_of,
            sample_rate=UNIT_RATE,
            expected_batch_size=2,
            generator=torch.Generator().manual_seed(UNIT_SEED),
        )
        engine, m, opt, crit, dl = _make_private(
            TokenModel(),
            loader,
            noise_multiplier=SIGMA,
            max_grad_norm=C_TOKENS,
            sketch_dim=2,
            dataset_size=None,
        )
        x, y, _, units = next(iter(dl))
        out = m(x)
        crit(out.reshape(-1, V), y.reshape(-1), shape=out.shape, units=units).backward()
        opt.step()
        mechanisms.append(engine.mechanism)
        [(event, count)] = engine.accountant.ledger
        events.append((event, count))
    assert mechanisms[0] == mechanisms[1]
    assert len(UNIT_SIZES) > 1
    rate = 1 / int(1 / UNIT_RATE)
    assert mechanisms[0].privacy_unit == "unit"
    assert (mechanisms[0].sample_rate, mechanisms[0].accounted_rate) == (rate, rate)
    assert mechanisms[0].divisor == 2
    for mechanism, (event, count) in zip(mechanisms, events):
        assert (event, count) == (mechanism.step_event(), 1)


def test_the_accountants_event_is_the_one_made_from_engine_mechanism() -> None:
    """The event the accountant recorded at a step equals ``engine.mechanism.step_event()``,
    written out: sigma, the accounted rate 1/2, the sketch and its threat model."""
    engine, _, opt, _, _ = engine_run(N_RECORDS, dataset_size=N_RECORDS)
    [(event, count)] = engine.accountant.ledger
    mechanism = engine.mechanism
    assert count == 1
    assert event == mechanism.step_event() == opt.dp_event()
    assert event == RandomizedClipDpEvent(
        noise_multiplier=SIGMA,
        sample_rate=1 / 2,
        sketch_spec=mechanism.sketch_spec,
        threat_model="revealed",
    )


def test_an_accountant_at_another_rate_and_a_conflicting_optimizer_are_refused() -> None:
    """With a mechanism, the optimizer's event is its mechanism's: an accountant's hook at
    another rate, and an optimizer built with another sigma or divisor, are refused."""
    engine, m, opt, _, _ = engine_run(N_RECORDS, dataset_size=N_RECORDS)
    with pytest.raises(ValueError, match="accounts each step at 0.5"):
        opt.dp_event(sample_rate=0.25)
    assert opt.dp_event(sample_rate=0.5) == engine.mechanism.step_event()
    inner = torch.optim.SGD(m.parameters(), lr=1.0)
    for wrong in ({"noise_multiplier": 2.0}, {"expected_batch_size": 3}):
        with pytest.raises(ValueError, match="differs from the mechanism's"):
            RandomizedClipOptimizer(
                inner, grad_sample_module=m, mechanism=engine.mechanism, **wrong
            )
    with pytest.raises(TypeError, match="noise_multiplier and expected_batch_size"):
        RandomizedClipOptimizer(inner, grad_sample_module=m, noise_multiplier=1.0)


def test_a_noise_scheduler_changes_the_mechanism_the_optimizer_reports() -> None:
    """Opacus' noise schedulers set ``optimizer.noise_multiplier``: the optimizer's mechanism
    (and so its next event) has the new sigma; the engine's record of the run is unchanged."""
    engine, _, opt, _, _ = engine_run(N_RECORDS, dataset_size=N_RECORDS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.noise_multiplier = 2.0
    assert opt.mechanism.noise_multiplier == 2.0 and engine.mechanism.noise_multiplier == SIGMA
    assert opt.mechanism.sizes is engine.mechanism.sizes
    assert opt.dp_event().noise_multiplier == 2.0
