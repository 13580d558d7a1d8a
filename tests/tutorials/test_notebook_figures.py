"""Issue 14, item 11: an executed tutorial notebook shows the figures its cells draw.

A code cell that saves or shows a matplotlib figure must carry an ``image/png`` output; the
markdown after it reads the plot ("What the plot says"). Only the committed ``.ipynb`` JSON is
read (nothing is executed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"
PLOTTING = ("savefig(", "plt.show(")

#: Notebooks whose plotting cell ran under the Agg backend and was saved without its image;
#: the script must stop forcing Agg inside Jupyter and the notebook be re-executed (minutes).
NEEDS_REEXECUTION: set[str] = set()


def plotting_cells_without_image(name: str) -> list[int]:
    cells = json.loads((TUTORIALS / f"{name}.ipynb").read_text())["cells"]
    missing = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code" or not any(k in "".join(cell["source"]) for k in PLOTTING):
            continue
        if not any("image/png" in out.get("data", {}) for out in cell.get("outputs", [])):
            missing.append(i)
    return missing


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            p.stem,
            marks=pytest.mark.xfail(strict=True, reason="saved without its figure")
            if p.stem in NEEDS_REEXECUTION
            else (),
        )
        for p in sorted(TUTORIALS.glob("*.ipynb"))
    ],
)
def test_plotting_cells_carry_their_figure(name: str) -> None:
    assert plotting_cells_without_image(name) == []
