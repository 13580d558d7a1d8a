"""docs/privacy/units.md's first example runs as written on a Hugging Face causal LM (issue 33
item 6): ``.logits``, the README's ``shape=(B, T)``, the empty Poisson batch, and the logged
loss, which the page says is the mean over units of each unit's *sum* of window losses."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiny_hf_models as hf  # noqa: E402

UNITS_MD = Path(__file__).resolve().parents[2] / "docs" / "privacy" / "units.md"


def _first_example() -> str:
    text = UNITS_MD.read_text(encoding="utf-8")
    start = text.index("(units-api)=")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_the_units_page_example_runs_as_written_on_a_hf_model() -> None:
    torch.manual_seed(0)
    n, t, vocab = 12, 6, 11
    ids = torch.randint(0, vocab, (n, t))
    labels = torch.cat([ids[:, 1:], torch.full((n, 1), -100)], dim=1)  # shifted, last ignored
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4])
    model = hf.llama(vocab=vocab, tie=False).train()
    namespace = {
        "nn": nn,
        "windows": TensorDataset(ids, labels),
        "doc_id_of_window": doc,
        "q": 0.6,
        "E": 3,
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "sigma": 1.0,
        "C": 1.0,
    }
    exec(compile(_first_example(), str(UNITS_MD), "exec"), namespace)  # the page's own code
    # The page's claim about the logged loss, on the last (non-empty) batch it computed.
    logits, batch_labels, units = namespace["logits"], namespace["labels"], namespace["units"]
    per_token = nn.functional.cross_entropy(
        logits.detach().reshape(-1, vocab), batch_labels.reshape(-1), reduction="none"
    ).reshape(batch_labels.shape)
    kept = (batch_labels != -100).float()
    per_window = (per_token * kept).sum(1) / kept.sum(1)
    per_unit = torch.zeros(int(units.max()) + 1).index_add_(0, units, per_window)
    assert namespace["loss"].item() == pytest.approx(per_unit.mean().item(), rel=1e-5)
