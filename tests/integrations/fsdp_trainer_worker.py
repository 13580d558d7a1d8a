"""One rank of a 2-process ``torchrun`` launch (CPU, gloo) that trains through ``DPTrainer``
under FSDP2 (``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2})``).

Run by ``test_dp_trainer_fsdp.py``. Each rank trains the runs of :data:`RUNS` and writes
``OUT_DIR/rank{RANK}.pt``: for each run the trained parameters (gathered full from the
shards), the examples and micro-batches of this rank's share per step, the noise multiplier,
epsilon, the accountant's history, the model's FSDP2 groups; a run checkpointed (sharded
state) and resumed beside the same run uninterrupted; the model ``save_model`` wrote; and a
``DPSFTTrainer`` run.

Each ``TrainingArguments`` starts a fresh accelerate state, so FSDP and single-process trainers
may follow each other in one process.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_helpers as th  # noqa: E402

from opacus_rc.integrations.transformers import (  # noqa: E402
    DPTrainer,
    LogicalBatch,
    PrivacyArguments,
)

N = 40
DELTA = 1e-3
SEED = 3
SGD = {"optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant", "weight_decay": 0.0}
ADAM = {"optim": "adamw_torch", "learning_rate": 1e-2, "lr_scheduler_type": "constant"}
FSDP = {"fsdp": True, "fsdp_config": {"fsdp_version": 2}}
#: The checkpoints' state: sharded (torch.distributed.checkpoint folders).
SHARDED = {
    "fsdp": True,
    "fsdp_config": {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"},
}


def model_for(run: str) -> nn.Module:
    """The tiny Llama of a run (also built in one process by the test).

    ``clip`` and ``budget``: an untied Llama with only the embeddings trainable, whose
    per-example norms are exact, so that clipping is deterministic and the update can equal one
    process's with clipping active. ``full`` (and the resumed run): the issue's model, a tied
    embedding / LM head and every weight trainable, RMSNorms included.
    """
    if run == "lora":  # peft LoRA adapters on q and v of the tied Llama; the base frozen
        import peft

        return peft.get_peft_model(
            th.tiny_llama(tie=True),
            peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
        )
    if run in ("clip", "budget"):
        model = th.tiny_llama(tie=False)
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith("embed_tokens.weight"))
        return model
    model = th.tiny_llama(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.requires_grad for p in model.parameters())
    return model


RUNS: dict[str, dict[str, Any]] = {
    # sigma = 0, clipping active (exact norms; the examples' norms are above C).
    "clip": {
        "privacy": {"noise_multiplier": 0.0, "max_grad_norm": 0.05, "expected_batch_size": 8},
        "args": {"max_steps": 3, "per_device_train_batch_size": 2, **SGD},
    },
    # sigma = 0, a tied Llama with every weight trainable (sketched norms, the tied weight's
    # joint sketch), C above every norm: each clip factor is 1, so the update is the sum of
    # the gradients / the batch size.
    "full": {
        "privacy": {"noise_multiplier": 0.0, "max_grad_norm": 1e6, "expected_batch_size": 8},
        "args": {"max_steps": 3, "per_device_train_batch_size": 2, **SGD, "learning_rate": 0.1},
    },
    # "full" with the Trainer's gradient checkpointing (TRL's default): the same update.
    "ckpt": {
        "privacy": {"noise_multiplier": 0.0, "max_grad_norm": 1e6, "expected_batch_size": 8},
        "args": {
            "max_steps": 3,
            "per_device_train_batch_size": 2,
            **SGD,
            "learning_rate": 0.1,
            "gradient_checkpointing": True,
        },
    },
    # LoRA (peft) on the tied Llama, sigma = 0, C above every norm: the adapters' update.
    "lora": {
        "privacy": {"noise_multiplier": 0.0, "max_grad_norm": 1e6, "expected_batch_size": 8},
        "args": {"max_steps": 3, "per_device_train_batch_size": 2, **SGD, "learning_rate": 0.5},
    },
    # The noise searched for epsilon 4 over 4 steps (exact norms, clipping active); a small
    # logical batch, so that a rank's share is empty at some step (that rank runs filler
    # micro-batches only).
    "budget": {
        "privacy": {"target_epsilon": 4.0, "max_grad_norm": 1.0, "expected_batch_size": 3},
        "args": {"max_steps": 4, "per_device_train_batch_size": 2, **ADAM},
    },
}


class RecordingTrainer(DPTrainer):
    """Records the examples and micro-batches of every logical batch it trains on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shares: list[tuple[int, int]] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        assert isinstance(inputs, LogicalBatch)
        self.shares.append((inputs.num_examples, len(inputs.micro_batches)))
        return super().training_step(model, inputs, num_items_in_batch)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters by name, gathered full (a collective under FSDP2)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().clone()
    return out


