"""Issue 32: padded vs packed vs padding-free DP SFT on ragged records, and the utility check.

**Data.** Real passages of the vendored Brown corpus (``tutorials/data/brown.jsonl.gz``, the
tutorials' data), byte-level token ids: ``n_train`` training records and ``n_heldout`` held-out
ones (from the other end of the corpus), each the next ``L`` tokens of the corpus stream from
a paragraph start, with ``L`` log-uniform in ``[min_len, max_length]`` (16..1024 in the full
profile: many short records, a few long ones).

**Methods**, the same model (a small Llama causal LM from a config), the same optimizer, the
same Poisson logical batches (one sampler seed: the same records every step, ``expected_batch
_size`` records per logical batch on average), micro-batches of at most ``physical_rows`` rows:

* ``padded``: ``DPTrainer`` with a padding collator (each record a row, padded to the longest
  of its micro-batch, ``physical_rows`` records a micro-batch), ``transformers``' SDPA with the
  2D padding mask (a ``(B, 1, T, T)`` mask: every row pays ``T^2``): what a user runs today;
* ``padded_varlen``: the same padded micro-batches through the varlen SDPA of
  :mod:`opacus_rc.packed_attention` (each row's real tokens attended causally
  alone, ``L_r^2``): the same attention kernel as the packed methods, so that
  ``packed / padded_varlen`` is what packing saves outside the attention (the padding in the
  token-wise layers, the LM head and the per-record norms);
* ``packed``: ``DPTrainer`` with :class:`opacus_rc.packing.PackingCollator` (each logical
  batch's records packed into rows of ``max_length`` tokens, per-record clipping through the
  criterion's ``record_ids=``). With ``--attention varlen`` (the default) the model runs the
  varlen SDPA over the records (no 4D mask: the records come from the restarting
  ``position_ids``; a row of records costs ``sum_r L_r^2``); with ``--attention sdpa`` the
  block-diagonal 4D mask and SDPA (a row costs all ``T^2`` pairs, most masked);
* ``padding_free``: the same packed rows without a mask (restarting ``position_ids``): with
  ``--attention varlen`` the same inputs as ``packed`` (a second measurement of it); with
  ``sdpa``, ``transformers`` builds the block mask from the positions;
* ``nonprivate_packed``: a plain ``transformers.Trainer`` on the same packed micro-batches of
  the same logical batches, with the same attention as ``packed`` (mean token loss, no
  clipping, no noise): the per-step baseline.

The DP methods share ``target_epsilon``, delta and the schedule, so the same noise multiplier
(checked: their epsilons are equal). **Timing**: the methods are interleaved in one process, in
``rounds`` rounds (a fresh trainer per method and round, the order rotated each round); a step
is timed from one ``on_step_end`` to the next (fetching and packing the logical batch, every
micro-batch's forward and backward, the noise, the optimizer step), the first ``warmup`` steps
dropped. Every method trains the same tokens per step, so tokens per second are
``tokens / step time``; the ratios are per round, reported as the median over rounds (the
machine is shared: ``uptime`` before and after is written with the results). **Peak memory**:
one extra step of each method under :class:`benchmarks.common.LiveTensorBytes` (the bytes of
tensors created during the step still alive at its peak; model and optimizer states created
before it excluded), not timed.

**Utility**: ``utility_steps`` steps of ``padded`` and ``packed`` at the same epsilon, for two
seeds each (same seed: the same records and noise), then the held-out loss (each held-out
record's mean next-token loss alone, averaged over records). Same seed, packed vs padded,
differs only by the sketch's draws; the two seeds show the run-to-run spread.

The issue's floor: ``packed`` >= 2x the tokens per second of ``padded`` at the same epsilon and
held-out loss, and within 1.10x the step time of ``nonprivate_packed``.

Run with one OpenMP thread that does not spin::

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python -m benchmarks.packing_throughput --quick
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python -m benchmarks.packing_throughput  # minutes

Results: ``benchmarks/results/packing_throughput.{csv,md}`` (``--quick``: a temporary folder).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import common

NAME = "packing_throughput"
METHODS = ("padded", "padded_varlen", "packed", "padding_free", "nonprivate_packed")
DP_METHODS = ("padded", "padded_varlen", "packed", "padding_free")
#: The methods that run the varlen SDPA under ``--attention varlen`` (the default); under
#: ``sdpa`` only ``padded_varlen`` does.
VARLEN_METHODS = ("padded_varlen", "packed", "padding_free", "nonprivate_packed")
ATTENTIONS = ("varlen", "sdpa")

PROFILES: dict[str, dict[str, Any]] = {
    "full": {
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 688,
        "vocab_size": 257,
        "max_length": 1024,
        "min_len": 16,
        "n_train": 2000,
        "n_heldout": 32,
        "expected_batch_size": 16,
        "physical_rows": 4,
        "epsilon": 8.0,
        "delta": 1e-5,
        "max_grad_norm": 1.0,
        "sketch_dim": 32,
        "learning_rate": 2e-3,
        "rounds": 3,
        "warmup": 1,
        "steps": 4,
        "utility_steps": 30,
        "utility_seeds": 2,
        "threads": 1,
    },
    "quick": {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 64,
        "vocab_size": 257,
        "max_length": 128,
        "min_len": 8,
        "n_train": 200,
        "n_heldout": 8,
        "expected_batch_size": 8,
        "physical_rows": 2,
        "epsilon": 8.0,
        "delta": 1e-3,
        "max_grad_norm": 1.0,
        "sketch_dim": 8,
        "learning_rate": 2e-3,
        "rounds": 1,
        "warmup": 1,
        "steps": 2,
        "utility_steps": 2,
        "utility_seeds": 1,
        "threads": 1,
    },
}

# Timing-only profiles: the full profile at other widths.
PROFILES["wide"] = {
    # Twice the width: a smaller share of attention (T^2 per packed row under --attention sdpa).
    **PROFILES["full"],
    "hidden_size": 512,
    "num_attention_heads": 8,
    "intermediate_size": 1376,
    "rounds": 2,
    "utility_steps": 0,
    "utility_seeds": 0,
}
PROFILES["smollm2"] = {
    # SmolLM2-135M's decoder block (d = 576, MLP 1536, 9 heads, 3 key/value heads; issue 34's
    # step_overhead model) at 4 blocks, byte-level vocabulary: the width of a small model that
    # people fine-tune, where the sketch's k (p + d) per token is a smaller share of 3 p d.
    **PROFILES["wide"],
    "hidden_size": 576,
    "num_hidden_layers": 4,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
}

COLUMNS = [
    "round",
    "method",
    "steps",
    "step_median_s",
    "steps_sum_s",
    "cpu_sum_s",
    "tokens",
    "tokens_per_s",
    "micro_batches",
    "epsilon",
]

PAD = 0
SEED = 7
BROWN = common.REPO_ROOT / "tutorials" / "data" / "brown.jsonl.gz"


# ----------------------------------------------------------------------------------------------
# Data and model
# ----------------------------------------------------------------------------------------------


def _stream(vocab: int) -> tuple[list[int], list[int]]:
    """The Brown corpus as one byte-level token stream, and the paragraph starts in it."""
    with gzip.open(BROWN, "rt", encoding="utf-8") as fh:
        texts = [json.loads(line)["text"] for line in fh]
    tokens: list[int] = []
    starts: list[int] = []
    for text in texts:
        for para in text.split("\n\n"):
            if para.strip():
                starts.append(len(tokens))
                tokens += [1 + b % (vocab - 1) for b in (para + "\n\n").encode("utf-8")]
    return tokens, starts


def make_records(cfg: dict) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)`` records ``{"input_ids": [...]}`` of log-uniform lengths in
    ``[min_len, max_length]``, each starting at a paragraph; held-out ones from the corpus'
    other end."""
    tokens, starts = _stream(cfg["vocab_size"])
    g = torch.Generator().manual_seed(SEED)
    lo, hi = math.log(cfg["min_len"]), math.log(cfg["max_length"])

    def draw(n: int, para: int, step: int) -> list[dict]:
        out = []
        while len(out) < n:
            length = int(math.exp(lo + (hi - lo) * float(torch.rand((), generator=g))))
            s = starts[para]
            if s + length <= len(tokens):
                out.append({"input_ids": tokens[s : s + length]})
            para += step
        return out

    return draw(cfg["n_train"], 0, 1), draw(cfg["n_heldout"], len(starts) - 1, -1)


