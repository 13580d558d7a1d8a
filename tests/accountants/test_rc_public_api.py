"""The public RCAccountant methods noise_search uses (config, empty_copy, clear,
threat_model_for): each answers what its docstring says, on values that could be wrong."""

from __future__ import annotations

import pytest

from opacus_rc.accountants import RCAccountant
from opacus_rc.accountants.events import RandomizedClipDpEvent
from opacus_rc.sketching import SketchSpec

SECRET = SketchSpec(estimator="hutchinson", sketch_dim=8)
SEEDED = SketchSpec(estimator="hutchinson", sketch_dim=8, secret=False)
SHARED = SketchSpec(estimator="hutchinson", sketch_dim=8, per_sample=False)


@pytest.mark.parametrize(
    ("built", "spec", "expected"),
    [
        ("hidden", None, "hidden"),
        ("revealed", None, "hidden"),  # exact clipping: the two models coincide
        ("hidden", SECRET, "hidden"),
        ("revealed", SECRET, "revealed"),
        ("hidden", SEEDED, "revealed"),  # a seeded sketch is not secret
        ("hidden", SHARED, "revealed"),  # one sketch for all samples
    ],
)
def test_threat_model_for(built: str, spec: SketchSpec | None, expected: str) -> None:
    acc = RCAccountant(threat_model=built)
    assert acc.threat_model_for(spec) == expected
    # compose accepts exactly the event built with that answer
    event = RandomizedClipDpEvent(
        noise_multiplier=1.0, sample_rate=0.01, sketch_spec=spec, threat_model=expected
    )
    assert acc.supports(event)


def test_empty_copy_keeps_config_and_not_ledger() -> None:
    acc = RCAccountant(sketch_dim=16, envelope="chi2", threat_model="revealed", eps_error=0.05)
    acc.step(noise_multiplier=1.0, sample_rate=0.01, sketch_spec=SECRET)
    copy = acc.empty_copy()
    assert copy is not acc
    assert copy.config() == {
        "sketch_dim": 16,
        "envelope": "chi2",
        "threat_model": "revealed",
        "eps_error": 0.05,
    }
    assert copy.history == [] and len(acc) == 1
    copy.step(noise_multiplier=2.0, sample_rate=0.01, sketch_spec=SECRET)
    assert len(acc) == 1  # the copy's ledger is its own


def test_clear_empties_the_ledger_only() -> None:
    acc = RCAccountant(sketch_dim=4, eps_error=0.02)
    acc.step(noise_multiplier=1.0, sample_rate=0.01, sketch_spec=SECRET)
    acc.step(noise_multiplier=1.0, sample_rate=0.01, sketch_spec=SECRET)
    assert len(acc) == 2
    acc.clear()
    assert acc.history == [] and len(acc) == 0
    assert acc.config()["sketch_dim"] == 4 and acc.eps_error == 0.02


def test_state_dict_stores_config() -> None:
    acc = RCAccountant(sketch_dim=3, threat_model="revealed")
    assert acc.state_dict()["rc_config"] == acc.config()


@pytest.mark.parametrize("requested", ["hidden", "revealed"])
@pytest.mark.parametrize(
    "spec", [None, SECRET, SEEDED, SHARED], ids=["exact", "secret", "seeded", "shared"]
)
def test_every_threat_model_choice_is_the_one_function(
    requested: str, spec: SketchSpec | None
) -> None:
    """The optimizer's event, the history adapter, the accountant and a plain optimizer's event
    all choose the threat model by accounted_threat_model (one rule, one place)."""
    from types import SimpleNamespace

    from opacus_rc.accountants.events import (
        accounted_threat_model,
        event_from_history_entry,
        optimizer_step_event,
    )
    from opacus_rc.optimizers import RandomizedClipOptimizer

    # The rule, written out: exact clipping is "hidden"; a non-secret or shared sketch only
    # has "revealed"; otherwise the requested model.
    expected = "hidden" if spec is None else (requested if spec is SECRET else "revealed")
    assert accounted_threat_model(spec, requested=requested) == expected
    assert RCAccountant(threat_model=requested).threat_model_for(spec) == expected
    entry = (1.0, 0.01, 3, None if spec is None else spec.to_dict())
    event, _ = event_from_history_entry(entry, default_spec=None, threat_model=requested)
    assert event.threat_model == expected
    optim = SimpleNamespace(noise_multiplier=1.0, accumulated_iterations=2, sketch_spec=spec)
    strongest = accounted_threat_model(spec)
    emitted = RandomizedClipOptimizer.dp_event(optim, sample_rate=0.01)  # type: ignore[arg-type]
    assert (emitted.threat_model, emitted.sample_rate) == (strongest, 0.02)
    plain = optimizer_step_event(SimpleNamespace(**vars(optim)), sample_rate=0.01)
    assert plain == emitted
    emitter = SimpleNamespace(dp_event=lambda *, sample_rate: (emitted, sample_rate))
    assert optimizer_step_event(emitter, sample_rate=0.5) == (emitted, 0.5)  # asked, not read
    with pytest.raises(ValueError, match="threat_model must be one of"):
        accounted_threat_model(spec, requested="secret")


def test_recording_the_same_event_again_equals_composing_it() -> None:
    """``record`` of the event object it recorded last (a run's optimizer emits one event object
    per (sigma, C, iterations)) only counts one more step of that history entry: the history
    must equal the one built from equal but distinct events (the full path), and a history
    changed in between (another entry, a loaded state) must not be counted into."""
    event = RandomizedClipDpEvent(
        noise_multiplier=1.0, sample_rate=0.01, sketch_spec=SEEDED, threat_model="revealed"
    )
    other = RandomizedClipDpEvent(
        noise_multiplier=2.0, sample_rate=0.01, sketch_spec=SECRET, threat_model="hidden"
    )
    fast, slow = RCAccountant(), RCAccountant()
    for _ in range(3):
        fast.record(event)
        slow.record(RandomizedClipDpEvent(**vars(event)))  # equal, never the same object
    assert fast.history == slow.history == [(1.0, 0.01, 3, SEEDED.to_dict())]
    fast.record(other)  # another entry between two records of the same object
    fast.record(event)
    assert fast.history == [
        (1.0, 0.01, 3, SEEDED.to_dict()),
        (2.0, 0.01, 1, SECRET.to_dict()),
        (1.0, 0.01, 1, SEEDED.to_dict()),
    ]
    fast.load_state_dict(slow.state_dict())  # a loaded state: the history is replaced
    fast.record(event)
    assert fast.history == [(1.0, 0.01, 4, SEEDED.to_dict())]
    fast.history.append((2.0, 0.01, 1, SECRET.to_dict()))  # Opacus writes the history too
    fast.record(event)
    assert fast.history[-1] == (1.0, 0.01, 1, SEEDED.to_dict()) and len(fast) == 6
