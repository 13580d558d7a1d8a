"""The engine's noise multiplier (``opacus_rc.engine.noise``): ``noise_multiplier=0`` only with an
accountant that records it (a debugging run at infinite epsilon, never an unaccounted step), and
the search for a target epsilon.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from opacus.accountants import RDPAccountant
from torch import nn
from torch.utils.data import (
    DataLoader,
)

from opacus_rc.privacy_engine import PrivacyEngine
from tests import flat_mlp, private_mlp
from tests.engine import private_loaders

pytestmark = pytest.mark.filterwarnings("ignore:a sketch_generator was passed")


_ZERO_NOISE_WARNING = (
    "noise_multiplier=0: no noise is added, so this run is not differentially private and its "
    "epsilon is infinite; use it for debugging only"
)


def _make_private_recording_warnings(engine: Any, **args: Any) -> tuple[Any, list[str]]:
    """``engine.make_private(**args)`` and the messages of the noise-multiplier warnings it
    gave (exceptions propagate)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = engine.make_private(**args)
    return out, [str(w.message) for w in record if "noise_multiplier" in str(w.message)]


# ============================================================================================
# Issue 14, engine items (4, 5, 6); items 10 and 11 (the README) are in test_privacy_engine.py
# ============================================================================================


class _ZeroNoiseAccountant(RDPAccountant):
    """A stand-in for an RC accountant that records sigma = 0 steps with an infinite epsilon
    (Opacus' RDP does: its RDP at sigma = 0 is infinite), and records each step's sketch spec."""

    supports_randomized_clipping = True

    def __init__(self) -> None:
        super().__init__()
        self.specs: list[Any] = []

    def step(self, *, noise_multiplier: float, sample_rate: float, sketch_spec: Any = None) -> None:
        self.specs.append(sketch_spec)
        super().step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        def hook_fn(optim: Any) -> None:
            self.step(
                noise_multiplier=optim.noise_multiplier,
                sample_rate=sample_rate * optim.accumulated_iterations,
                sketch_spec=getattr(optim, "sketch_spec", None),
            )

        return hook_fn


class _RefusesZeroNoise(_ZeroNoiseAccountant):
    """Refuses sigma = 0 in ``step`` with RCAccountant's message (the RC accountant today)."""

    def step(self, *, noise_multiplier: float, sample_rate: float, sketch_spec: Any = None) -> None:
        if not noise_multiplier > 0:
            raise ValueError(
                f"noise_multiplier must be a finite number > 0, got {noise_multiplier}"
            )
        super().step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)


class _FiniteAtZeroNoise(_ZeroNoiseAccountant):
    """Records sigma = 0 but reports a finite epsilon: a claim that would not hold."""

    def get_epsilon(self, delta: float, *args: Any, **kwargs: Any) -> float:
        return 1.0


def _engine_with(accountant: Any) -> PrivacyEngine:
    engine = PrivacyEngine(accountant="prv")
    engine.accountant = accountant
    return engine


# --------------------------------------------------------------------------------------------
# unaccountable steps and post-processing in the wrong place
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clipping", ["randomized", "flat"])
def test_zero_noise_with_rc_accountant_is_never_an_unaccounted_step(
    clipping: str, assert_no_hooks: Callable
) -> None:
    """sigma = 0 has infinite epsilon. With the RC accountant the run is either refused by
    make_private before any hook is attached, or it steps with every step accounted and an
    infinite epsilon: never accepted and then failing (or unaccounted) at every step (issue
    14, item 6). Which of the two depends on whether RCAccountant records sigma = 0."""
    model = private_mlp.FlatMLP()
    engine = PrivacyEngine()
    args = {
        "module": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.5),
        "data_loader": DataLoader(private_mlp.dataset(16, seq=False), batch_size=4),
        "noise_multiplier": 0.0,
        "max_grad_norm": 1.0,
        "clipping": clipping,
    }
    try:
        out, messages = _make_private_recording_warnings(engine, **args)
    except ValueError as err:
        assert "cannot record a step without noise" in str(err)
        assert_no_hooks(model)
        assert len(engine.accountant) == 0 and engine.dataset is None
        return
    assert messages == [_ZERO_NOISE_WARNING]
    module, opt = out[0], out[1]
    crit = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    x, y = private_mlp.batch(seq=False)
    crit(module(x), y).backward()
    opt.step()
    assert len(engine.accountant) == 1 and engine.get_epsilon(1e-5) == float("inf")


