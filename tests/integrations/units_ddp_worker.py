"""One rank of a 2-process ``torchrun`` launch (CPU, gloo): ``DPTrainer`` with
``PrivacyArguments.privacy_unit`` under DDP. Run by ``test_dp_trainer_units_ddp.py``.

Each rank trains the runs of :data:`RUNS` and writes ``OUT_DIR/rank{RANK}.pt``: for each run,
the trained parameters, the documents of this rank's share of every step, the divisor, the
noise multiplier, epsilon, the accountant's history and the world size the Trainer saw.
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

from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments  # noqa: E402

SGD = {"optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant", "weight_decay": 0.0}
#: GPT-2 with exact per-unit norms (``th.tiny_gpt2_exact``): clipping is deterministic, so one
#: process and two give the same weights.
RUNS: dict[str, dict[str, Any]] = {
    # sigma = 0, clipping active (some units' norms above C, some below).
    "clip": {
        "privacy": {"noise_multiplier": 0.0, "max_grad_norm": 4.0},
        "args": {"max_steps": 3, "per_device_train_batch_size": 4, **SGD},
    },
    # sigma = 1: the noise is added once (rank 0), so the weights are the single process' too.
    "noise": {
        "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 4.0},
        "args": {"max_steps": 2, "per_device_train_batch_size": 4, **SGD},
    },
}
SIZES = [1, 3, 2, 1, 3, 2, 1, 2, 3, 1, 2, 3]  # U = 12 documents of 1-3 rows
DELTA = 1e-3
SEED = 3


def unit_rows(sizes: list[int], *, seed: int = 0) -> list[dict]:
    """Rows of ``len(sizes)`` documents (``"doc-u"``), interleaved (the trainer groups them)."""
    rows = th.token_examples(sum(sizes), seed=seed)
    docs = [f"doc-{u}" for u, s in enumerate(sizes) for _ in range(s)]
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    return [{**rows[i], "doc": docs[i]} for i in order]


def train(name: str, out: Path) -> dict[str, Any]:
    """One run of :data:`RUNS` (also called in one process by the test)."""
    run = RUNS[name]
    data = unit_rows(SIZES)
    privacy = {
        "target_delta": DELTA, "seed": SEED, "privacy_unit": "doc", "expected_batch_size": 4,
        **run["privacy"],
    }  # fmt: skip
    trainer = DPTrainer(
        model=th.tiny_gpt2_exact(),
        args=th.training_args(out, **run["args"]),
        train_dataset=data,
        data_collator=th.pad_collate,
        privacy_args=PrivacyArguments(**privacy),
    )
    trainer.train()
    sampler = trainer._poisson_sampler
    sampler.set_epoch(0)  # replay the epoch's batches (seeded per epoch)
    steps = run["args"]["max_steps"]
    shares = [sorted({data[i]["doc"] for i in batch}) for batch in list(sampler)[:steps]]
    return {
        "world_size": trainer.args.world_size,
        "params": th.params(trainer.model),
        "shares": shares,
        "unit_index": {d: u for u, d in enumerate(dict.fromkeys(r["doc"] for r in data))},
        "expected_batch_size": float(trainer.dp_optimizer.expected_batch_size),
        "noise_multiplier": float(trainer.dp_optimizer.noise_multiplier),
        "epsilon": trainer.get_epsilon(),
        "history": list(trainer.privacy_engine.accountant.history),
    }


def main() -> None:
    warnings.filterwarnings("ignore", message="PrivacyArguments.seed")
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    records = {name: train(name, out / f"r{rank}" / name) for name in RUNS}
    torch.save(records, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
