"""The unit-level tutorial (tutorials/unit_level_long_documents.py), issue 23 item 4.

* its group-privacy search ``group_epsilon``, taken from the script, against the closed form
  for an accountant whose epsilon does not depend on delta (``d = delta (e^e - 1) /
  (e^{m e} - 1)``, epsilon ``m e``) and against one that stops certifying below a delta;
* the tutorial in its smoke setting (``OPACUS_RC_SMOKE=1``: the real packaged SmolLM2 and the
  vendored speeches, windows of 16 tokens, 2 per speech), in a subprocess, with the results it
  writes checked field by field.
"""

from __future__ import annotations

import ast
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smoke import run_smoke  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "tutorials" / "unit_level_long_documents.py"


def _group_epsilon():
    tree = ast.parse(SCRIPT.read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "group_epsilon"]
    namespace: dict = {"math": math}
    exec(compile(ast.Module([fn], type_ignores=[]), str(SCRIPT), "exec"), namespace)
    return namespace["group_epsilon"]


@pytest.mark.parametrize(("e", "m"), [(1.0, 2), (1.0, 4), (3.0, 3), (0.5, 16)])
def test_group_epsilon_against_closed_form(e: float, m: int) -> None:
    group_epsilon = _group_epsilon()
    delta = 1e-5
    eps, d = group_epsilon(lambda _d: e, m, delta)
    assert eps == pytest.approx(m * e, rel=1e-12)
    # The largest d whose group delta d (e^{m e} - 1) / (e^e - 1) is <= delta; the search
    # brackets it within half a decade and halves the bracket 12 times (log10 width
    # 0.5 / 4096), so d is within 0.03 % below it, never above.
    best = delta * math.expm1(e) / math.expm1(m * e)
    assert best * (1 - 5e-4) <= d <= best * (1 + 1e-12)


def test_group_epsilon_not_certified_and_single_window() -> None:
    group_epsilon = _group_epsilon()

    def eps_at(d: float) -> float:
        if d < 1e-20:
            raise ValueError("below the accountant's smallest certifiable delta")
        return 8.0 + math.log10(1e-5 / d)  # grows as d shrinks

    assert group_epsilon(eps_at, 1, 1e-5) == (8.0, 1e-5)
    assert group_epsilon(eps_at, 4, 1e-5) is None  # e^{3 * 8} alone is 2.6e10
    eps, d = group_epsilon(eps_at, 2, 1e-5)
    e = eps / 2
    assert e == pytest.approx(eps_at(d))
    assert d * (math.exp(e) + 1) <= 1e-5 * (1 + 1e-9)  # m = 2: (e^{2e} - 1) / (e^e - 1)


@pytest.mark.slow
def test_smoke_run(tmp_path: Path) -> None:
    run_smoke(SCRIPT, outputs=tmp_path)
    out = json.loads((tmp_path / "unit_level_results.json").read_text())
    unit, window, none = out["unit"], out["window"], out["none"]
    assert unit["smoke"] is True and unit["settings"]["windows_per_speech"] == 2
    for r in (unit, window):
        assert 7.9 <= r["epsilon"] <= 8.0 and r["delta"] == 1e-5
        assert r["steps"] == len(r["records_per_step"]) == len(r["train_losses"]) == 2
    assert (unit["epsilon_unit"], window["epsilon_unit"]) == ("speech", "window")
    # The same sampling rate and number of steps: the same noise for the same epsilon, whether
    # the record is a speech (sensitivity C per speech) or a window (C per window).
    assert unit["sample_rate"] == window["sample_rate"] == 0.5
    assert unit["noise_multiplier"] == pytest.approx(window["noise_multiplier"], rel=1e-6)
    assert none["epsilon"] is None and none["noise_multiplier"] == 0.0
    # The unit loader samples speeches (4 in smoke): at most 4 per step; the window loader
    # samples windows (8).
    assert max(unit["records_per_step"]) <= 4 and max(window["records_per_step"]) <= 8
    before = unit["perplexity_before"]
    assert 1.0 < before < 1000.0
    assert window["perplexity_before"] == none["perplexity_before"] == before
    for r in (unit, window, none):
        assert math.isfinite(r["perplexity_after"]) and r["perplexity_after"] != before
    group = out["group_privacy_of_window_run"]
    assert group["1"]["epsilon"] == pytest.approx(window["epsilon"])
    # Two windows: more than twice the per-window epsilon at 1e-5 (the group bound needs the
    # per-window epsilon at a much smaller delta), and its group delta is within 1e-5.
    two = group["2"]
    assert two["epsilon"] > 2 * window["epsilon"] and two["window_delta"] < 1e-5
    e = two["epsilon"] / 2
    assert two["window_delta"] * (math.exp(e) + 1) <= 1e-5 * (1 + 1e-9)
    table = (tmp_path / "unit_level_results.md").read_text()
    assert "| unit-level DP (speech) |" in table and "(group privacy)" in table
