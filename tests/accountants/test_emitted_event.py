"""The optimizer emits the step's DP event; the accountant composes what it is given.

Before, ``RCAccountant``'s step hook read ``noise_multiplier``, ``accumulated_iterations`` and
``sketch_spec`` off the optimizer (whose ``sketch_spec`` is the grad-sample module's) and
built the event itself. Now ``RandomizedClipOptimizer.dp_event`` builds it and the hook
composes it (``RCAccountant.record``), reading nothing else of the optimizer; plain Opacus
optimizers keep the old path.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from opacus_rc.accountants import RCAccountant
from opacus_rc.accountants.events import RandomizedClipDpEvent, history_entry
from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.optimizers import DPLossRandomizedClipping, RandomizedClipOptimizer
from opacus_rc.sketching import SketchSpec

pytestmark = pytest.mark.filterwarnings("ignore:a sketch_generator was passed")

S16 = SketchSpec(estimator="hutchinson", sketch_dim=16)


class Emitter:
    """An optimizer that only emits its event: any other attribute read fails the test."""

    def __init__(self, event: RandomizedClipDpEvent) -> None:
        self.event = event
        self.rates: list[float] = []

    def dp_event(self, *, sample_rate: float) -> RandomizedClipDpEvent:
        self.rates.append(sample_rate)
        return self.event

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the accountant read optimizer.{name}")


def test_the_hook_composes_the_emitted_event_and_reads_nothing_else() -> None:
    acc = RCAccountant()
    event = RandomizedClipDpEvent(noise_multiplier=1.1, sample_rate=0.02, sketch_spec=S16)
    opt = Emitter(event)
    acc.get_optimizer_hook_fn(sample_rate=0.005)(opt)
    assert opt.rates == [0.005]
    assert acc.history == [history_entry(event, 1)] == [(1.1, 0.02, 1, S16.to_dict())]


def test_threat_models_of_an_emitted_event() -> None:
    hidden = RandomizedClipDpEvent(noise_multiplier=1.0, sample_rate=0.01, sketch_spec=S16)
    revealed = RandomizedClipDpEvent(
        noise_multiplier=1.0, sample_rate=0.01, sketch_spec=S16, threat_model="revealed"
    )
    # A "revealed" accountant accounts a "hidden" event under the weaker assumption ...
    acc = RCAccountant(threat_model="revealed")
    acc.record(hidden)
    assert acc.ledger[0][0].threat_model == "revealed"
    # ... and a "hidden" one never upgrades a "revealed" event: refused, naming the fix.
    with pytest.raises(ValueError, match="threat_model='revealed'"):
        RCAccountant().record(revealed)
    with pytest.raises(TypeError, match="RandomizedClipDpEvent"):
        RCAccountant().record((1.0, 0.01))  # type: ignore[arg-type]


def rc_optimizer(*, secret: bool) -> tuple[Any, RandomizedClipOptimizer, Any]:
    """A passed (seeded) sketch generator makes the sketch public (``secret=False``)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    gsm = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=1.0,
        sketch_dim=8,
        loss_reduction="sum",
        sketch_generator=None if secret else torch.Generator().manual_seed(1),
    )
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=0.1),
        grad_sample_module=gsm,
        noise_multiplier=1.3,
        expected_batch_size=4,
        loss_reduction="sum",
    )
    crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss(reduction="sum"), "sum")
    return gsm, opt, crit


def test_the_randomized_clip_optimizer_emits_its_complete_event() -> None:
    gsm, opt, crit = rc_optimizer(secret=True)
    event = opt.dp_event(sample_rate=0.25)
    assert event == RandomizedClipDpEvent(
        noise_multiplier=1.3, sample_rate=0.25, sketch_spec=gsm.sketch_spec, threat_model="hidden"
    )
    assert event.sketch_dim == 8
    # One step through the engine's hook: the history holds exactly the emitted event.
    acc = RCAccountant()
    opt.attach_step_hook(acc.get_optimizer_hook_fn(sample_rate=0.25))
    crit(gsm(torch.randn(4, 4)), torch.zeros(4, dtype=torch.long)).backward()
    opt.step()
    assert acc.history == [history_entry(event, 1)]


def test_a_public_sketch_is_emitted_as_revealed_and_accounted_so() -> None:
    gsm, opt, crit = rc_optimizer(secret=False)
    event = opt.dp_event(sample_rate=0.25)
    assert not gsm.sketch_spec.supports_hidden
    assert event.threat_model == "revealed" and event.sketch_spec == gsm.sketch_spec
    acc = RCAccountant()  # built for "hidden": composes the revealed event as given
    opt.attach_step_hook(acc.get_optimizer_hook_fn(sample_rate=0.25))
    crit(gsm(torch.randn(4, 4)), torch.zeros(4, dtype=torch.long)).backward()
    opt.step()
    assert acc.ledger[0][0] == event
