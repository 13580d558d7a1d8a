"""Issue 34: ``DPTrainer`` against the plain ``transformers.Trainer`` per optimizer step.

The issue's third floor: on SmolLM2 + LoRA at ``T = 256``, ``DPTrainer`` (randomized clipping,
book-keeping, Hutchinson ``k``) takes at most 1.15x the plain ``Trainer``'s time per optimizer
step **on the same batches**. Both trainers train the same randomly initialised model
(``LlamaForCausalLM`` with SmolLM2-135M's shapes cut to ``layers`` decoder blocks, the tied
embedding frozen) with the same peft LoRA adapters (rank ``lora_rank`` on ``lora_targets``),
SGD, on the same logical batches: the plain trainer's loader draws them with a
:class:`~opacus_rc.integrations.transformers.PoissonLogicalBatchSampler` of the DP trainer's
seed, rate and steps, and the DP trainer's physical batch holds a whole logical batch, so both
run one forward and one backward over the same examples per step. The plain trainer uses the
model's mean next-token loss; the DP trainer its per-sample loss, clip factors, clipped sum and
noise (the step that is measured).

A step is timed from the trainer's ``on_step_begin`` to its ``on_step_end`` callback (wall
clock and the process's CPU time, one torch thread), the first ``warmup`` steps dropped. The
two trainers run one after the other in one process, ``pairs`` times (fresh models each time,
the order swapped every pair); the ratio per pair is the DP trainer's summed step time over
the plain trainer's on the same steps, and the reported ratio is the median over pairs.
The examples per step of the two trainers are compared (``same_batches``).

Run with one thread and ``OMP_WAIT_POLICY=PASSIVE`` on a quiet machine. Results:
``trainer_vs_plain.{csv,md}``.

Examples::

    python -m benchmarks.trainer_vs_plain --quick    # tiny Llama, seconds
    python -m benchmarks.trainer_vs_plain            # SmolLM2 shapes, 4 blocks, minutes
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from benchmarks import common, long_context, models  # noqa: E402

NAME = "trainer_vs_plain"
PROFILES: dict[str, dict[str, Any]] = {
    "full": {
        "model": "smollm2",
        "layers": 4,
        "seq_len": 256,
        "n_examples": 64,
        "expected_batch_size": 4,
        "physical_batch_size": 64,
        "lora_rank": 8,
        "lora_targets": ["q_proj", "v_proj"],
        "sketch_dim": 32,
        "noise_multiplier": 1.0,
        "max_grad_norm": 1.0,
        "lr": 1e-4,
        "steps": 8,
        "warmup": 2,
        "pairs": 2,
        "floor": 1.15,
    },
    "quick": {
        "model": "tiny-llama",
        "layers": 1,
        "seq_len": 16,
        "n_examples": 16,
        "expected_batch_size": 4,
        "physical_batch_size": 16,
        "lora_rank": 2,
        "lora_targets": ["q_proj", "v_proj"],
        "sketch_dim": 4,
        "noise_multiplier": 1.0,
        "max_grad_norm": 1.0,
        "lr": 1e-4,
        "steps": 3,
        "warmup": 1,
        "pairs": 1,
        "floor": 1.15,
    },
}
COLUMNS = [
    "pair",
    "first",
    "dp_steps_s",
    "plain_steps_s",
    "ratio",
    "dp_cpu_s",
    "plain_cpu_s",
    "ratio_cpu",
    "examples_per_step",
    "same_batches",
]


def make_model(cfg: dict[str, Any]) -> torch.nn.Module:
    """The randomly initialised causal LM with LoRA adapters (only they train)."""
    from peft import LoraConfig, get_peft_model

    config = models.causal_lm_config(
        cfg["model"], num_hidden_layers=cfg["layers"], max_position_embeddings=cfg["seq_len"]
    )
    model = models.build_causal_lm(config, seed=0, attn="sdpa")
    lora = LoraConfig(
        r=cfg["lora_rank"],
        lora_alpha=2 * cfg["lora_rank"],
        target_modules=list(cfg["lora_targets"]),
        lora_dropout=0.0,
    )
    return get_peft_model(model, lora)


def make_data(cfg: dict[str, Any], vocab_size: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab_size, (cfg["n_examples"], cfg["seq_len"]), generator=g)
    return [{"input_ids": row} for row in ids]


class Collate:
    """Next-token batches (labels = ids), counting the examples of each batch."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        self.sizes.append(len(rows))
        ids = torch.stack([r["input_ids"] for r in rows])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _stamp() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _callback(times: list[tuple[float, float]]) -> Any:
    import transformers

    class Stamp(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            self.start = _stamp()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            end = _stamp()
            times.append((end[0] - self.start[0], end[1] - self.start[1]))

    return Stamp()


def _training_args(cfg: dict[str, Any], out: Path) -> Any:
    import transformers

    return transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=cfg["physical_batch_size"],
        max_steps=cfg["steps"],
        learning_rate=cfg["lr"],
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=cfg["steps"] + 1,
        save_strategy="no",
        report_to=[],
        max_grad_norm=0.0,
        remove_unused_columns=False,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=0,
    )


def dp_trainer(cfg: dict[str, Any], data: list, out: Path) -> tuple[Any, list, Collate]:
    from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments

    times: list[tuple[float, float]] = []
    collate = Collate()
    privacy = PrivacyArguments(
        noise_multiplier=cfg["noise_multiplier"],
        target_delta=1e-5,
        expected_batch_size=cfg["expected_batch_size"],
        max_grad_norm=cfg["max_grad_norm"],
        sketch_dim=cfg["sketch_dim"],
        seed=0,
        check_batch_independence=False,
    )
    trainer = DPTrainer(
        model=make_model(cfg),
        args=_training_args(cfg, out),
        train_dataset=data,
        data_collator=collate,
        privacy_args=privacy,
        callbacks=[_callback(times)],
    )
    return trainer, times, collate


