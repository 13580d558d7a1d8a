"""The mechanism's quantities from public inputs only (``opacus_rc.engine.schedule``): the
sampling rate, the steps per epoch, the divisor of the noisy sum and the accounted schedule are
the same on neighbouring datasets (Opacus #819), and the noise search uses the public rate.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from opacus.data_loader import DPDataLoader
from torch.utils.data import (
    DataLoader,
)

from opacus_rc.privacy_engine import PrivacyEngine
from tests.engine import private_loaders

pytestmark = pytest.mark.filterwarnings("ignore:Secure RNG turned off")


# ----------------------------------------------------------------------------------------------
# Item 2: every quantity of the mechanism from public inputs
# ----------------------------------------------------------------------------------------------


def mechanism(n: int, **kwargs: Any) -> dict[str, Any]:
    """The sampling rate, steps per epoch, divisor and the released noise of one noise-only step
    (seeded noise generator) of a randomized run on ``n`` records at batch size ``B``."""
    engine, (module, optimizer, _, loader) = private_loaders.private(
        DataLoader(private_loaders.dataset(n), batch_size=private_loaders.B),
        noise_generator=torch.Generator().manual_seed(3),
        **kwargs,
    )
    before = [p.detach().clone() for p in module.parameters()]
    optimizer.noise_only_step()  # lr = 1: the update is minus the released noisy mean
    noise = torch.cat([(b - p.detach()).flatten() for p, b in zip(module.parameters(), before)])
    ((_, rate, steps, *_),) = engine.accountant.history
    return {
        "sample_rate": loader.sample_rate,
        "accounted_rate": rate,
        "steps_per_epoch": len(loader),
        "divisor": optimizer.expected_batch_size,
        "noise": noise,
    }


@pytest.mark.parametrize(
    ("sizes", "kwargs"),
    [
        pytest.param((12, 11), {}, id="opacus#819-N12-vs-N11"),
        pytest.param((12, 13), {"dataset_size": 12}, id="public-dataset_size-N12-vs-N13"),
        pytest.param((12, 11), {"dataset_size": 12}, id="public-dataset_size-N12-vs-N11"),
    ],
)
def test_neighbouring_datasets_get_the_same_mechanism(
    sizes: tuple[int, int], kwargs: dict[str, Any]
) -> None:
    """Issue 20 item 2 (Opacus #819, #571): neighbours N = 12 and N = 11 at batch size 4 had
    the same q = 1/3 but divisors int(12/3) = 4 and int(11/3) = 3, so one release's noise sd
    differed by 4/3. Now the divisor is the loader's batch size, and with a public
    ``dataset_size`` the rate and the number of steps do not depend on len(dataset) either:
    both neighbours release bit-identical noise (same seed) whose sd is sigma C / B.

    Tolerance: the n = 6 * 40 + 40 + 40 * 5 + 5 = 485 coordinates are i.i.d. N(0, (sigma C /
    B)^2); the sample sd has relative standard error 1 / sqrt(2 n) = 0.032, so +-0.16 is a
    5-sigma band (a divisor 3 would give +0.33)."""
    a, b = (mechanism(n, **kwargs) for n in sizes)
    for key in ("sample_rate", "accounted_rate", "steps_per_epoch", "divisor"):
        assert a[key] == b[key], key
    assert a["divisor"] == private_loaders.B
    assert a["sample_rate"] == a["accounted_rate"] == pytest.approx(1 / 3, abs=0)
    assert a["steps_per_epoch"] == 3
    assert torch.equal(a["noise"], b["noise"])
    assert a["noise"].numel() == 485
    assert a["noise"].std().item() == pytest.approx(
        private_loaders.SIGMA * private_loaders.C / private_loaders.B, rel=0.16
    )


@pytest.mark.parametrize("clipping", ["flat", "randomized"])
def test_divisor_is_the_loaders_batch_size_for_every_clipping(clipping: str) -> None:
    """Opacus' own clipping goes through the same seam: N = 11, B = 4 gave a divisor of 3."""
    for n in (11, 12, 13, 15):
        _, out = private_loaders.private(
            DataLoader(private_loaders.dataset(n), batch_size=private_loaders.B), clipping=clipping
        )
        assert out[1].expected_batch_size == private_loaders.B


def test_without_dataset_size_the_rate_is_opacus_rate() -> None:
    """Without ``dataset_size`` the rate stays Opacus' 1 / ceil(N / B) (documented: N is then
    treated as public): N = 13 gives q = 1/4 and 4 steps; with dataset_size=12 it is 1/3 and
    3 steps, on the same 13 records."""
    plain = mechanism(13)
    assert (plain["sample_rate"], plain["steps_per_epoch"]) == (0.25, 4)
    public = mechanism(13, dataset_size=12)
    assert (public["sample_rate"], public["steps_per_epoch"]) == (1 / 3, 3)
    drop_last = private_loaders.private(
        DataLoader(private_loaders.dataset(13), batch_size=private_loaders.B, drop_last=True),
        dataset_size=14,
    )
    assert drop_last[1][3].sample_rate == 1 / 3  # floor(14 / 4) = 3 batches


def test_loader_without_batch_size_divides_by_the_public_expected_size() -> None:
    """An Opacus ``DPDataLoader`` (no ``batch_size``): the divisor is int(N' q) with the public
    N' = dataset_size; the rate is the loader's (1 / int(1 / q))."""
    loader = DPDataLoader(private_loaders.dataset(13), sample_rate=0.25)
    _, out = private_loaders.private(loader, dataset_size=20)
    assert out[1].expected_batch_size == 5
    assert out[3].sample_rate == 0.25


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dataset_size": 0}, "dataset_size must be an integer >= 1"),
        ({"dataset_size": 12.0}, "dataset_size must be an integer >= 1"),
        ({"dataset_size": True}, "dataset_size must be an integer >= 1"),
        ({"dataset_size": 12, "poisson_sampling": False}, "needs poisson_sampling=True"),
    ],
)
def test_invalid_dataset_size_is_refused(kwargs: dict[str, Any], match: str) -> None:
    model = private_loaders.MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(ValueError, match=match):
            private_loaders.private(
                DataLoader(private_loaders.dataset(12), batch_size=private_loaders.B),
                model=model,
                **kwargs,
            )
    assert not hasattr(model, "autograd_grad_sample_hooks")


