"""The neighbouring-dataset harness over every single-process path (issue 30, item 1).

For each path of :data:`tests.privacy.neighbouring.PATHS` the same step runs on ``D`` and on
``D`` minus its last record (or unit), with the same seeds:

* :func:`test_mechanism_is_the_same_for_neighbours`: at ``sigma = 1`` the sampling rate, the
  accounted rate and steps, the steps of an epoch, the divisor and the noise standard deviation
  measured on a zero-gradient probe parameter (``sigma C / divisor`` within the chi-square
  tolerance of :func:`~tests.privacy.neighbouring.noise_sd_rtol`) are the same for both, with
  and without a public number of records (``make_private``'s ``dataset_size``; the Trainers
  take none: their divisor is ``PrivacyArguments.expected_batch_size``);
* :func:`test_one_record_moves_the_release_by_at_most_c`: at ``sigma = 0`` the released sums
  differ by at most ``C`` (exact norms) or the sketch's bound
  (:func:`~tests.privacy.neighbouring.sensitivity_bound`), and by at least ``C / 2``: every
  record is clipped at the harness' ``C`` (the records' gradient norms are above 1, ``C`` is
  0.05 or 0.1), so removing a sampled record moves the sum by about ``C``, and a harness that
  did not remove it (or a path that dropped it) fails.

Every violation this harness found on the main of issue 30 (the Trainer's positions under left
padding, 1.67 C; a target predicted from left padding, 1.04-1.07 C; the unit loaders' divisor
from the private number of units) now passes or is refused (``REFUSED``, and the unit paths
without a public size); a new violation is added as ``xfail(strict=True)`` until it is fixed.

A new path is not done until it is in this harness.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest

from opacus_rc.batch_independence import BatchIndependenceError

pytest.importorskip("transformers")
pytest.importorskip("trl")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.privacy import neighbouring as nb  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:noise_multiplier=0"),
    pytest.mark.filterwarnings("ignore:RCAccountant recorded a step without noise"),
    pytest.mark.filterwarnings("ignore:PrivacyArguments.seed"),
    pytest.mark.filterwarnings("ignore:PrivacyArguments.sketch_seed"),
    pytest.mark.filterwarnings("ignore:epsilon cannot be computed"),
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated"),
]

SIGMA = 1.0
#: The probe's noise draws: ``PROBE_WIDTH^2`` weights and ``PROBE_WIDTH`` biases.
PROBE_DRAWS = nb.PROBE_WIDTH**2 + nb.PROBE_WIDTH
SD_RTOL = nb.noise_sd_rtol(PROBE_DRAWS)

UNIT_PATHS = ("engine-units", "unit-loader-virtual", "unit-split", "distributed-unit-loader-w1")
#: Paths that differ from another only in their labels (the mechanism is the same).
LABEL_VARIANTS = ("engine-gpt2-left-pad-target", "trainer-gpt2-left-mask-positions")

#: Refused by the engine's batch-independence check (on by default): under left padding the
#: last pad position's logit predicts the first real token (the causal shift; labels -100 only
#: on padding, as DataCollatorForLanguageModeling), and that pad's hidden state depends on the
#: batch's padding: 1.04 C on the engine (1.07 C on the Trainer, which now drops these targets)
#: before issue 30; the check refuses the first step before anything is noised or accounted.
REFUSED = {"engine-gpt2-left-pad-target": "predicted from padding positions"}


def mechanism_cases() -> list:
    cases = []
    for name, (_, has_public) in nb.PATHS.items():
        if name in LABEL_VARIANTS:
            continue
        for public in (True, False) if has_public else (False,):
            size = "public-size" if public else "no-public-size"
            cases.append(pytest.param(name, public, id=f"{name}-{size}"))
    return cases


#: Known: under a bfloat16 autocast the records present in both runs round differently when
#: the batch changes (the padded length, the packing), and their clipped contributions move by
#: bfloat16 rounding: 1.0017 C padded (so on main before issue 34 too, where the padded path
#: already trained), 1.0018 C packed (refused before issue 34 by the check's false alarm).
#: Float rounding beyond the float32 slack of the bound, not a dependence the check can see;
#: left failing (strict) so that a change in either direction is seen.
BF16_ROUNDING = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="bfloat16 rounding of the other records' contributions depends on the batch "
    "(1.0017-1.0018 C; the bound's slack is float32's 1e-4)",
)


def release_cases() -> list:
    marks = {"sft-trainer-bf16": [BF16_ROUNDING], "sft-trainer-packing-bf16": [BF16_ROUNDING]}
    return [pytest.param(name, id=name, marks=marks.get(name, [])) for name in nb.PATHS]


def neighbours(name: str, **kw: object) -> tuple[nb.Release, nb.Release]:
    run, _ = nb.PATHS[name]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        return run(neighbour=False, **kw), run(neighbour=True, **kw)


@pytest.mark.parametrize(("name", "public"), mechanism_cases())
def test_mechanism_is_the_same_for_neighbours(name: str, public: bool) -> None:
    if name in UNIT_PATHS and not public:
        # Without a public number of units the divisor could only come from the private
        # count (12 vs 11 units at q = 0.25: divisor 3 vs 2, the noise sd 1.5x, on main
        # before issue 30): both neighbours are refused before any hook or step.
        for neighbour in (False, True):
            with pytest.raises(ValueError, match="Opacus #819"):
                nb.PATHS[name][0](neighbour=neighbour, noise_multiplier=SIGMA, public_size=False)
        return
    a, b = neighbours(name, noise_multiplier=SIGMA, public_size=public)
    assert a.mechanism.accounted_steps == 1 and a.mechanism.noise_multiplier == SIGMA
    assert math.isfinite(a.mechanism.noise_sd) and a.mechanism.noise_sd > 0
    differences = nb.mechanism_differences(a.mechanism, b.mechanism, sd_rtol=SD_RTOL)
    assert not differences, f"{name}: the mechanism of D and D-1 differ: {differences}"


@pytest.mark.parametrize("name", release_cases())
def test_one_record_moves_the_release_by_at_most_c(name: str) -> None:
    if name in REFUSED:
        for neighbour in (False, True):
            with pytest.raises(BatchIndependenceError, match=REFUSED[name]):
                nb.PATHS[name][0](neighbour=neighbour, noise_multiplier=0.0, public_size=False)
        return
    # The unit paths need a public number of units (refused without one, above).
    a, b = neighbours(name, noise_multiplier=0.0, public_size=name in UNIT_PATHS)
    # The masks are aligned: the same records, plus the removed one in D's step.
    assert a.removed in a.sampled, f"{name}: the seed does not sample the removed record"
    assert set(b.sampled) == set(a.sampled) - {a.removed}
    c = a.mechanism.max_grad_norm
    distance = nb.release_distance(a, b)
    bound = nb.sensitivity_bound(max_grad_norm=c, sketch_dim=a.sketch_dim, others=len(b.sampled))
    assert distance >= 0.5 * c, f"{name}: removing a sampled record moved the sum by {distance}"
    assert distance <= bound, (
        f"{name}: removing one record moved the released sum by {distance / c:.4f} C "
        f"(bound {bound / c:.4f} C)"
    )


# ---------------------------------------------------------------------------------------------
# The harness' own comparisons can fail
# ---------------------------------------------------------------------------------------------


def mechanism(**kw: float) -> nb.Mechanism:
    base = {
        "sample_rate": 0.25,
        "accounted_rate": 0.25,
        "accounted_steps": 1,
        "steps_per_epoch": 4,
        "divisor": 3.0,
        "noise_multiplier": 1.0,
        "max_grad_norm": 0.05,
        "noise_sd": 0.05 / 3,
    }
    base.update(kw)
    return nb.Mechanism(**base)


def test_mechanism_differences_name_each_quantity() -> None:
    same = mechanism()
    assert nb.mechanism_differences(same, mechanism(), sd_rtol=SD_RTOL) == []
    # The unit-loader case: divisor 3 vs 2, the sd 1.5x.
    got = nb.mechanism_differences(same, mechanism(divisor=2.0, noise_sd=0.025), sd_rtol=SD_RTOL)
    assert got[0] == "divisor: 3.0 vs 2.0" and any("noise sd" in d for d in got)
    # A measured sd off by 3% (beyond 6 sigma of the probe's chi-square) is caught alone.
    off = mechanism(noise_sd=0.05 / 3 * 1.03)
    assert nb.mechanism_differences(off, off, sd_rtol=SD_RTOL) != []
    assert nb.mechanism_differences(same, mechanism(sample_rate=1 / 3), sd_rtol=SD_RTOL) == [
        "sample_rate: 0.25 vs 0.3333333333333333"
    ]


def test_tolerances_are_the_derived_values() -> None:
    # 6 / sqrt(2 * 65792) = 1.65%.
    assert abs(SD_RTOL - 0.01654) < 1e-5
    assert nb.sensitivity_bound(max_grad_norm=2.0, sketch_dim=None, others=5) == pytest.approx(
        2.0002
    )
    e = 5 / math.sqrt(2 * 4096)
    want = 1 / (1 - e) + 3 * (1 / (1 - e) - 1 / (1 + e))
    assert nb.sensitivity_bound(max_grad_norm=1.0, sketch_dim=4096, others=3) == pytest.approx(
        want * (1 + 1e-4)
    )


def test_a_public_size_fixes_the_rate_across_a_batch_boundary() -> None:
    # 13 vs 12 records at an expected batch of 4: from the private count q is
    # 1 / ceil(13 / 4) = 1/4 vs 1/3 (treated as public, as Opacus, and documented); a public
    # size gives both neighbours 1/4, on the engine's rule and on the Trainers' (which use it).
    from torch.utils.data import DataLoader

    from opacus_rc.engine.schedule import public_sizes
    from opacus_rc.integrations.train_data import trainer_schedule

    private = [trainer_schedule(n, expected_batch_size=4) for n in (13, 12)]
    assert [s.sizes.sample_rate for s in private] == [1 / 4, 1 / 3]
    public = [trainer_schedule(n, expected_batch_size=4, dataset_size=13) for n in (13, 12)]
    assert [(s.sizes.sample_rate, s.sizes.steps_per_epoch) for s in public] == [(1 / 4, 4)] * 2
    engine = [public_sizes(DataLoader(range(n), batch_size=4), dataset_size=13) for n in (13, 12)]
    assert engine[0] == engine[1] and engine[0].sample_rate == 1 / 4
