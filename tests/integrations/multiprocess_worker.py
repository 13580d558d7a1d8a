"""One rank of a 2-process ``torchrun`` launch (CPU, gloo) that builds a ``DPTrainer``.

Run by ``test_dp_trainer.py::test_torchrun_two_processes_is_refused``: each rank records
the world size the Trainer saw and the error ``DPTrainer`` raised (or that none was raised)
in ``OUT_DIR/rank{RANK}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_helpers as th  # noqa: E402

from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    args = th.training_args(out / f"r{rank}")
    record: dict = {"world_size": args.world_size, "error": None, "message": None}
    try:
        DPTrainer(
            model=th.tiny_llama(),
            args=args,
            train_dataset=th.token_examples(40),
            data_collator=th.pad_collate,
            privacy_args=PrivacyArguments(
                target_epsilon=4.0, target_delta=1e-3, expected_batch_size=8
            ),
        )
    except Exception as err:  # recorded and checked by the test
        record["error"], record["message"] = type(err).__name__, str(err)
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
