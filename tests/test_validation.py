"""The shared validators: one rule and one message per option, at every entry point."""

from __future__ import annotations

import math

import numpy as np
import pytest

from opacus_rc.accountants.analysis.envelope import SensitivityEnvelope
from opacus_rc.config import RandomizedClippingConfig
from opacus_rc.sketching import SketchSpec
from opacus_rc.validation import (
    validate_choice,
    validate_delta,
    validate_max_grad_norm,
    validate_noise_multiplier,
    validate_sample_rate,
    validate_sketch_dim,
)


def test_sketch_dim_accepts_integers_and_refuses_the_rest() -> None:
    assert validate_sketch_dim(np.int64(3)) == 3 and type(validate_sketch_dim(np.int64(3))) is int
    assert validate_sketch_dim(None, allow_none=True) is None
    with pytest.raises(TypeError, match="sketch_dim must be an int, got NoneType"):
        validate_sketch_dim(None)
    with pytest.raises(TypeError, match=r"head_dim must be an int >= 1 or None \(exact"):
        validate_sketch_dim(2.0, "head_dim", allow_none=True)
    with pytest.raises(ValueError, match=r"got 0 \(the number .*\); use sketch_dim=None"):
        validate_sketch_dim(0, allow_none=True)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda k: SketchSpec(estimator="hutchinson", sketch_dim=k), id="SketchSpec"),
        pytest.param(
            lambda k: RandomizedClippingConfig(max_grad_norm=1.0, sketch_dim=k), id="config"
        ),
        pytest.param(lambda k: SensitivityEnvelope(sketch_dim=k), id="envelope"),
    ],
)
def test_every_entry_point_refuses_a_bad_sketch_dim_alike(build) -> None:
    # The same rule in every place the sketch dimension enters (was: three copies, and
    # SketchSpec refused a numpy integer that the envelope accepted).
    with pytest.raises(ValueError, match=r"^sketch_dim must be >= 1, got 0 \(the number"):
        build(0)
    with pytest.raises(TypeError, match="^sketch_dim must be an int"):
        build(True)
    assert build(np.int32(4)).sketch_dim == 4


def test_max_grad_norm() -> None:
    assert validate_max_grad_norm(2) == 2.0
    with pytest.raises(TypeError, match="one float max_grad_norm"):
        validate_max_grad_norm([1.0])
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="max_grad_norm must be a finite number > 0"):
            validate_max_grad_norm(bad)


def test_noise_multiplier_zero_only_where_allowed() -> None:
    assert validate_noise_multiplier(0) == 0.0
    assert validate_noise_multiplier(0.5, allow_zero=False) == 0.5
    with pytest.raises(ValueError, match=r"finite number > 0 \(noise std"):
        validate_noise_multiplier(0.0, allow_zero=False)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(
            ValueError, match=r"finite number > 0, or 0 for a step without noise \(noise std"
        ):
            validate_noise_multiplier(bad)
    for bad in ("one", True, None):
        with pytest.raises(TypeError, match="noise_multiplier must be a number"):
            validate_noise_multiplier(bad)


def test_sample_rate_delta_choice() -> None:
    assert validate_sample_rate(1) == 1.0
    for bad in (0.0, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\]"):
            validate_sample_rate(bad)
    with pytest.raises(ValueError, match=r"target_delta must be in \(0, 1\), got 1"):
        validate_delta(1, "target_delta")
    with pytest.raises(TypeError, match="delta must be a number"):
        validate_delta("x")
    with pytest.raises(ValueError, match=r"svd must be one of \('a', 'b'\), got 'c'"):
        validate_choice("svd", "c", ("a", "b"))