@pytest.mark.filterwarnings("ignore:Optimal order is the smallest alpha")
def test_zero_noise_is_a_debugging_run_with_infinite_epsilon() -> None:
    """Issue 14, item 6, the decided behaviour: sigma = 0 with an accountant that records it.
    make_private warns once (not per step); steps work and add no noise (two runs with
    different noise generators end at the same, moved parameters; rank-2 inputs, so the norms
    are exact and the runs deterministic); every step is accounted with its sketch spec; the
    epsilon is infinite."""
    finals = []
    for noise_seed in (1, 2):
        torch.manual_seed(0)
        model = private_mlp.FlatMLP()
        theta = private_mlp.params(model)
        engine = _engine_with(_ZeroNoiseAccountant())
        loader = DataLoader(private_mlp.dataset(16, seq=False), batch_size=4)
        (module, opt, crit, loader), messages = _make_private_recording_warnings(
            engine,
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            clipping="randomized",
            noise_generator=torch.Generator().manual_seed(noise_seed),
        )
        assert messages == [_ZERO_NOISE_WARNING]
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="noise_multiplier=0")
            for seed in (1, 2):
                x, y = private_mlp.batch(seq=False, seed=seed)
                crit(module(x), y).backward()
                opt.step()
                opt.zero_grad()
        assert engine.accountant.history == [(0.0, 1 / len(loader), 2)]
        assert engine.accountant.specs == [module.sketch_spec] * 2
        assert engine.get_epsilon(1e-5) == float("inf")
        assert not torch.equal(private_mlp.params(model), theta)
        finals.append(private_mlp.params(model))
    assert torch.equal(finals[0], finals[1])


@pytest.mark.parametrize(
    ("accountant", "match"),
    [
        pytest.param(
            _RefusesZeroNoise,
            r"noise_multiplier=0: the 'rdp' accountant cannot record a step without noise "
            r"\(ValueError: noise_multiplier must be a finite number > 0, got 0.0\), so every "
            r"optimizer step would fail. Pass a noise_multiplier > 0",
            id="refuses_the_step",
        ),
        pytest.param(
            _FiniteAtZeroNoise,
            r"reports a finite epsilon \(1 at delta=1e-05\) for a step without noise",
            id="finite_epsilon",
        ),
    ],
)
@pytest.mark.parametrize("clipping", ["randomized", "flat"])
def test_zero_noise_refused_up_front_when_the_accountant_cannot_account_it(
    accountant: type, match: str, clipping: str, assert_no_hooks: Callable
) -> None:
    """Issue 14, item 6: before, make_private accepted sigma = 0 and then every step() raised
    in the RC accountant's hook. An accountant that cannot record a noiseless step (or would
    give it a finite epsilon) now makes make_private raise, before any hook, saying what to
    do; the accountant itself is not touched (the check runs on a copy)."""
    model = private_mlp.FlatMLP()
    engine = _engine_with(accountant())
    with pytest.raises(ValueError, match=match):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(private_mlp.dataset(16, seq=False), batch_size=4),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            clipping=clipping,
        )
    assert_no_hooks(model)
    assert engine.accountant.history == [] and engine.accountant.specs == []
    assert engine.dataset is None


def test_zero_noise_with_the_rc_accountant_runs_with_infinite_epsilon() -> None:
    """Issue 14, item 6 and issue 20, item 9 with the real RC accountant: a sigma = 0
    debugging run with randomized clipping steps, every step is accounted (with its sketch
    spec), epsilon is infinite. Before, RCAccountant refused sigma = 0, so the engine refused
    the run up front and advised "an accountant that records sigma = 0", while every other
    accountant is refused for randomized clipping. The accountant warns once, at its first
    noiseless step (the engine's warning at make_private is the only one there)."""
    model = private_mlp.FlatMLP()
    engine = PrivacyEngine()
    (module, opt, crit, _), messages = _make_private_recording_warnings(
        engine,
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(private_mlp.dataset(16, seq=False), batch_size=4),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        clipping="randomized",
    )
    assert messages == [_ZERO_NOISE_WARNING]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for seed in (1, 2):
            x, y = private_mlp.batch(seq=False, seed=seed)
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
    noiseless = [str(w.message) for w in record if "without noise" in str(w.message)]
    assert len(noiseless) == 1 and "get_epsilon() is inf" in noiseless[0]
    assert len(engine.accountant) == 2 and engine.get_epsilon(1e-5) == float("inf")
    ((event, steps),) = engine.accountant.ledger
    assert steps == 2 and event.noise_multiplier == 0.0
    assert event.sketch_spec == module.sketch_spec and event.sketch_spec is not None


