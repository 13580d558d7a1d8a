"""The engine's checks of the data loader (``opacus_rc.engine.request``): a custom sampler
replaced by Poisson sampling warns, uniform samplers do not, and an ``IterableDataset`` or a
dataset without ``len()`` is refused with the reason.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from opacus.data_loader import DPDataLoader
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    SequentialSampler,
    WeightedRandomSampler,
)

from opacus_rc.privacy_engine import PrivacyEngine
from tests import flat_mlp
from tests.engine import private_loaders

pytestmark = pytest.mark.filterwarnings("ignore:Secure RNG turned off")


class PairsSampler:
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter([[i, i + 1] for i in range(0, self.n - 1, 2)])

    def __len__(self) -> int:
        return self.n // 2


# ----------------------------------------------------------------------------------------------
# Item 8: an IterableDataset loader
# ----------------------------------------------------------------------------------------------


class Stream(IterableDataset):
    def __iter__(self) -> Any:
        yield from zip(*private_loaders.dataset(12).tensors)


class NoLen(torch.utils.data.Dataset):
    def __getitem__(self, i: int) -> Any:
        return private_loaders.dataset(12)[i]


@pytest.mark.parametrize("clipping", ["flat", "randomized"])
@pytest.mark.parametrize(
    ("make_loader", "name"),
    [
        (
            lambda ds: DataLoader(
                ds,
                batch_size=private_loaders.B,
                sampler=WeightedRandomSampler(torch.arange(1.0, 13.0), 12),
            ),
            "sampler WeightedRandomSampler",
        ),
        (lambda ds: DataLoader(ds, batch_sampler=PairsSampler(12)), "batch_sampler PairsSampler"),
    ],
)
def test_custom_sampler_replaced_by_poisson_sampling_warns(
    make_loader: Any, name: str, clipping: str
) -> None:
    """Issue 20 item 4: a ``WeightedRandomSampler`` (or a custom batch sampler) was replaced
    by uniform Poisson sampling without a word. Now a ``UserWarning`` at the caller's line says
    which, why, and what to do; the replacement (the accounted Poisson sampler) is unchanged.
    (The batch sampler gives no batch_size: its divisor comes from the public dataset_size,
    issue 30.)"""
    with pytest.warns(UserWarning, match=f"data loader's {name} is replaced by Poisson") as rec:
        _, out = private_loaders.private(
            make_loader(private_loaders.dataset(12)), clipping=clipping, dataset_size=12
        )
    # attributed to the line that calls make_private (in the helper)
    callers = {w.filename for w in rec if "replaced by Poisson" in str(w.message)}
    assert callers == {private_loaders.__file__}
    assert type(out[-1]).__name__ == "DPDataLoader"


@pytest.mark.parametrize(
    "make_loader",
    [
        lambda ds: DataLoader(ds, batch_size=private_loaders.B),
        lambda ds: DataLoader(ds, batch_size=private_loaders.B, shuffle=True),
        lambda ds: DataLoader(ds, batch_size=private_loaders.B, sampler=SequentialSampler(ds)),
        lambda ds: DPDataLoader(ds, sample_rate=1 / 3),
    ],
    ids=["sequential", "shuffle", "explicit-sequential", "dp-data-loader"],
)
def test_uniform_samplers_do_not_warn(make_loader: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        private_loaders.private(
            make_loader(private_loaders.dataset(12)), dataset_size=12
        )  # public: the DPDataLoader's divisor


@pytest.mark.parametrize("clipping", ["flat", "randomized"])
@pytest.mark.parametrize("poisson_sampling", [True, False])
def test_iterable_dataset_is_refused_with_the_reason(clipping: str, poisson_sampling: bool) -> None:
    """Issue 20 item 8: ``TypeError: object of type 'Stream' has no len()`` (randomized) or
    Opacus' ``Uniform sampling is not supported for IterableDataset``. Now a ``ValueError``
    before any hook: Poisson sampling needs a map-style dataset of known size."""
    model = private_loaders.MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(
            ValueError, match="IterableDataset \\(Stream\\).*map-style dataset of known size"
        ):
            private_loaders.private(
                DataLoader(Stream(), batch_size=private_loaders.B),
                model=model,
                clipping=clipping,
                poisson_sampling=poisson_sampling,
            )
    assert not hasattr(model, "autograd_grad_sample_hooks")


def test_dataset_without_len_is_refused() -> None:
    with pytest.raises(ValueError, match="has no len\\(\\).*known size"):
        private_loaders.private(DataLoader(NoLen(), batch_size=private_loaders.B))


def test_poisson_sampling_false_warns_that_the_epsilon_does_not_hold() -> None:
    """meta-pytorch/opacus PR 745 (2025-03): with ``poisson_sampling=False`` Opacus keeps the
    user's loader (fixed or shuffled batches) and still accounts Poisson steps at rate
    1/len(loader), silently; so did opacus_rc (4 steps at q = 0.25 here). The steps are still
    accounted the same way, but ``make_private`` now warns, at the caller's line, that the
    reported epsilon is not a valid guarantee for such batches."""
    model = flat_mlp.FlatMLP()
    with pytest.warns(UserWarning, match="poisson_sampling=False.*not a valid guarantee") as rec:
        engine, module, opt, crit, loader = flat_mlp.private(model, poisson_sampling=False)
    assert [w.filename for w in rec if "poisson_sampling" in str(w.message)] == [flat_mlp.__file__]
    flat_mlp.train_all(module, opt, crit, loader)
    assert engine.accountant.history[0][:3] == (1.0, 0.25, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        flat_mlp.private(flat_mlp.FlatMLP())  # the default (Poisson) does not warn


def test_poisson_sampling_false_with_a_poisson_loader_does_not_warn() -> None:
    """A loader that is already Opacus' ``DPDataLoader`` (Poisson batches; the generative
    tutorial shares one seeded loader between its methods) with ``poisson_sampling=False``
    is a valid Poisson run: no warning (the second new-user test saw the warning on every
    tutorial run). Opacus accounts it at rate 1 / len(loader) = 1 / floor(1 / q), here exactly
    q = 0.25."""
    from opacus.data_loader import DPDataLoader

    loader = DPDataLoader.from_data_loader(DataLoader(flat_mlp.data(), batch_size=flat_mlp.B))
    model = flat_mlp.FlatMLP()
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        module, opt, crit, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=flat_mlp.C,
            clipping="randomized",
            sketch_dim=8,
            poisson_sampling=False,
            dataset_size=16,  # public: the divisor of a loader without batch_size (issue 30)
        )
    flat_mlp.train_all(module, opt, crit, loader)
    assert engine.accountant.history[0][:2] == (1.0, 0.25)