def make_model(cfg: dict, *, varlen: bool = False) -> Any:
    """The Llama of ``cfg``, with SDPA or (``varlen``) the varlen SDPA over records."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        max_position_embeddings=cfg["max_length"],
        pad_token_id=PAD,
        use_cache=False,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config).train()
    if varlen:
        from opacus_rc.packed_attention import register_packed_sdpa

        model.set_attn_implementation(register_packed_sdpa())
    return model


def pad_collate(rows: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Right padding to the longest record; labels ``-100`` at padding."""
    t = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), t), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def heldout_loss(model: Any, records: Sequence[dict]) -> float:
    """Each record's mean next-token loss alone, averaged over records."""
    model.eval()
    losses = []
    with torch.no_grad():
        for r in records:
            ids = torch.tensor(r["input_ids"]).unsqueeze(0)
            logits = model(input_ids=ids).logits[0, :-1].float()
            losses.append(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))
    model.train()
    return statistics.fmean(losses)


# ----------------------------------------------------------------------------------------------
# Trainers
# ----------------------------------------------------------------------------------------------


def _callback(times: list[float], cpu: list[float]) -> Any:
    import transformers

    class StepTimer(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.last = (time.perf_counter(), time.process_time())

        def on_train_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            self.last = (time.perf_counter(), time.process_time())

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            now = (time.perf_counter(), time.process_time())
            times.append(now[0] - self.last[0])
            cpu.append(now[1] - self.last[1])
            self.last = now

    return StepTimer()


def _counting(base: type) -> type:
    """``base`` with each logical batch's token count and micro-batch count recorded."""

    class Counting(base):  # type: ignore[misc, valid-type]
        def training_step(self, model, inputs, num_items_in_batch=None):  # noqa: ANN001
            tokens = 0
            for micro in inputs.micro_batches:
                if "record_ids" in micro:
                    tokens += int((micro["record_ids"] >= 0).sum())
                else:
                    tokens += int(micro["attention_mask"].sum())
            self.bench_tokens.append(tokens)
            self.bench_micro.append(len(inputs.micro_batches))
            if self.bench_memory is not None:
                with common.LiveTensorBytes() as mem:
                    out = super().training_step(model, inputs, num_items_in_batch)
                self.bench_memory.append(mem.peak)
                return out
            return super().training_step(model, inputs, num_items_in_batch)

    return Counting


def _nonprivate_trainer() -> type:
    """A plain ``transformers.Trainer`` over the DP trainer's Poisson logical batches, packed:
    each micro-batch's mean token loss, weighted by its share of the batch's targets."""
    import transformers

    from opacus_rc.integrations.logical_batches import LogicalBatchLoader

    class NonPrivatePacked(transformers.Trainer):
        def __init__(self, *args: Any, loader_parts: tuple, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.loader_parts = loader_parts

        def get_train_dataloader(self) -> Any:
            dataset, sampler, collate = self.loader_parts
            return LogicalBatchLoader(dataset, batch_sampler=sampler, collate_fn=collate)

        def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
            return None

        def training_step(self, model, inputs, num_items_in_batch=None):  # noqa: ANN001
            model.train()
            counts = [int((m["labels"][:, 1:] != -100).sum()) for m in inputs.micro_batches]
            total = max(sum(counts), 1)
            loss_sum = torch.zeros(())
            for micro, n in zip(inputs.micro_batches, counts):
                micro = {k: v for k, v in micro.items() if k not in ("record_ids", "record_units")}
                loss = model(**micro).loss * (n / total)
                loss.backward()
                loss_sum += loss.detach()
            return loss_sum

    return NonPrivatePacked


def run_method(
    cfg: dict,
    method: str,
    train: list[dict],
    out: Path,
    *,
    steps: int,
    seed: int = SEED,
    memory: bool = False,
    attention: str = "varlen",
) -> dict:
    """Train ``method`` for ``steps`` steps; its step times, tokens, epsilon and model."""
    import transformers

    from opacus_rc.integrations.packed_batches import PackedLogicalBatchCollator
    from opacus_rc.integrations.private_run import run_seeds
    from opacus_rc.integrations.train_data import trainer_schedule
    from opacus_rc.integrations.transformers import (
        DPTrainer,
        PoissonLogicalBatchSampler,
        PrivacyArguments,
    )
    from opacus_rc.packing import PackingCollator

    times: list[float] = []
    cpu: list[float] = []
    args = transformers.TrainingArguments(
        output_dir=str(out / f"_{NAME}_runs"),
        per_device_train_batch_size=cfg["physical_rows"],
        max_steps=steps,
        learning_rate=cfg["learning_rate"],
        lr_scheduler_type="constant",
        logging_steps=10**6,
        save_strategy="no",
        report_to=[],
        max_grad_norm=0.0,
        remove_unused_columns=False,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=seed,
    )
    varlen = method == "padded_varlen" or (attention == "varlen" and method in VARLEN_METHODS)
    model = make_model(cfg, varlen=varlen)
    packing = PackingCollator(
        max_length=cfg["max_length"],
        pad_token_id=PAD,
        # The varlen attention takes no 4D mask: the records come from the position ids.
        padding_free=method == "padding_free" or varlen,
        mask_dtype=torch.bool,
    )
    if method == "nonprivate_packed":
        schedule = trainer_schedule(len(train), expected_batch_size=cfg["expected_batch_size"])
        sampler = PoissonLogicalBatchSampler(
            num_samples=len(train),
            sample_rate=schedule.sizes.sample_rate,
            steps=schedule.sizes.steps_per_epoch,
            seed=run_seeds(seed, world_size=1)[0],  # the DP trainers' sampler seed
        )
        collate = PackedLogicalBatchCollator(
            packing=packing, max_physical_batch_size=cfg["physical_rows"]
        )
        cls = _counting(_nonprivate_trainer())
        trainer = cls(
            model=model,
            args=args,
            train_dataset=train,
            loader_parts=(train, sampler, collate),
            callbacks=[_callback(times, cpu)],
        )
    else:
        privacy = PrivacyArguments(
            target_epsilon=cfg["epsilon"],
            target_delta=cfg["delta"],
            expected_batch_size=cfg["expected_batch_size"],
            max_grad_norm=cfg["max_grad_norm"],
            sketch_dim=cfg["sketch_dim"],
            seed=seed,
            check_batch_independence=False,  # checked in the tests; not part of a step
        )
        trainer = _counting(DPTrainer)(
            model=model,
            args=args,
            train_dataset=train,
            data_collator=pad_collate if method.startswith("padded") else packing,
            privacy_args=privacy,
            callbacks=[_callback(times, cpu)],
        )
    trainer.bench_tokens, trainer.bench_micro = [], []
    trainer.bench_memory = [] if memory else None
    trainer.train()
    eps = trainer.get_epsilon() if method in DP_METHODS else math.nan
    return {
        "times": times,
        "cpu": cpu,
        "tokens": trainer.bench_tokens,
        "micro": trainer.bench_micro,
        "memory": trainer.bench_memory,
        "epsilon": eps,
        "sigma": trainer.dp_optimizer.noise_multiplier if method in DP_METHODS else None,
        "model": trainer.model,
    }


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages, as ``uptime`` prints them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI size, seconds")
    p.add_argument(
        "--profile", choices=sorted(PROFILES), default=None, help="settings (default: full)"
    )
    p.add_argument("--out", type=Path, default=None, help="results folder")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    p.add_argument("--utility-steps", type=int, default=None, help="steps of the utility runs")
    p.add_argument(
        "--utility-seeds", type=int, default=None, help="seeds of the utility runs (7, 8, ...)"
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per method and round")
    p.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default="varlen",
        help="attention of packed, padding_free and nonprivate_packed (default varlen: SDPA "
        "on each record; sdpa: the block-diagonal mask); padded is SDPA, padded_varlen varlen",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = arg_parser().parse_args(argv)
    name = "quick" if args.quick else (args.profile or "full")
    cfg = dict(PROFILES[name], profile=name)
    stem = NAME if name in ("full", "quick") else f"{NAME}_{name}"
    if args.rounds:
        cfg["rounds"] = args.rounds
    if args.utility_steps is not None:
        cfg["utility_steps"] = args.utility_steps
    if args.utility_seeds is not None:
        cfg["utility_seeds"] = args.utility_seeds
    if args.steps:
        cfg["steps"] = args.steps
    cfg["attention"] = args.attention
    torch.set_num_threads(args.threads or cfg["threads"])
    out = args.out or (common.QUICK_RESULTS_DIR if args.quick else common.RESULTS_DIR)
    out.mkdir(parents=True, exist_ok=True)
    common.quiet_warnings()
    warnings.filterwarnings("ignore", message="PrivacyArguments.seed")
    import transformers

    transformers.logging.set_verbosity_error()
    info = common.machine_info(torch.device("cpu"))
    info["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "unset")
    info["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "unset")
    info["uptime_load_average_before"] = load_average()
    t0 = time.perf_counter()
    train, heldout = make_records(cfg)
    lengths = [len(r["input_ids"]) for r in train]
    w, n = cfg["warmup"], cfg["warmup"] + cfg["steps"]

    rows: list[dict] = []
    per_round: list[dict[str, dict]] = []
    for rnd in range(cfg["rounds"]):
        order = METHODS[rnd % len(METHODS) :] + METHODS[: rnd % len(METHODS)]
        results = {}
        for method in order:
            r = run_method(cfg, method, train, out, steps=n, attention=cfg["attention"])
            results[method] = r
            tok = sum(r["tokens"][w:])
            rows.append(
                {
                    "round": rnd,
                    "method": method,
                    "steps": len(r["times"][w:]),
                    "step_median_s": statistics.median(r["times"][w:]),
                    "steps_sum_s": sum(r["times"][w:]),
                    "cpu_sum_s": sum(r["cpu"][w:]),
                    "tokens": tok,
                    "tokens_per_s": tok / sum(r["times"][w:]),
                    "micro_batches": sum(r["micro"][w:]),
                    "epsilon": r["epsilon"],
                }
            )
            print(
                f"round {rnd} {method:18s} {rows[-1]['step_median_s']:.3f} s/step "
                f"{rows[-1]['tokens_per_s']:.0f} tokens/s",
                flush=True,
            )
        tokens = {m: results[m]["tokens"] for m in METHODS}
        if len({tuple(t) for t in tokens.values()}) != 1:
            raise RuntimeError(f"the methods trained different tokens per step: {tokens}")
        eps = {m: results[m]["epsilon"] for m in DP_METHODS}
        if len(set(eps.values())) != 1:
            raise RuntimeError(f"the DP methods' epsilons differ: {eps}")
        per_round.append(results)

    def ratio(a: str, b: str, key: str = "steps_sum_s") -> float:
        vals = []
        for rnd in range(cfg["rounds"]):
            ra = next(r for r in rows if r["round"] == rnd and r["method"] == a)
            rb = next(r for r in rows if r["round"] == rnd and r["method"] == b)
            vals.append(ra[key] / rb[key])
        return statistics.median(vals)

    summary = {
        "packed_over_padded_tokens_per_s": 1 / ratio("packed", "padded"),
        "padding_free_over_padded_tokens_per_s": 1 / ratio("padding_free", "padded"),
        "packed_over_nonprivate_step": ratio("packed", "nonprivate_packed"),
        "padding_free_over_nonprivate_step": ratio("padding_free", "nonprivate_packed"),
        "packed_over_padded_cpu": 1 / ratio("packed", "padded", "cpu_sum_s"),
        "packed_over_nonprivate_cpu": ratio("packed", "nonprivate_packed", "cpu_sum_s"),
        "padding_free_over_padded_cpu": 1 / ratio("padding_free", "padded", "cpu_sum_s"),
        "padding_free_over_nonprivate_cpu": ratio("padding_free", "nonprivate_packed", "cpu_sum_s"),
        "packed_over_padded_varlen_tokens_per_s": 1 / ratio("packed", "padded_varlen"),
        "packed_over_padded_varlen_cpu": 1 / ratio("packed", "padded_varlen", "cpu_sum_s"),
        "padded_varlen_over_padded_cpu": 1 / ratio("padded_varlen", "padded", "cpu_sum_s"),
        "epsilon": per_round[0]["packed"]["epsilon"],
        "sigma": per_round[0]["packed"]["sigma"],
    }

    memory = {}
    for method in METHODS:
        r = run_method(cfg, method, train, out, steps=1, memory=True, attention=cfg["attention"])
        memory[method] = max(r["memory"])
        print(f"peak memory {method:18s} {common.fmt_bytes(memory[method])}", flush=True)

    utility = []
    for s in range(cfg["utility_seeds"] if cfg["utility_steps"] > 0 else 0):
        for method in ("padded", "packed"):
            r = run_method(
                cfg,
                method,
                train,
                out,
                steps=cfg["utility_steps"],
                seed=SEED + s,
                attention=cfg["attention"],
            )
            utility.append(
                {
                    "seed": SEED + s,
                    "method": method,
                    "heldout_loss": heldout_loss(r["model"], heldout),
                    "epsilon": r["epsilon"],
                    "steps": cfg["utility_steps"],
                }
            )
            print(
                f"utility seed {SEED + s} {method}: {utility[-1]['heldout_loss']:.4f}", flush=True
            )
    initial = heldout_loss(make_model(cfg), heldout)

    info["wall_s"] = round(time.perf_counter() - t0)
    info["uptime_load_average_after"] = load_average()
    write_report(out, stem, cfg, rows, summary, memory, utility, initial, lengths, info)
    print(
        f"packed / padded tokens per second: {summary['packed_over_padded_tokens_per_s']:.2f}x "
        f"wall, {summary['packed_over_padded_cpu']:.2f}x CPU; packed / padded_varlen: "
        f"{summary['packed_over_padded_varlen_tokens_per_s']:.2f}x wall, "
        f"{summary['packed_over_padded_varlen_cpu']:.2f}x CPU; packed DP / packed non-private "
        f"per step: {summary['packed_over_nonprivate_step']:.3f}x wall, "
        f"{summary['packed_over_nonprivate_cpu']:.3f}x CPU"
    )
    print(f"wrote {out / (stem + '.md')} in {info['wall_s']} s")
    return 0


def write_report(
    out: Path,
    stem: str,
    cfg: dict,
    rows: list[dict],
    summary: dict,
    memory: dict,
    utility: list[dict],
    initial: float,
    lengths: list[int],
    info: dict,
) -> None:
    common.write_csv(out / f"{stem}.csv", rows, COLUMNS)
    q = sorted(lengths)
    quant = ", ".join(
        f"{p}%: {q[min(len(q) - 1, int(p / 100 * len(q)))]}" for p in (10, 50, 90, 99)
    )
    attention = (
        "the varlen SDPA over records (opacus_rc.packed_attention)"
        if cfg["attention"] == "varlen"
        else "SDPA with the block-diagonal 4D mask (padding_free: built from the positions)"
    )
    mem_rows = [{"method": m, "peak_step_bytes": memory[m], "peak": common.fmt_bytes(memory[m])}
                for m in METHODS]  # fmt: skip
    lines = [
        f"# Padded vs packed vs padding-free DP SFT ({cfg['profile']} profile)",
        "",
        "`OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python -m benchmarks.packing_throughput"
        f"{'' if stem == NAME else ' --profile ' + cfg['profile']}"
        f"{'' if cfg['attention'] == 'varlen' else ' --attention ' + cfg['attention']}` "
        "(module docstring: what is measured and how).",
        f"Model: Llama causal LM, d = {cfg['hidden_size']}, {cfg['num_hidden_layers']} blocks, "
        f"byte-level vocab {cfg['vocab_size']} (tied). Attention: padded SDPA (2D padding "
        f"mask), padded_varlen the varlen SDPA, packed, padding_free and nonprivate_packed "
        f"{attention}. Records: {len(lengths)} Brown "
        f"passages, lengths log-uniform in [{cfg['min_len']}, {cfg['max_length']}] (mean "
        f"{statistics.fmean(lengths):.0f}; quantiles {quant}); rows of {cfg['max_length']} "
        f"tokens; expected {cfg['expected_batch_size']} records per logical batch, at most "
        f"{cfg['physical_rows']} rows per micro-batch; Hutchinson k = {cfg['sketch_dim']}; "
        f"{cfg['steps']} timed steps per method and round ({cfg['warmup']} warm-up dropped), "
        f"{cfg['rounds']} rounds, {torch.get_num_threads()} thread(s).",
        "",
        common.markdown_table(rows, COLUMNS),
        "",
        f"**packed / padded tokens per second: "
        f"{summary['packed_over_padded_tokens_per_s']:.2f}x wall time, "
        f"{summary['packed_over_padded_cpu']:.2f}x CPU time** (floor: >= 2x); padding-free / "
        f"padded {summary['padding_free_over_padded_tokens_per_s']:.2f}x wall, "
        f"{summary['padding_free_over_padded_cpu']:.2f}x CPU.",
        "",
        f"**packed / padded_varlen tokens per second (the same attention kernel, the padding "
        f"of the other layers only): {summary['packed_over_padded_varlen_tokens_per_s']:.2f}x "
        f"wall time, {summary['packed_over_padded_varlen_cpu']:.2f}x CPU time**; padded_varlen "
        f"/ padded {summary['padded_varlen_over_padded_cpu']:.2f}x CPU.",
        "",
        f"**packed DP / packed non-private, time per step: "
        f"{summary['packed_over_nonprivate_step']:.3f}x wall time, "
        f"{summary['packed_over_nonprivate_cpu']:.3f}x CPU time** (floor: <= 1.10x); "
        f"padding-free DP / packed non-private {summary['padding_free_over_nonprivate_step']:.3f}x "
        f"wall, {summary['padding_free_over_nonprivate_cpu']:.3f}x CPU. Medians over rounds of "
        "the per-round ratios. On a shared machine the wall time also counts the waits for a "
        "core (see the load average below); the CPU time is this process' own work.",
        "",
        f"Epsilon of every DP method: {summary['epsilon']:.6f} at delta = {cfg['delta']:g} "
        f"(noise multiplier {summary['sigma']:.6f}; equal across methods, checked).",
        "",
        "Peak memory of one step (tensors created during the step, alive at its peak):",
        "",
        common.markdown_table(mem_rows, ["method", "peak_step_bytes", "peak"]),
        "",
        *(
            [
                f"Utility: held-out loss (mean over {cfg['n_heldout']} held-out records of each "
                f"record's mean next-token loss) after {cfg['utility_steps']} steps at epsilon "
                f"{cfg['epsilon']:g} (the target for those steps); before training "
                f"{initial:.4f}.",
                "",
                common.markdown_table(
                    utility, ["seed", "method", "steps", "epsilon", "heldout_loss"]
                ),
            ]
            if utility
            else ["Utility: not run in this profile."]
        ),
        "",
        common.machine_markdown(info),
    ]
    common.write_text(out / f"{stem}.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