def test_noise_search_uses_the_public_rate() -> None:
    """make_private_with_epsilon searches at the rate that is accounted (q = 1/3 with
    dataset_size=12 on 13 records, not Opacus' 1/4)."""
    torch.manual_seed(0)
    model = private_loaders.MLP()
    engine = PrivacyEngine()
    _, optimizer, _, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(private_loaders.dataset(13), batch_size=private_loaders.B),
        target_epsilon=8.0,
        target_delta=1e-5,
        epochs=1,
        max_grad_norm=private_loaders.C,
        clipping="randomized",
        sketch_dim=8,
        dataset_size=12,
    )
    for _ in range(len(loader)):
        optimizer.noise_only_step()
    assert len(loader) == 3
    assert engine.accountant.history[0][1] == 1 / 3
    assert engine.get_epsilon(1e-5) == pytest.approx(8.0, rel=0.02)


@pytest.mark.parametrize(
    ("clipping", "accountant"), [("randomized", "rc"), ("flat", "prv")], ids=["rc", "flat-prv"]
)
def test_target_epsilon_holds_when_an_epoch_is_one_step_short(
    clipping: str, accountant: str
) -> None:
    """N = 93 at batch size 1: q = 1/93, but a Poisson loader has int(1 / q) = 92 batches (in
    floating point 1 / (1/93) < 93) and Opacus accounts each at 1 / len(loader) = 1/92.
    Searched at q = 1/93 over int(1 / q) steps, one epoch ended at epsilon 4.018 for a target
    of 4; the search now uses the accounted rate and the loader's steps. The noise search stops
    within its tolerance 0.01 below the target, so epsilon is in [3.96, 4]."""
    torch.manual_seed(0)
    model = private_loaders.MLP()
    engine = PrivacyEngine(accountant=accountant)
    made = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(private_loaders.dataset(93), batch_size=1),
        target_epsilon=4.0,
        target_delta=1e-5,
        epochs=1,
        max_grad_norm=private_loaders.C,
        clipping=clipping,
        **({"sketch_dim": 8} if clipping == "randomized" else {}),
    )
    optimizer, loader = made[1], made[-1]  # flat clipping returns no criterion
    assert len(loader) == 92
    for _ in range(len(loader)):
        if clipping == "randomized":
            optimizer.noise_only_step()
        else:
            engine.accountant.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=1 / 92)
    assert sum(entry[2] for entry in engine.accountant.history) == 92
    assert engine.accountant.history[0][1] == 1 / 92
    assert 3.96 <= engine.get_epsilon(1e-5) <= 4.0
