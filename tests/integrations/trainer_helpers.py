"""Tiny random models, token datasets and a padding collator for the Trainer integration tests.

Everything is built from configs and seeded generators (no files, no downloads), so that each
training run takes about a second on one CPU thread.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiny_hf_models as hf  # noqa: E402

VOCAB = 64
PAD = 0


def tiny_llama(*, seed: int = 0, tie: bool = True) -> nn.Module:
    """A one-block ``LlamaForCausalLM`` (d = 16), tied embedding / head by default."""
    return hf.llama(vocab=VOCAB, tie=tie, intermediate_size=32, seed=seed, pad_token_id=PAD)


def tiny_gpt2_exact(*, seed: int = 0) -> nn.Module:
    """A one-block ``GPT2LMHeadModel`` whose trainable layers all have exact per-example norms.

    GPT-2's ``Conv1D`` layers get exact per-sample gradients (functorch), its embeddings and
    LayerNorms exact norms; the LM head (the only ``nn.Linear``, whose norm would be sketched)
    is untied and frozen. Dropout is off.
    """
    model = hf.gpt2(
        vocab=VOCAB, tie=False, seed=seed, pad_token_id=PAD, bos_token_id=1, eos_token_id=2
    )
    model.lm_head.weight.requires_grad_(False)
    return model


def token_examples(n: int, *, seed: int = 0, min_len: int = 4, max_len: int = 12) -> list[dict]:
    """``n`` examples ``{"input_ids": [...]}`` of random lengths in ``[min_len, max_len)``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len, (1,), generator=g))
        out.append({"input_ids": torch.randint(1, VOCAB, (length,), generator=g).tolist()})
    return out


def pad_collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right padding; labels = input ids, ``-100`` on padding."""
    t = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), t), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        mask[i, :n] = 1
        labels[i, :n] = ids[i, :n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def training_args(tmp_path: Any, **overrides: Any) -> transformers.TrainingArguments:
    """Quiet CPU ``TrainingArguments`` for the tests (no saving, no reporting, no tqdm)."""
    kw: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 3,
        "max_steps": 4,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "max_grad_norm": 0.0,
        "remove_unused_columns": False,
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_pin_memory": False,
    }
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the trainable parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def snapshot(model: nn.Module) -> nn.Module:
    """A deep copy of the model before training (no hooks are attached yet)."""
    return copy.deepcopy(model)


def recording_trainer() -> type:
    """``DPTrainer`` that records every logical batch the Trainer hands to ``training_step``
    (in ``self.batches``)."""
    from opacus_rc.integrations.transformers import DPTrainer

    class RecordingTrainer(DPTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.batches: list = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.batches.append(inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    return RecordingTrainer
