"""Issue 30, item 3: the divisor of the noisy sum from a public number on every engine path.

An adversary compares the releases of neighbouring datasets (``D`` and ``D`` with one unit or
record removed): the step's divisor, and so the released noise sd ``sigma C / divisor``, must be
the same constant on both. Before the fix, ``make_private`` with a
:class:`~opacus_rc.units.UnitDataLoader` (or a ``DistributedUnitDataLoader``, or a
per-record loader without ``batch_size``, an Opacus ``DPDataLoader``) and no public size divided
by ``int(N * q)`` with ``N`` the private number of units or records: 12 units against 11 at
``q = 0.25`` gave divisors 3 and 2 (noise sd ``0.33`` against ``0.50``) with the same
accounting (Opacus #819). Now the divisor comes from a public number (the unit loader's
``expected_batch_size`` or ``make_private``'s ``dataset_size``), and without one the call is
refused under ``loss_reduction="mean"`` (under ``"sum"`` nothing is divided).

Every "identical" below is compared exactly: the noise generator is seeded, so the neighbours'
releases of a noise-only step are bit-identical when their divisors are.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from opacus.data_loader import DPDataLoader
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from opacus_rc import PrivacyEngine
from opacus_rc.engine.request import check_per_rank_loader
from opacus_rc.units import DistributedUnitDataLoader, UnitDataLoader

pytestmark = [
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
    # the custom batch sampler is replaced by Poisson sampling (warned; not what is tested)
    pytest.mark.filterwarnings("ignore:the data loader's batch_sampler"),
    pytest.mark.filterwarnings("ignore:noise_multiplier=0"),
]

V, T, CLASSES = 11, 3, 5
SIGMA, C, Q = 1.0, 1.0, 0.25
SEQUENCES_PER_UNIT = 2
REFUSAL = r"Opacus #819.*private number of units.*expected_batch_size=E.*dataset_size=U"
RECORD_REFUSAL = r"Opacus #819.*private number of records.*dataset_size=N.*batch_size"


def sequences(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, V, (n, T), generator=g), torch.arange(n))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, 6), nn.Linear(6, CLASSES))


def unit_loader(kind: str, n_units: int, **kwargs: Any) -> UnitDataLoader:
    """``n_units`` units of two sequences each (unit ids 0..n_units-1)."""
    n = SEQUENCES_PER_UNIT * n_units
    common: dict[str, Any] = {
        "unit_of": torch.arange(n) // SEQUENCES_PER_UNIT,
        "sample_rate": Q,
        "generator": torch.Generator().manual_seed(1),
        **kwargs,
    }
    if kind == "distributed":  # world size 1: the same divisor rule as for W ranks, / W
        return DistributedUnitDataLoader(sequences(n), num_replicas=1, rank=0, **common)
    return UnitDataLoader(sequences(n), **common)


def private(loader: DataLoader, **kwargs: Any) -> tuple[PrivacyEngine, tuple[Any, ...]]:
    m = model()
    engine = PrivacyEngine(accountant="rc")
    options: dict[str, Any] = {
        "noise_multiplier": SIGMA,
        "max_grad_norm": C,
        "clipping": "randomized",
        "sketch_dim": 8,
        "noise_generator": torch.Generator().manual_seed(3),
        "criterion": nn.CrossEntropyLoss(),
        **kwargs,
    }
    out = engine.make_private(
        module=m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0), data_loader=loader, **options
    )
    return engine, out


def mechanism(loader: DataLoader, **kwargs: Any) -> dict[str, Any]:
    """The accounted rate, steps, divisor and the release of one noise-only step (lr = 1: the
    update is minus the released noisy mean; every gradient is zero, so it is all noise)."""
    engine, (module, optimizer, _, out_loader) = private(loader, **kwargs)
    before = [p.detach().clone() for p in module.parameters()]
    optimizer.noise_only_step()
    noise = torch.cat([(b - p.detach()).flatten() for p, b in zip(module.parameters(), before)])
    ((_, rate, steps, *_),) = [tuple(h) for h in engine.accountant.history]
    return {
        "accounted_rate": rate,
        "steps_per_epoch": len(out_loader),
        "divisor": optimizer.expected_batch_size,
        "noise": noise,
    }


def assert_same_mechanism(a: dict[str, Any], b: dict[str, Any], divisor: int) -> None:
    """Identical quantities and bit-identical noise of sd sigma C / divisor.

    Tolerance: the 11 * 6 + 6 * 5 + 5 = 101 noise coordinates are i.i.d. N(0, (sigma C / E)^2);
    the sample sd has relative standard error 1 / sqrt(2 * 101) = 0.07, so rel=0.35 is a
    5-sigma band (divisor 3: sd 0.333; the private divisor 2 of 11 units: 0.5, +50%)."""
    for key in ("accounted_rate", "steps_per_epoch", "divisor"):
        assert a[key] == b[key], key
    assert a["divisor"] == divisor
    assert torch.equal(a["noise"], b["noise"])
    assert a["noise"].numel() == 101
    assert a["noise"].std().item() == pytest.approx(SIGMA * C / divisor, rel=0.35)


@pytest.mark.parametrize("kind", ["single", "distributed"])
@pytest.mark.parametrize(
    ("loader_kwargs", "engine_kwargs"),
    [
        pytest.param({"expected_batch_size": 3}, {}, id="loader-expected_batch_size"),
        pytest.param({}, {"dataset_size": 12}, id="make_private-dataset_size"),
    ],
)
def test_neighbouring_unit_datasets_get_the_same_divisor_and_noise(
    kind: str, loader_kwargs: dict[str, Any], engine_kwargs: dict[str, Any]
) -> None:
    """12 units against 11 (one unit removed) at q = 0.25, with a public number: the divisor is
    3 = the public expected units (or int(12 * 0.25)) on both, and the releases of a noise-only
    step are bit-identical (sd sigma C / 3). Before the fix the divisor was int(N_units * q),
    3 against 2 (and the loader had no expected_batch_size)."""
    a, b = (mechanism(unit_loader(kind, n, **loader_kwargs), **engine_kwargs) for n in (12, 11))
    assert a["accounted_rate"] == Q and a["steps_per_epoch"] == 4
    assert_same_mechanism(a, b, divisor=3)


@pytest.mark.parametrize("kind", ["single", "distributed"])
@pytest.mark.parametrize("with_epsilon", [False, True])
def test_unit_loader_without_a_public_size_is_refused(kind: str, with_epsilon: bool) -> None:
    """No public number and loss_reduction="mean": refused at make_private (and
    make_private_with_epsilon, before the search), naming why (the private count, Opacus #819)
    and both fixes. Before: accepted, divisor int(12 * 0.25) = 3 vs int(11 * 0.25) = 2."""
    m = model()
    engine = PrivacyEngine(accountant="rc")
    common: dict[str, Any] = {
        "module": m,
        "optimizer": torch.optim.SGD(m.parameters(), lr=1.0),
        "data_loader": unit_loader(kind, 11),
        "max_grad_norm": C,
        "clipping": "randomized",
        "criterion": nn.CrossEntropyLoss(),
    }
    with pytest.raises(ValueError, match=REFUSAL) as info:
        if with_epsilon:
            engine.make_private_with_epsilon(
                target_epsilon=3.0, target_delta=1e-3, epochs=1, **common
            )
        else:
            engine.make_private(noise_multiplier=SIGMA, **common)
    assert "int(11 units * rate 0.25) = 2" in str(info.value)
    assert not hasattr(m, "autograd_grad_sample_hooks")  # nothing attached
    assert engine.accountant.history == []


def test_unit_loader_with_two_public_divisors_is_refused() -> None:
    with pytest.raises(ValueError, match="give one of them"):
        private(unit_loader("single", 12, expected_batch_size=3), dataset_size=12)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3"])
def test_unit_loader_expected_batch_size_must_be_a_positive_integer(bad: Any) -> None:
    with pytest.raises(ValueError, match="expected_batch_size .* must be an integer >= 1"):
        unit_loader("single", 12, expected_batch_size=bad)


def test_unit_loader_divides_by_its_public_expected_batch_size_whatever_the_units() -> None:
    """The divisor is the public number as given, not checked against the private count (a
    refusal that depends on the count would itself release it): 12 units, E = 5."""
    _, out = private(unit_loader("single", 12, expected_batch_size=5))
    assert out[1].expected_batch_size == 5


def test_unit_loader_under_sum_needs_no_divisor() -> None:
    """loss_reduction="sum": nothing is divided, so no public number is needed; the release
    has sd sigma C on both neighbours (not divided), bit-identical."""
    kwargs = {"loss_reduction": "sum", "criterion": nn.CrossEntropyLoss(reduction="sum")}
    a, b = (mechanism(unit_loader("single", n), **kwargs) for n in (12, 11))
    assert a["divisor"] is None and b["divisor"] is None
    assert torch.equal(a["noise"], b["noise"])
    assert a["noise"].std().item() == pytest.approx(SIGMA * C, rel=0.35)


# ----------------------------------------------------------------------------------------------
# Per record, a loader without batch_size (an Opacus DPDataLoader, a custom batch_sampler)
# ----------------------------------------------------------------------------------------------


class Batches:
    """A custom batch sampler: three fixed batches of the first records, whatever N is."""

    def __init__(self, n: int) -> None:
        self.batches = [list(range(i, min(i + 4, n))) for i in (0, 4, 8)]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def record_loader(kind: str, n: int) -> DataLoader:
    if kind == "dp_data_loader":
        return DPDataLoader(sequences(n), sample_rate=Q)
    return DataLoader(sequences(n), batch_sampler=Batches(n))


@pytest.mark.parametrize("kind", ["dp_data_loader", "batch_sampler"])
def test_loader_without_batch_size_and_without_dataset_size_is_refused(kind: str) -> None:
    """Per record, a loader without batch_size: the divisor would be int(len(dataset) * q),
    int(11 / 4) = 2 against int(12 / 4) = 3 (q = 0.25 for the DPDataLoader, 1 / 3 batches for
    the batch sampler: int(11 / 3) = 3 against 4). Refused, naming dataset_size and batch_size.
    Before: accepted with the private divisor."""
    with pytest.raises(ValueError, match=RECORD_REFUSAL):
        private(record_loader(kind, 11))


@pytest.mark.parametrize(("kind", "divisor"), [("dp_data_loader", 3), ("batch_sampler", 4)])
def test_loader_without_batch_size_neighbours_get_the_same_divisor_with_dataset_size(
    kind: str, divisor: int
) -> None:
    """With the public dataset_size=12: the divisor is int(12 * q) on both neighbours (12 and
    11 records), and the noise-only releases are bit-identical."""
    a, b = (mechanism(record_loader(kind, n), dataset_size=12) for n in (12, 11))
    assert_same_mechanism(a, b, divisor=divisor)


def test_loader_without_batch_size_under_sum_needs_no_dataset_size() -> None:
    kwargs = {"loss_reduction": "sum", "criterion": nn.CrossEntropyLoss(reduction="sum")}
    a, b = (mechanism(record_loader("dp_data_loader", n), **kwargs) for n in (12, 11))
    assert a["divisor"] is None and torch.equal(a["noise"], b["noise"])


def test_dataset_size_sets_only_the_divisor_without_poisson_sampling_for_a_dp_loader() -> None:
    """poisson_sampling=False with a DPDataLoader (used as it is): dataset_size gives the
    divisor only (it was refused with every loader before, leaving no public divisor)."""
    _, out = private(record_loader("dp_data_loader", 11), dataset_size=12, poisson_sampling=False)
    assert out[1].expected_batch_size == 3


def test_a_whole_dataset_loader_per_rank_is_refused_without_poisson_sampling() -> None:
    # Every one of W ranks iterating a SequentialSampler/RandomSampler loader puts each record
    # W times into a step's sum; a DistributedSampler shards it; one process is never refused.
    data = TensorDataset(torch.zeros(8, 2))
    for loader in (DataLoader(data, batch_size=2), DataLoader(data, batch_size=2, shuffle=True)):
        with pytest.raises(ValueError, match="2 times"):
            check_per_rank_loader(loader, world_size=2, poisson_sampling=False)
        check_per_rank_loader(loader, world_size=1, poisson_sampling=False)
        check_per_rank_loader(loader, world_size=2, poisson_sampling=True)
    sharded = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 2, 0))
    check_per_rank_loader(sharded, world_size=2, poisson_sampling=False)
