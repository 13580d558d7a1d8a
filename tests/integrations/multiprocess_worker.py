"""One rank of a 2-process ``torchrun`` launch (CPU, gloo) that trains through ``DPTrainer``.

Run by ``test_dp_trainer_ddp.py``. Each rank trains the runs of :data:`RUNS` (the Trainer maps
the launch to DDP) and writes ``OUT_DIR/rank{RANK}.pt``: for each run, the trained
parameters, the examples per step and micro-batches per step of this rank's share, the noise
multiplier, epsilon, the accountant's history, the world size the Trainer saw, the token counts
logged and the attributes left on the parameters after ``train()``; a run saved
and resumed from a checkpoint beside the same run uninterrupted; and the error
that building a DP trainer with a refused FSDP2 option through the Trainer raised.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_helpers as th  # noqa: E402

from opacus_rc.integrations.transformers import (  # noqa: E402
    DPTrainer,
    LogicalBatch,
    PrivacyArguments,
)

#: Both runs use GPT-2 with exact per-example norms (``th.tiny_gpt2_exact``), so clipping is
#: deterministic; ``per_device_train_batch_size=2`` splits each rank's share into a number of
#: micro-batches that differs between ranks.
SGD = {"optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant", "weight_decay": 0.0}
RUNS: dict[str, dict[str, Any]] = {
    # sigma = 0, clipping active (the examples' norms are 1.9-4.0); the token count logged.
    "clip": {
        "privacy": {
            "noise_multiplier": 0.0,
            "max_grad_norm": 2.6,
            "expected_batch_size": 8,
            "log_non_private_token_counts": True,
        },
        "args": {"max_steps": 3, "per_device_train_batch_size": 2, **SGD},
    },
    # The noise searched for epsilon 4 over 4 steps; a small logical batch, so that a rank's
    # share is empty at some step (a noise-only step on that rank only).
    "budget": {
        "privacy": {"target_epsilon": 4.0, "max_grad_norm": 2.6, "expected_batch_size": 3},
        "args": {"max_steps": 4, "per_device_train_batch_size": 2, **SGD},
    },
}
N = 40
DELTA = 1e-3
SEED = 3


class RecordingTrainer(DPTrainer):
    """Records the examples and micro-batches of every logical batch it trains on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shares: list[tuple[int, int]] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        assert isinstance(inputs, LogicalBatch)
        self.shares.append((inputs.num_examples, len(inputs.micro_batches)))
        return super().training_step(model, inputs, num_items_in_batch)


def train(name: str, out: Path) -> tuple[RecordingTrainer, dict[str, Any]]:
    """One run of :data:`RUNS` (also called in one process by the test)."""
    run = RUNS[name]
    privacy = {"target_delta": DELTA, "seed": SEED, **run["privacy"]}
    trainer = RecordingTrainer(
        model=th.tiny_gpt2_exact(),
        args=th.training_args(out, **run["args"]),
        train_dataset=th.token_examples(N),
        data_collator=th.pad_collate,
        privacy_args=PrivacyArguments(**privacy),
    )
    trainer.train()
    record = {
        "world_size": trainer.args.world_size,
        "params": th.params(trainer.model),
        "shares": trainer.shares,
        "noise_multiplier": float(trainer.dp_optimizer.noise_multiplier),
        "epsilon": trainer.get_epsilon(),
        "history": list(trainer.privacy_engine.accountant.history),
        "ddp_wrapped": type(trainer.model_wrapped).__name__,
        "tokens_logged": [
            h.get("non_private/num_input_tokens_seen") for h in trainer.state.log_history
        ],
        # What a privacy hook left on the model after train() (nothing: the hooks are removed).
        "left_on_params": sorted({a for p in trainer.model.parameters() for a in vars(p)}),
    }
    return trainer, record


def main() -> None:
    warnings.filterwarnings("ignore", message="PrivacyArguments.seed")
    warnings.filterwarnings("ignore", message="PrivacyArguments.sketch_seed")
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    records: dict[str, Any] = {name: train(name, out / f"r{rank}" / name)[1] for name in RUNS}
    records["resume"] = resume(out / "resume")  # one folder for both ranks, as in real use
    records["fsdp"] = fsdp_refusal(out / f"r{rank}" / "fsdp")
    torch.save(records, out / f"rank{rank}.pt")


def resume(out: Path) -> dict[str, Any]:
    """The ``budget`` run with a seeded sketch, saved at step 2 and run to the end, then
    resumed from that checkpoint by a new trainer with ``resume_exact=True`` and by one with
    the default fresh resume (in another output folder, the checkpoint kept): the runs'
    records."""
    run = RUNS["budget"]
    privacy = {"target_delta": DELTA, "seed": SEED, "sketch_seed": 11, **run["privacy"]}
    checkpoint = str(out / "out" / "checkpoint-2")  # training_args: out/out
    records = []
    for folder, start, exact in (
        (out, None, True),
        (out, checkpoint, True),
        (out / "fresh", checkpoint, False),
    ):
        trainer = DPTrainer(
            model=th.tiny_gpt2_exact(),
            args=th.training_args(folder, save_strategy="steps", save_steps=2, **run["args"]),
            train_dataset=th.token_examples(N),
            data_collator=th.pad_collate,
            privacy_args=PrivacyArguments(**privacy, resume_exact=exact),
        )
        trainer.train(resume_from_checkpoint=start)
        records.append(
            {
                "params": th.params(trainer.model),
                "epsilon": trainer.get_epsilon(),
                "history": list(trainer.privacy_engine.accountant.history),
                "sketch_state": trainer.dp_module.sketch_generator.get_state(),
                "sampler_seed": trainer._poisson_sampler.seed,
                "fresh_resumes": list(trainer._private.fresh_resumes),
            }
        )
    return {"uninterrupted": records[0], "resumed": records[1], "fresh": records[2]}


def fsdp_refusal(out: Path) -> dict[str, Any]:
    """The error a DP trainer raises for FSDP2 with FSDP's activation checkpointing through the
    Trainer (FSDP2 runs: test_dp_trainer_fsdp.py; on CPU accelerate itself refuses FSDP
    version 1's plugin)."""
    try:
        args = th.training_args(
            out, fsdp=True, fsdp_config={"fsdp_version": 2, "activation_checkpointing": True}
        )
        DPTrainer(
            model=th.tiny_llama(),
            args=args,
            train_dataset=th.token_examples(N),
            data_collator=th.pad_collate,
            privacy_args=PrivacyArguments(
                target_epsilon=4.0, target_delta=DELTA, expected_batch_size=8
            ),
        )
    except Exception as err:  # recorded and checked by the test
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None, "message": None}


if __name__ == "__main__":
    main()