def test_make_private_with_epsilon_accepts_rand_on_empty() -> None:
    """Issue 14, item 5: make_private_with_epsilon(rand_on_empty=True, clipping="randomized")
    raised "unexpected keyword arguments" although make_private accepts it. Now it reaches the
    Poisson loader: 4 records at q = 1/4 give an empty batch with probability 0.75^4 = 0.32
    per draw, so 40 draws without rand_on_empty would contain one with probability
    1 - 0.68^40 > 0.9999; with it, every batch holds one random record instead. A step on such
    a batch is clipped and accounted."""
    torch.manual_seed(0)
    model = private_mlp.FlatMLP()
    engine = PrivacyEngine()
    module, opt, crit, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(private_mlp.dataset(4, seq=False), batch_size=1),
        target_epsilon=8.0,
        target_delta=1e-5,
        epochs=1,
        max_grad_norm=1.0,
        clipping="randomized",
        rand_on_empty=True,
    )
    sizes = [len(x) for _ in range(10) for x, _ in loader]
    assert len(sizes) == 40 and min(sizes) >= 1
    x, y = next(iter(loader))
    crit(module(x), y).backward()
    opt.step()
    assert len(engine.accountant) == 1 and opt.noise_multiplier > 0


@pytest.mark.filterwarnings("ignore:Secure RNG turned off")
@pytest.mark.parametrize("clipping", ["randomized", "flat"])
def test_a_noise_multiplier_below_the_accountants_range_is_refused_at_make_private(
    clipping: str,
) -> None:
    """A new user's report: noise_multiplier = 0.005 with the RC accountant trained, then
    ``get_epsilon`` raised after the run (the accountant records it but computes no epsilon
    below 0.01). Now refused at make_private, before any hook, naming the range; 0.01 is
    accepted."""
    engine = PrivacyEngine()  # the RC accountant, for both clippings
    model = private_loaders.MLP()
    with pytest.raises(ValueError, match=r"noise_multiplier=0.005 .* must be >= 0.01 \(or 0"):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(private_loaders.dataset(12), batch_size=private_loaders.B),
            noise_multiplier=0.005,
            max_grad_norm=private_loaders.C,
            clipping=clipping,
        )
    assert not hasattr(model, "autograd_grad_sample_hooks")
    private_loaders.private(
        DataLoader(private_loaders.dataset(12), batch_size=private_loaders.B),
        clipping=clipping,
        noise_multiplier=0.01,
    )


@pytest.mark.parametrize("target", [4.0, 100.0], ids=["fastDP#46-eps4", "opacus#775-eps100"])
def test_make_private_with_epsilon_spends_its_target(target: float) -> None:
    """awslabs/fast-differential-privacy#46 (2025-01): the reported epsilon was about half the
    target (2.2 for 4, 49 for 100); meta-pytorch/opacus#775 (2025-08): high targets broke the
    GDP accountant's root bracket. Here the budgeted run (2 epochs of 8 Poisson batches)
    reports an epsilon in [0.95 target, target] for both 4 and 100."""
    torch.manual_seed(0)
    model = flat_mlp.FlatMLP()
    engine = PrivacyEngine()
    module, opt, crit, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(flat_mlp.data(64), batch_size=8),
        target_epsilon=target,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=flat_mlp.C,
        clipping="randomized",
    )
    for _ in range(2):
        flat_mlp.train_all(module, opt, crit, loader)
    assert len(engine.accountant) == 2 * len(loader) == 16
    assert 0.95 * target <= engine.get_epsilon(1e-5) <= target
