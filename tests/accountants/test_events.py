"""The typed ledger: RandomizedClipDpEvent, the one history adapter, RCAccountant.compose."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from opacus_rc.accountants import RCAccountant
from opacus_rc.accountants.events import (
    RandomizedClipDpEvent,
    event_from_history_entry,
    history_entry,
)
from opacus_rc.sketching import SketchSpec

Q = 0.01
DELTA = 1e-5
S32 = SketchSpec(estimator="hutchinson", sketch_dim=32)
SHARED = SketchSpec(estimator="hutchinson", sketch_dim=32, per_sample=False)


def event(**kw) -> RandomizedClipDpEvent:
    kw.setdefault("noise_multiplier", 1.0)
    kw.setdefault("sample_rate", Q)
    return RandomizedClipDpEvent(**kw)


# ----------------------------------------------------------------------------- the event
def test_event_is_frozen_validated_and_normalised() -> None:
    e = event(sketch_spec=S32.to_dict())  # the to_dict() form is converted
    assert e.sketch_spec == S32 and e.sketch_dim == 32 and e.threat_model == "hidden"
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.noise_multiplier = 2.0  # type: ignore[misc]
    # exact clipping: S = 1, both threat models coincide and are stored as "hidden"
    assert event(threat_model="revealed") == event()
    # Hutch++ is certified by its tail columns (docs/privacy/hutchpp.md#hutchpp-theorem-h)
    hpp = SketchSpec(estimator="hutch++", sketch_dim=16, head_dim=64)
    assert event(sketch_spec=hpp).sketch_dim == 16
    assert hash(event(sketch_spec=S32)) == hash(event(sketch_spec=S32.to_dict()))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"noise_multiplier": -1.0}, ValueError, "noise_multiplier must be a finite number > 0"),
        ({"noise_multiplier": math.inf}, ValueError, "noise_multiplier must be a finite"),
        ({"noise_multiplier": "one"}, TypeError, "noise_multiplier must be a number"),
        ({"sample_rate": 0.0}, ValueError, r"sample_rate must be in \(0, 1\]"),
        ({"sample_rate": 1.5}, ValueError, r"sample_rate must be in \(0, 1\]"),
        ({"threat_model": "shared"}, ValueError, "threat_model must be one of"),
        ({"sketch_spec": 32}, TypeError, "sketch_spec must be a SketchSpec"),
        ({"sketch_spec": SHARED}, ValueError, "use threat_model='revealed'"),
    ],
)
def test_bad_events_raise(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        event(**kwargs)


# ----------------------------------------------------------------------------- the adapter
def test_adapter_reads_every_history_format() -> None:
    """3-tuples (Opacus) take the accountant's own sketch; 4-tuples carry theirs; lists (JSON)
    read as tuples; a shared sketch is accounted as revealed whatever the accountant's model."""
    read = event_from_history_entry
    assert read((1.0, Q, 7), default_spec=S32, threat_model="hidden") == (
        event(sketch_spec=S32),
        7,
    )
    assert read((1.0, Q, 7), default_spec=None, threat_model="revealed") == (event(), 7)
    assert read([1.0, Q, 7, S32.to_dict()], default_spec=None, threat_model="hidden") == (
        event(sketch_spec=S32),
        7,
    )
    assert read((1.0, Q, 3, None), default_spec=S32, threat_model="hidden") == (event(), 3)
    assert read((1.0, Q, 3, SHARED.to_dict()), default_spec=None, threat_model="hidden") == (
        event(sketch_spec=SHARED, threat_model="revealed"),
        3,
    )
    assert read((1.0, Q, np.int64(4)), default_spec=None, threat_model="hidden")[1] == 4
    e = event(noise_multiplier=1.3, sketch_spec=S32, threat_model="revealed")
    assert read(history_entry(e, 5), default_spec=None, threat_model="revealed") == (e, 5)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ((1.0, Q), "history entries must be"),
        ((1.0, Q, 1, None, "x"), "history entries must be"),
        ((1.0, Q, -1), "steps must be an integer >= 0"),
        ((1.0, Q, 1.5), "steps must be an integer >= 0"),
        ((1.0, Q, True), "steps must be an integer >= 0"),
        ((-1.0, Q, 1), "noise_multiplier must be a finite"),
        ((1.0, Q, 1, {"estimator": "hutchinson", "sketch_dim": 0}), "sketch_dim must be >= 1"),
    ],
)
def test_adapter_rejects_malformed_entries(entry: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        event_from_history_entry(entry, default_spec=None, threat_model="hidden")


# ----------------------------------------------------------------------------- compose
def test_compose_merges_equal_events_and_matches_step() -> None:
    by_step = RCAccountant()
    for _ in range(3):
        by_step.step(noise_multiplier=1.0, sample_rate=Q, sketch_spec=S32)
    by_compose = RCAccountant()
    assert by_compose.compose(event(sketch_spec=S32), 2).compose(event(sketch_spec=S32)) is (
        by_compose
    )
    assert by_compose.history == by_step.history == [(1.0, Q, 3, S32.to_dict())]
    by_compose.compose(event(), 4)
    assert by_compose.ledger == [(event(sketch_spec=S32), 3), (event(), 4)]
    assert len(by_compose) == 7


def test_compose_refuses_what_the_history_cannot_represent() -> None:
    """The history stores the sketch, and the threat model is read back from it and the
    accountant's configuration; an event of another model is refused, not re-interpreted."""
    hidden, revealed = RCAccountant(), RCAccountant(threat_model="revealed")
    rev = event(sketch_spec=S32, threat_model="revealed")
    assert hidden.supports(event(sketch_spec=S32)) and not hidden.supports(rev)
    assert revealed.supports(rev) and not revealed.supports(event(sketch_spec=S32))
    assert hidden.supports(event(sketch_spec=SHARED, threat_model="revealed"))
    assert not hidden.supports((1.0, Q, 1))
    with pytest.raises(ValueError, match=r"use RCAccountant\(threat_model='revealed'\)"):
        hidden.compose(rev)
    with pytest.raises(TypeError, match="composes RandomizedClipDpEvent"):
        hidden.compose((1.0, Q, 1))  # type: ignore[arg-type]
    for count in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match="count must be an integer >= 1"):
            hidden.compose(event(), count)  # type: ignore[arg-type]
    assert hidden.history == []


