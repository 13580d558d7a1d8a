"""The Trainer / TRL tutorial (tutorials/trainer_sft.py) in its smoke setting.

``OPACUS_RC_SMOKE=1``: the real packaged SmolLM2 and the vendored speeches, 32-token passages,
24 training speeches, one epoch, in a subprocess as the other tutorials' smoke runs, through
TRL (``DPSFTTrainer``) and without it (``OPACUS_RC_NO_TRL=1``: ``DPTrainer``); the
results it writes are checked field by field (epsilon reached, the same number of optimizer
steps and the same "before" loss in both runs, a loss that moved).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smoke import run_smoke  # noqa: E402

pytest.importorskip("trl")
pytest.importorskip("peft")

SCRIPT = Path(__file__).resolve().parents[2] / "tutorials" / "trainer_sft.py"


@pytest.mark.slow
@pytest.mark.parametrize("use_trl", [True, False], ids=["DPSFTTrainer", "DPTrainer-no-trl"])
def test_trainer_sft_tutorial_smoke(tmp_path: Path, use_trl: bool) -> None:
    run_smoke(
        SCRIPT, outputs=tmp_path, timeout=900, env={"OPACUS_RC_NO_TRL": "0" if use_trl else "1"}
    )
    results = json.loads((tmp_path / "trainer_sft.json").read_text())
    dp, plain = results["dp"], results["nonprivate"]
    assert results["smoke"] is True and results["trl"] is use_trl
    assert dp["run"].startswith("DP (DPSFTTrainer" if use_trl else "DP (DPTrainer")
    # The noise search: target - 0.01 <= epsilon <= target, logged at every step.
    assert 7.99 <= dp["epsilon"] <= 8.0
    assert dp["epsilon_log"][-1] == dp["epsilon"] and len(dp["epsilon_log"]) == dp["steps"]
    assert dp["sample_rate"] == pytest.approx(1 / math.ceil(24 / 4))
    assert dp["steps"] == plain["steps"] == 6  # 24 speeches, expected batch 4, one epoch
    assert dp["held_out_loss_before"] == pytest.approx(plain["held_out_loss_before"], rel=1e-6)
    assert plain["held_out_loss_after"] < plain["held_out_loss_before"]
    assert dp["held_out_loss_after"] != dp["held_out_loss_before"]
    assert plain["epsilon"] is None
    assert (tmp_path / "trainer_sft.md").read_text().count("\n") == 4
