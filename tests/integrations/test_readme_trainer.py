"""The README's "With the Hugging Face Trainer" section: its code block runs as written.

The block is executed with a tiny random Llama, 40 token examples and a word-level tokenizer
built in memory for ``model``, ``train_set``, ``test_set`` and ``tokenizer`` (everything else is
the README's own code, in a temporary working folder). Checked: epsilon is what the README
says (at most the target, within the search's 0.01), evaluation gives a finite loss, the saved
model is the plain model, and the checkpoint / resume recipe the section describes ends at
exactly the uninterrupted run's epsilon and accountant history.
"""

from __future__ import annotations

import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_helpers as th  # noqa: E402

from opacus_rc.integrations.transformers import PRIVACY_STATE_NAME, DPTrainer  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_section() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## With the Hugging Face Trainer\n")
    return text[start : text.index("\n## ", start + 1)]


def word_tokenizer() -> Any:
    """A 64-token word-level tokenizer (``t0`` is padding), matching ``th.VOCAB``."""
    vocab = {f"t{i}": i for i in range(th.VOCAB)}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token=f"t{th.PAD}", unk_token="t1"
    )


def test_readme_trainer_snippet_runs_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    section = readme_section()
    [snippet] = re.findall(r"```python\n(.*?)```", section, re.S)
    # The snippet is for a real run: it must not run on the CPU by accident or silently.
    assert "use_cpu" not in snippet and "seed=" not in snippet
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {
        "model": th.tiny_llama(),
        "train_set": th.token_examples(40),
        "test_set": th.token_examples(6, seed=9),
        "tokenizer": word_tokenizer(),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(snippet, str(README), "exec"), namespace)  # the README's own code
    trainer = namespace["trainer"]
    printed = capsys.readouterr().out.strip().splitlines()
    epsilon, eval_loss = float(printed[-2]), float(printed[-1])
    # N = 40, expected batch 16: q = 1 / 3, 3 steps per epoch, 2 epochs.
    assert len(trainer.privacy_engine.accountant) == 6 == trainer.state.global_step
    assert 7.99 <= epsilon <= 8.0 and epsilon == trainer.get_epsilon()
    assert math.isfinite(eval_loss)
    loaded = transformers.LlamaForCausalLM.from_pretrained("out/final")
    mine = trainer.model.state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in loaded.state_dict().items())

    # The resume recipe: a new trainer with the same arguments, from the first epoch's checkpoint.
    checkpoint = tmp_path / "out" / "checkpoint-3"
    assert (checkpoint / PRIVACY_STATE_NAME).is_file()
    resumed = DPTrainer(
        model=th.tiny_llama(),
        args=namespace["args"],
        train_dataset=namespace["train_set"],
        eval_dataset=namespace["test_set"],
        data_collator=trainer.data_collator,
        privacy_args=namespace["privacy"],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.privacy_engine.accountant.history == trainer.privacy_engine.accountant.history
    assert resumed.get_epsilon() == epsilon
    assert resumed.state.global_step == 6
    # (Weights equal to the uninterrupted run's need a seeded sketch: test_dp_trainer.py.)