def train(name: str, out: Path, *, fsdp: dict | None = None) -> tuple[Any, dict[str, Any]]:
    """One run of :data:`RUNS` (also called in one process by the test, ``fsdp=None``)."""
    run = RUNS[name]
    privacy = {"target_delta": DELTA, "seed": SEED, **run["privacy"]}
    trainer = RecordingTrainer(
        model=model_for(name),
        args=th.training_args(out, **run["args"], **(fsdp or {})),
        train_dataset=th.token_examples(N),
        data_collator=th.pad_collate,
        privacy_args=PrivacyArguments(**privacy),
    )
    trainer.train()
    record = {
        "world_size": trainer.args.world_size,
        "params": full_params(trainer.model),
        "shares": trainer.shares,
        "noise_multiplier": float(trainer.dp_optimizer.noise_multiplier),
        "epsilon": trainer.get_epsilon(),
        "history": list(trainer.privacy_engine.accountant.history),
        "optimizer": type(trainer.dp_optimizer).__name__,
        "sharding": sharding(trainer.model),
        # The last micro-batch's per-example norms (a filler's are 0 under FSDP2).
        "last_norms": trainer.dp_module.per_sample_gradient_norms.detach().clone(),
    }
    return trainer, record


def train_sft(out: Path, *, fsdp: dict | None = None) -> dict[str, Any]:
    """``DPSFTTrainer`` (TRL's ``SFTTrainer``) on the ``full`` run's tied Llama and settings,
    text data tokenized by TRL (also called in one process by the test, ``fsdp=None``)."""
    import test_dp_sft_trainer as sft

    from opacus_rc.integrations.trl import DPSFTTrainer

    run = RUNS["full"]
    trainer = DPSFTTrainer(
        model=model_for("full"),
        args=sft.sft_config(out, **run["args"], **(fsdp or {})),
        train_dataset=sft.text_dataset(N),
        processing_class=sft.tokenizer(),
        privacy_args=PrivacyArguments(target_delta=DELTA, seed=SEED, **run["privacy"]),
    )
    trainer.train()
    return {
        "params": full_params(trainer.model),
        "optimizer": type(trainer.dp_optimizer).__name__,
        "epsilon_history": list(trainer.privacy_engine.accountant.history),
    }


def sharding(model: nn.Module) -> dict[str, Any]:
    """The groups: the root's and which modules are FSDP2 groups of their own; whether every
    trainable parameter is a sharded DTensor."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return {
        "root": isinstance(model, FSDPModule),
        "groups": sorted(n for n, m in model.named_modules() if n and isinstance(m, FSDPModule)),
        "dtensors": all(isinstance(p, DTensor) for p in model.parameters() if p.requires_grad),
    }


def resume(out: Path) -> dict[str, Any]:
    """The ``budget`` run on the tied Llama with every weight trainable (Adam: optimizer state to
    restore) and a seeded sketch, saved at step 2 with sharded state and run to the end, then
    resumed from that checkpoint by a new trainer with ``resume_exact=True``: both runs'
    records, and the checkpoint's files."""
    run = RUNS["budget"]
    privacy = {"target_delta": DELTA, "seed": SEED, "sketch_seed": 11, **run["privacy"]}
    checkpoint = out / "out" / "checkpoint-2"
    records = []
    for start in (None, str(checkpoint)):
        trainer = DPTrainer(
            model=model_for("full"),
            args=th.training_args(
                out, save_strategy="steps", save_steps=2, **run["args"], **SHARDED
            ),
            train_dataset=th.token_examples(N),
            data_collator=th.pad_collate,
            privacy_args=PrivacyArguments(**privacy, resume_exact=True),
        )
        trainer.train(resume_from_checkpoint=start)
        inner = trainer.dp_optimizer.original_optimizer
        records.append(
            {
                "params": full_params(trainer.model),
                "epsilon": trainer.get_epsilon(),
                "history": list(trainer.privacy_engine.accountant.history),
                "adam_steps": sorted(float(s["step"]) for s in inner.state.values() if "step" in s),
            }
        )
    files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())
    return {"uninterrupted": records[0], "resumed": records[1], "files": files}


def saved_model(out: Path, trainer: Any) -> dict[str, Any]:
    """``save_model`` after a sharded run: the folder's full state dict, as a plain model
    loads it (rank 0 writes; every rank gathers)."""
    trainer.save_model(str(out))
    torch.distributed.barrier()
    if int(os.environ["RANK"]) != 0:
        return {}
    import transformers

    plain = transformers.LlamaForCausalLM.from_pretrained(str(out))
    return {"params": {n: p.detach().clone() for n, p in plain.named_parameters()}}


def main() -> None:
    warnings.filterwarnings("ignore", message="PrivacyArguments.seed")
    warnings.filterwarnings("ignore", message="PrivacyArguments.sketch_seed")
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    records: dict[str, Any] = {}
    only = os.environ.get("FSDP_WORKER_RUNS")  # a comma-separated subset, while debugging
    for name in [r for r in only.split(",") if r in RUNS] if only else RUNS:
        trainer, records[name] = train(name, out / f"r{rank}" / name, fsdp=SHARDED)
        if name == "full":
            records["saved"] = saved_model(out / "saved", trainer)
            records["full_after_save"] = full_params(trainer.model)
    if not only or "sft" in only:
        records["sft"] = train_sft(out / f"r{rank}" / "sft", fsdp=SHARDED)
    if not only or "resume" in only:
        records["resume"] = resume(out / "resume")  # one folder for both ranks, as in real use
    torch.save(records, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
