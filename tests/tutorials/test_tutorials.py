"""The Opacus-style tutorials (tutorials/*.py, jupytext percent scripts paired with .ipynb).

Each tutorial runs top to bottom as a plain Python script in its smoke setting
(``OPACUS_RC_SMOKE=1``: short sequences, a few steps, on the real packaged models and vendored
data), in a subprocess, with its figures and tables written to a temporary folder so that the
committed ``tutorials/outputs/`` is never touched. The paired notebooks must hold the same code
as the scripts and carry executed outputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smoke import run_smoke  # noqa: E402

TUTORIALS_DIR = Path(__file__).resolve().parents[2] / "tutorials"
TUTORIALS = [
    "randomized_clipping_long_documents",
    "swap_the_accountant",
    "guide_to_sketched_norm_samplers",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", TUTORIALS)
def test_tutorial_runs_in_smoke_mode(name: str, tmp_path: Path) -> None:
    run_smoke(TUTORIALS_DIR / f"{name}.py", outputs=tmp_path, timeout=900)
    if name == "guide_to_sketched_norm_samplers":
        assert (tmp_path / "sketch_error_vs_k.png").stat().st_size > 0


# Tutorials committed with an executed notebook (all of them).
NOTEBOOKS = [*TUTORIALS, "dp_lora_spectral_denoising", "trainer_sft", "unit_level_long_documents"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_paired_and_executed(name: str) -> None:
    jupytext = pytest.importorskip("jupytext")
    script = jupytext.read(TUTORIALS_DIR / f"{name}.py")
    notebook = jupytext.read(TUTORIALS_DIR / f"{name}.ipynb")

    def cells(nb, kind):
        return [c.source.strip() for c in nb.cells if c.cell_type == kind]

    assert cells(notebook, "code") == cells(script, "code"), (
        f"{name}.ipynb is out of date: run `jupytext --sync tutorials/{name}.py` and re-execute"
    )
    assert cells(notebook, "markdown") == cells(script, "markdown")
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), f"{name}.ipynb has unexecuted cells"
    assert sum(bool(c.get("outputs")) for c in code) >= len(code) // 2, "outputs missing"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{name}.ipynb was saved with an error output"
