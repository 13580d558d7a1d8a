"""One rank of a 2-process ``torchrun`` launch (CPU, gloo): ``DPTrainer`` with a
:class:`~opacus_rc.packing.PackingCollator` under DDP (issue 32). Run by
``test_dp_trainer_packing_ddp.py``.

Each rank trains the runs of :data:`RUNS` and writes ``OUT_DIR/rank{RANK}.pt``: for each run,
the trained parameters, this rank's records and packed micro-batches of every step, the
divisor, the noise multiplier, epsilon, the accountant's history and the world size.
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
from opacus_rc.packing import PackingCollator  # noqa: E402

SGD = {"optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant", "weight_decay": 0.0}
#: ``clip``: GPT-2 with exact per-record norms (learned positions; clipping deterministic), so
#: one process and two give the same weights. ``budget``: tiny Llama (tied embedding / LM head,
#: RMSNorm, sketched norms: the packed-row paths) at a target epsilon.
RUNS: dict[str, dict[str, Any]] = {
    "clip": {
        "model": "gpt2",
        "privacy": {"noise_multiplier": 0.0, "target_epsilon": None, "max_grad_norm": 2.6},
        "args": {"max_steps": 3, "per_device_train_batch_size": 2, **SGD},
    },
    "budget": {
        "model": "llama",
        "privacy": {"target_epsilon": 4.0},
        "args": {"max_steps": 3, "per_device_train_batch_size": 2, **SGD},
    },
}
N = 40
DELTA = 1e-3
SEED = 1


class PackedRecordingTrainer(DPTrainer):
    """Records each logical batch's records and packed micro-batches (this rank's share)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shares: list[list[list[int]]] = []
        self.rows: list[list[tuple[int, int]]] = []

    def training_step(self, model, inputs, num_items_in_batch=None):  # noqa: ANN001
        assert isinstance(inputs, LogicalBatch)
        self.shares.append([list(ex["input_ids"]) for exs in inputs.micro_examples for ex in exs])
        self.rows.append([tuple(m["input_ids"].shape) for m in inputs.micro_batches])
        return super().training_step(model, inputs, num_items_in_batch)


def train(name: str, out: Path) -> dict[str, Any]:
    """One run of :data:`RUNS` (also called in one process by the test)."""
    run = RUNS[name]
    privacy = {"target_delta": DELTA, "seed": SEED, "expected_batch_size": 8, **run["privacy"]}
    model = th.tiny_gpt2_exact() if run["model"] == "gpt2" else th.tiny_llama()
    trainer = PackedRecordingTrainer(
        model=model,
        args=th.training_args(out, **run["args"]),
        train_dataset=th.token_examples(N),
        data_collator=PackingCollator(max_length=16, pad_token_id=th.PAD),
        privacy_args=PrivacyArguments(**privacy),
    )
    trainer.train()
    return {
        "world_size": trainer.args.world_size,
        "params": th.params(trainer.model),
        "shares": trainer.shares,
        "rows": trainer.rows,
        "expected_batch_size": float(trainer.dp_optimizer.expected_batch_size),
        "noise_multiplier": float(trainer.dp_optimizer.noise_multiplier),
        "epsilon": trainer.get_epsilon(),
        "history": list(trainer.privacy_engine.accountant.history),
    }


def main() -> None:
    warnings.filterwarnings("ignore", message="PrivacyArguments.seed")
    warnings.filterwarnings("ignore", message="epsilon cannot be computed")
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    records = {name: train(name, out / f"r{rank}" / name) for name in RUNS}
    torch.save(records, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