# ----------------------------------------------------------------------------- checkpoints
# A checkpoint exactly as the accountant wrote it before the typed ledger (commit 9cef122):
# Opacus' state dict plus rc_config, history entries 4-tuples (spec dict or None) and 3-tuples.
OLD_CHECKPOINT = OrderedDict(
    history=[
        (1.0, 0.01, 3, {"estimator": "hutchinson", "sketch_dim": 32, "head_dim": None,
                        "per_sample": True, "secret": True}),
        (1.0, 0.01, 2, None),
        (1.3, 0.01, 7),
    ],
    mechanism="rc",
    rc_config={"sketch_dim": 16, "envelope": "chi2", "threat_model": "hidden", "eps_error": 0.01},
)  # fmt: skip


def test_old_checkpoints_load_and_account_the_same(tmp_path: Path) -> None:
    expected = RCAccountant(sketch_dim=16)
    expected.compose(event(sketch_spec=S32), 3).compose(event(), 2)
    expected.compose(event(noise_multiplier=1.3, sketch_spec=SketchSpec("hutchinson", 16)), 7)
    eps = expected.get_epsilon(DELTA)
    for state in (
        OLD_CHECKPOINT,
        json.loads(json.dumps(OLD_CHECKPOINT)),  # lists instead of tuples
    ):
        path = tmp_path / "old.pt"
        torch.save(state, path)
        acc = RCAccountant()
        acc.load_state_dict(torch.load(path, weights_only=True))
        assert acc.sketch_dim == 16 and len(acc) == 12
        assert acc.ledger[2] == (
            event(noise_multiplier=1.3, sketch_spec=SketchSpec("hutchinson", 16)),
            7,
        )
        assert acc.get_epsilon(DELTA) == eps
    # Opacus' own PRV/RDP state dicts carry no rc_config: 3-tuples use the loader's sketch
    acc = RCAccountant(sketch_dim=16)
    acc.load_state_dict({"history": [(1.3, 0.01, 7)], "mechanism": "rc"})
    assert acc.ledger == [expected.ledger[2]]


def test_malformed_checkpoints_fail_at_load() -> None:
    with pytest.raises(ValueError, match="steps must be an integer >= 0"):
        RCAccountant().load_state_dict({"history": [(1.0, Q, -3)], "mechanism": "rc"})