def plain_trainer(cfg: dict[str, Any], data: list, out: Path, seed: int) -> tuple[Any, list, Any]:
    """``transformers.Trainer`` whose loader draws the DP trainer's Poisson logical batches."""
    import transformers

    from opacus_rc.integrations.transformers import PoissonLogicalBatchSampler

    times: list[tuple[float, float]] = []
    collate = Collate()
    steps_per_epoch = -(-len(data) // cfg["expected_batch_size"])

    class SameBatches(transformers.Trainer):
        def get_train_dataloader(self) -> DataLoader:
            sampler = PoissonLogicalBatchSampler(
                num_samples=len(data),
                sample_rate=1 / steps_per_epoch,
                steps=steps_per_epoch,
                seed=seed,
            )
            return DataLoader(data, batch_sampler=sampler, collate_fn=collate)

    trainer = SameBatches(
        model=make_model(cfg),
        args=_training_args(cfg, out),
        train_dataset=data,
        data_collator=collate,
        callbacks=[_callback(times)],
    )
    return trainer, times, collate


def measure(cfg: dict[str, Any], log: Any = print) -> list[dict[str, Any]]:
    """One row per pair (:data:`COLUMNS`)."""
    common.quiet_warnings()
    vocab = models.causal_lm_config(cfg["model"], num_hidden_layers=1).vocab_size
    data = make_data(cfg, vocab)
    rows = []
    w = cfg["warmup"]
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for pair in range(cfg["pairs"]):
            dp, dp_times, dp_collate = dp_trainer(cfg, data, Path(tmp) / "dp")
            seed = dp._sampler_seed  # the seed its Poisson sampler is built with
            plain, plain_times, plain_collate = plain_trainer(cfg, data, Path(tmp) / "plain", seed)
            order = [("dp", dp), ("plain", plain)]
            if pair % 2:
                order.reverse()
            for _, trainer in order:
                trainer.train()
            dp_s = sum(t for t, _ in dp_times[w:])
            plain_s = sum(t for t, _ in plain_times[w:])
            dp_c = sum(c for _, c in dp_times[w:])
            plain_c = sum(c for _, c in plain_times[w:])
            row = {
                "pair": pair,
                "first": order[0][0],
                "dp_steps_s": dp_s,
                "plain_steps_s": plain_s,
                "ratio": dp_s / plain_s,
                "dp_cpu_s": dp_c,
                "plain_cpu_s": plain_c,
                "ratio_cpu": dp_c / plain_c,
                "examples_per_step": " ".join(str(n) for n in plain_collate.sizes),
                "same_batches": dp_collate.sizes == plain_collate.sizes,
            }
            log(f"[pair {pair}] {row}")
            rows.append(row)
    return rows


def summary_markdown(rows: list[dict], cfg: dict[str, Any], info: dict[str, Any]) -> str:
    ratio = statistics.median(r["ratio"] for r in rows)
    ratio_cpu = statistics.median(r["ratio_cpu"] for r in rows)
    floor = cfg["floor"]
    return "\n".join(
        [
            "# DPTrainer against the plain Trainer per optimizer step (issue 34)",
            "",
            "`python -m benchmarks.trainer_vs_plain` (module docstring: what is measured).",
            f"Model: {cfg['model']} shapes, {cfg['layers']} blocks, LoRA r = {cfg['lora_rank']} "
            f"on {', '.join(cfg['lora_targets'])}; T = {cfg['seq_len']}, expected batch "
            f"{cfg['expected_batch_size']} (Poisson, the same batches for both), "
            f"{cfg['steps']} steps ({cfg['warmup']} warm-up dropped), k = {cfg['sketch_dim']}.",
            "",
            common.markdown_table(rows, COLUMNS),
            "",
            f"**Ratio (median over pairs): {ratio:.3f}x wall time, {ratio_cpu:.3f}x CPU time** "
            f"(floor <= {floor}x: wall {'PASS' if ratio <= floor else 'FAIL'}, CPU "
            f"{'PASS' if ratio_cpu <= floor else 'FAIL'}).",
            "",
            common.machine_markdown(info),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--pairs", type=int, default=None, help="override the pairs")
    args = parser.parse_args(argv)
    cfg = dict(PROFILES["quick" if args.quick else "full"])
    if args.pairs:
        cfg["pairs"] = args.pairs
    out = (
        Path(args.out)
        if args.out
        else (common.QUICK_RESULTS_DIR if args.quick else common.RESULTS_DIR)
    )
    torch.set_num_threads(1)
    info = common.machine_info(torch.device("cpu"))
    info["uptime_load_average_before"] = long_context.load_average()
    t0 = time.perf_counter()
    rows = measure(cfg)
    info["wall_s"] = round(time.perf_counter() - t0)
    info["uptime_load_average_after"] = long_context.load_average()
    out.mkdir(parents=True, exist_ok=True)
    common.write_csv(out / f"{NAME}.csv", rows, COLUMNS)
    common.write_text(out / f"{NAME}.md", summary_markdown(rows, cfg, info))
    print(f"wrote {out / NAME}.csv and .md")
    return 0


__all__ = ["PROFILES", "main", "measure"]

if __name__ == "__main__":
    sys.exit(main())
