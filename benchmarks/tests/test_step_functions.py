"""Issue 31's measure of how much code one private step runs through
(:mod:`benchmarks.step_functions`): its target holds, and the count is of what runs."""

from __future__ import annotations

from benchmarks import step_functions


def test_one_step_passes_through_at_most_70_functions_in_14_files() -> None:
    """The issue's target (before the one-owner redesign: 154 functions in 27 files). The trace
    must contain the step's landmarks, so that an empty or misdirected trace cannot pass."""
    calls = step_functions.trace_step("opacus_rc")
    functions, files = step_functions.summarise(calls)
    names = {name for _, _, name in calls}
    assert {"PrivateStep.backward", "RandomizedClipOptimizer.add_noise"} <= names
    assert "hutchinson_sqnorm" in names  # the sketched norm of the nn.Linear layers ran
    assert functions <= 70 and files <= 14, (functions, files)
