"""Issue 22: what ``DPTrainer`` adds to a randomized-clipping step, and its epsilon.

Part 1, **time per logical step**: the same DP-SGD-RC training, on the same model, the same
Poisson logical batches (one
:class:`~opacus_rc.integrations.transformers.PoissonLogicalBatchSampler` seed), the same
physical batch, sketch, optimizer and noise multiplier, run

* by ``DPTrainer`` (``transformers.Trainer``): its loop, callbacks, scheduler and accounting;
* by a hand-written loop as the README writes it: ``PrivacyEngine.make_private`` with
  ``clipping="randomized"``, Opacus' ``BatchMemoryManager`` for the physical batches, the
  per-token loss with ``shape=(B, T - 1)``, ``loss.backward()``, ``optimizer.step()``.

The two are **interleaved step by step in one process**: a Trainer callback, at the end of
each trainer step, runs one logical step of the hand loop (a generator), so that both see the
same machine at the same minute; the first ``warmup`` steps of each are dropped, and the ratio
is that of the summed step times of the same steps. A trainer step is timed from the end of
the preceding hand-loop step to the trainer's next ``on_step_end`` (so it holds everything the
Trainer does between two steps: fetching and collating the logical batch, every micro-batch's
forward and private backward, the noise, the optimizer and accountant step, the scheduler, its
callbacks and logging checks); a hand-loop step from its ``next`` to its yield after
``optimizer.step()`` (loading, the micro-batches, the noisy step, the scheduler). The run is
repeated ``pairs`` times (a fresh trainer and loop each) and the median ratio over the
repetitions is reported (the issue's floor: <= 1.05). Two clocks: wall time
(``time.perf_counter``) and the process's CPU time (``time.process_time``; with one torch
thread and no loader workers, the work this process did). On a machine shared with other jobs
the wall time also counts the time the process waited for a core; step-by-step interleaving
puts that wait on both paths alike, and the CPU-time ratio is reported beside it (it is not
free of the load either: caches and memory bandwidth are shared). Epsilon is not computed
inside the measured steps
(``logging_steps`` beyond the run); one ``get_epsilon`` call is timed separately, since a
Trainer that logs every ``n`` steps pays it every ``n`` steps.

Part 2, **epsilon**: after the run, the trainer's epsilon and the hand loop's engine epsilon
(the same noise multiplier, sample rate and steps: they must be equal), and what
``PrivacyEngine.make_private_with_epsilon(epochs=...)`` searches for the same target and
schedule (its noise multiplier and the epsilon after the same number of steps).

Settings are in ``PROFILES`` (``full``: the committed CPU results, one thread; ``quick``: CI).
Results: ``benchmarks/results/trainer_overhead.{csv,md}`` (``--quick``: a temporary folder).

Run it with one OpenMP thread that does not spin (``OMP_WAIT_POLICY=PASSIVE``: spinning
threads of one run would steal time from the other on a busy machine); the load average
(``uptime``) before and after is written with the results, since step times measured while
other jobs run are slower for both and their ratio noisier.

Examples::

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python -m benchmarks.trainer_overhead --quick
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python -m benchmarks.trainer_overhead  # minutes
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from benchmarks import common

NAME = "trainer_overhead"

PROFILES: dict[str, dict[str, Any]] = {
    "full": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 688,
        "vocab_size": 4096,
        "seq_len": 128,
        "n_examples": 256,
        "expected_batch_size": 16,
        "physical_batch_size": 8,
        "steps": 24,
        "warmup": 4,
        "pairs": 3,
        "target_epsilon": 8.0,
        "delta": 1e-5,
        "max_grad_norm": 1.0,
        "sketch_dim": 32,
        "lr": 1e-3,
        "threads": 1,
    },
    "quick": {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 128,
        "seq_len": 16,
        "n_examples": 48,
        "expected_batch_size": 8,
        "physical_batch_size": 4,
        "steps": 6,
        "warmup": 2,
        "pairs": 1,
        "target_epsilon": 8.0,
        "delta": 1e-5,
        "max_grad_norm": 1.0,
        "sketch_dim": 8,
        "lr": 1e-3,
        "threads": 1,
    },
}

COLUMNS = [
    "pair",
    "trainer_step_median_s",
    "loop_step_median_s",
    "trainer_steps_sum_s",
    "loop_steps_sum_s",
    "ratio",
    "trainer_cpu_sum_s",
    "loop_cpu_sum_s",
    "ratio_cpu",
]


def _stamp() -> tuple[float, float]:
    """(wall, CPU) seconds now."""
    return time.perf_counter(), time.process_time()


def make_model(cfg: dict[str, Any]) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"],
        max_position_embeddings=cfg["seq_len"],
        pad_token_id=0,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def make_data(cfg: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, cfg["vocab_size"], (cfg["n_examples"], cfg["seq_len"]), generator=g)
    return [{"input_ids": row} for row in ids]


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.stack([r["input_ids"] for r in rows])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class CountingCollate:
    """``collate`` that counts the physical batches and examples it collated."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        self.sizes.append(len(rows))
        return collate(rows)


def run_trainer(cfg: dict[str, Any], model: torch.nn.Module, data: list, out: Path) -> dict:
    """``DPTrainer`` for ``cfg["steps"]`` steps, with one hand-loop step after each of its steps.

    Returns:
        The trainer's step intervals, sigma, epsilon, seed, history, and under ``"loop"`` the
        hand loop's (:func:`loop_result`).
    """
    import transformers

    from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments

    stamps: list[tuple[tuple[float, float], tuple[float, float]]] = []
    loop_stamps: list[tuple[tuple[float, float], tuple[float, float]]] = []
    counting = CountingCollate()
    holder: dict[str, Any] = {}

    class Stamp(transformers.TrainerCallback):
        """Times each trainer step, then runs one hand-loop step (timed on its own)."""

        def on_train_begin(self, args, state, control, **kwargs):
            trainer = holder["trainer"]
            holder["loop"] = hand_loop(
                cfg,
                make_model(cfg),
                data,
                sigma=trainer.dp_optimizer.noise_multiplier,
                seed=trainer._poisson_sampler.seed,
            )
            holder["loop_state"] = next(holder["loop"])  # set-up, not timed
            holder["start"] = _stamp()

        def on_step_end(self, args, state, control, **kwargs):
            end = _stamp()
            stamps.append((holder["start"], end))
            begin = _stamp()
            holder["loop_state"] = next(holder["loop"])
            loop_stamps.append((begin, _stamp()))
            holder["start"] = _stamp()

    args = transformers.TrainingArguments(
        output_dir=str(out / "trainer_overhead_run"),
        per_device_train_batch_size=cfg["physical_batch_size"],
        max_steps=cfg["steps"],
        learning_rate=cfg["lr"],
        logging_steps=cfg["steps"] + 1,  # epsilon is timed separately (module docstring)
        save_strategy="no",
        report_to=[],
        max_grad_norm=0.0,
        remove_unused_columns=False,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=0,
    )
    privacy = PrivacyArguments(
        target_epsilon=cfg["target_epsilon"],
        target_delta=cfg["delta"],
        expected_batch_size=cfg["expected_batch_size"],
        max_grad_norm=cfg["max_grad_norm"],
        sketch_dim=cfg["sketch_dim"],
        seed=0,
        # The first-batch check of batch independence collates examples alone (the counting
        # collator would count them) and runs once, in the warm-up; both sides leave it out.
        check_batch_independence=False,
    )
    trainer = DPTrainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=counting,
        privacy_args=privacy,
        callbacks=[Stamp()],
    )
    holder["trainer"] = trainer
    trainer.train()
    t = time.perf_counter()
    trainer._epsilon_cache = None
    epsilon = trainer.get_epsilon()
    epsilon_s = time.perf_counter() - t
    return {
        "steps": [b[0] - a[0] for a, b in stamps],
        "cpu": [b[1] - a[1] for a, b in stamps],
        "examples": sum(counting.sizes),
        "loop": loop_result(cfg, holder["loop_state"], loop_stamps),
        "noise_multiplier": trainer.dp_optimizer.noise_multiplier,
        "sample_rate": trainer.privacy_engine.accountant.history[0][1],
        "epsilon": epsilon,
        "epsilon_s": epsilon_s,
        "seed": trainer._poisson_sampler.seed,
        "history": trainer.privacy_engine.accountant.history,
        "accountant_steps": len(trainer.privacy_engine.accountant),
    }


def hand_loop(
    cfg: dict[str, Any], model: torch.nn.Module, data: list, *, sigma: float, seed: int
) -> Iterator[dict]:
    """The README's hand-written loop on the trainer's batches, one logical step per ``next``.

    Everything before the first step (``make_private``, the loader) runs at the first ``next``;
    each later ``next`` runs one logical step (every micro-batch's forward and private backward,
    the noisy step, the scheduler) and yields the state: examples collated so far, the engine.
    """
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    from opacus_rc import PrivacyEngine
    from opacus_rc.integrations.transformers import PoissonLogicalBatchSampler

    n = len(data)
    counting = CountingCollate()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    steps_per_epoch = -(-n // cfg["expected_batch_size"])
    sampler = PoissonLogicalBatchSampler(
        num_samples=n, sample_rate=1 / steps_per_epoch, steps=steps_per_epoch, seed=seed
    )
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=counting)
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="poisson_sampling=False")
        model, optimizer, criterion, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            criterion=torch.nn.CrossEntropyLoss(ignore_index=-100),
            noise_multiplier=sigma,
            max_grad_norm=cfg["max_grad_norm"],
            poisson_sampling=False,  # the loader draws Poisson batches already (same seed)
            dataset_size=n,  # the divisor int(n / steps) from a public size (synthetic data)
            clipping="randomized",
            sketch_dim=cfg["sketch_dim"],
            noise_generator=torch.Generator().manual_seed(0),
            check_batch_independence=False,  # as the trainer's run (run_trainer)
        )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer.original_optimizer, lambda s: 1 - s / cfg["steps"]
    )
    state = {"counting": counting, "engine": engine}
    yield state  # set up
    done = 0
    while done < cfg["steps"]:
        with BatchMemoryManager(
            data_loader=loader,
            max_physical_batch_size=cfg["physical_batch_size"],
            optimizer=optimizer,
        ) as physical:
            for batch in physical:
                logits = model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                ).logits
                b, t = batch["labels"].shape
                loss = criterion(
                    logits[:, :-1].reshape(b * (t - 1), -1),
                    batch["labels"][:, 1:].reshape(-1),
                    shape=(b, t - 1),
                )
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if not optimizer._is_last_step_skipped:
                    schedule.step()
                    done += 1
                    yield state
                    if done == cfg["steps"]:
                        break


def loop_result(cfg: dict[str, Any], state: dict, stamps: list) -> dict:
    """The hand loop's step intervals, examples and epsilon."""
    engine = state["engine"]
    return {
        "steps": [b[0] - a[0] for a, b in stamps],
        "cpu": [b[1] - a[1] for a, b in stamps],
        "examples": sum(state["counting"].sizes),
        "epsilon": float(engine.get_epsilon(cfg["delta"])),
        "accountant_steps": len(engine.accountant),
        "history": engine.accountant.history,
    }


def privacy_engine_search(cfg: dict[str, Any], sigma_steps: int, spec: Any) -> dict:
    """``make_private_with_epsilon(epochs=steps / steps_per_epoch)``: its sigma and epsilon."""
    from opacus_rc import PrivacyEngine

    model = make_model(cfg)
    data = make_data(cfg)
    steps_per_epoch = -(-len(data) // cfg["expected_batch_size"])
    engine = PrivacyEngine()
    _, optimizer, _, _ = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=cfg["lr"]),
        data_loader=DataLoader(data, batch_size=cfg["expected_batch_size"], collate_fn=collate),
        criterion=torch.nn.CrossEntropyLoss(ignore_index=-100),
        target_epsilon=cfg["target_epsilon"],
        target_delta=cfg["delta"],
        epochs=sigma_steps / steps_per_epoch,
        max_grad_norm=cfg["max_grad_norm"],
        clipping="randomized",
        sketch_dim=cfg["sketch_dim"],
    )
    accountant = copy.deepcopy(engine.accountant)
    accountant.history = [(optimizer.noise_multiplier, 1 / steps_per_epoch, sigma_steps, spec)]
    return {
        "noise_multiplier": optimizer.noise_multiplier,
        "epsilon": float(accountant.get_epsilon(cfg["delta"])),
    }


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages, as ``uptime`` prints them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI size, seconds")
    p.add_argument("--out", type=Path, default=None, help="results folder")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    p.add_argument("--pairs", type=int, default=None, help="trainer/loop run pairs")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = arg_parser().parse_args(argv)
    name = "quick" if args.quick else "full"
    cfg = dict(PROFILES[name], profile=name)
    if args.pairs:
        cfg["pairs"] = args.pairs
    torch.set_num_threads(args.threads or cfg["threads"])
    out = args.out or (common.QUICK_RESULTS_DIR if args.quick else common.RESULTS_DIR)
    out.mkdir(parents=True, exist_ok=True)
    common.quiet_warnings()
    warnings.filterwarnings("ignore", message="Secure RNG turned off")
    import transformers

    transformers.logging.set_verbosity_error()
    info = common.machine_info(torch.device("cpu"))
    info["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "unset")
    info["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "unset")
    info["uptime_load_average_before"] = load_average()
    t0 = time.perf_counter()
    data = make_data(cfg)
    w = cfg["warmup"]
    rows, trainer_runs, loop_runs = [], [], []
    for pair in range(cfg["pairs"]):
        tr = run_trainer(cfg, make_model(cfg), data, out)
        lp = tr["loop"]
        if tr["examples"] != lp["examples"]:
            raise RuntimeError(
                f"the trainer collated {tr['examples']} examples, the loop {lp['examples']}: "
                "they did not train on the same Poisson batches"
            )
        trainer_runs.append(tr)
        loop_runs.append(lp)
        a, b = tr["steps"][w:], lp["steps"][w:]
        rows.append(
            {
                "pair": pair,
                "trainer_step_median_s": statistics.median(a),
                "loop_step_median_s": statistics.median(b),
                "trainer_steps_sum_s": sum(a),
                "loop_steps_sum_s": sum(b),
                "ratio": sum(a) / sum(b),
                "trainer_cpu_sum_s": sum(tr["cpu"][w:]),
                "loop_cpu_sum_s": sum(lp["cpu"][w:]),
                "ratio_cpu": sum(tr["cpu"][w:]) / sum(lp["cpu"][w:]),
            }
        )
        print(
            f"pair {pair}: trainer {statistics.median(a):.3f} s/step, loop "
            f"{statistics.median(b):.3f} s/step, ratio {rows[-1]['ratio']:.3f} (wall), "
            f"{rows[-1]['ratio_cpu']:.3f} (CPU)",
            flush=True,
        )
    tr, lp = trainer_runs[0], loop_runs[0]
    search = privacy_engine_search(cfg, tr["accountant_steps"], tr["history"][0][3])
    summary = {
        "ratio_median": statistics.median(r["ratio"] for r in rows),
        "ratio_cpu_median": statistics.median(r["ratio_cpu"] for r in rows),
        "trainer_epsilon": tr["epsilon"],
        "loop_epsilon": lp["epsilon"],
        "epsilon_equal": tr["epsilon"] == lp["epsilon"] and tr["history"] == lp["history"],
        "noise_multiplier": tr["noise_multiplier"],
        "sample_rate": tr["sample_rate"],
        "steps": tr["accountant_steps"],
        "engine_search_noise_multiplier": search["noise_multiplier"],
        "engine_search_epsilon": search["epsilon"],
        "get_epsilon_s": tr["epsilon_s"],
        "examples": tr["examples"],
    }
    if not summary["epsilon_equal"]:
        raise RuntimeError(f"the trainer's epsilon differs from the engine's: {summary}")
    info["wall_s"] = round(time.perf_counter() - t0)
    info["uptime_load_average_after"] = load_average()
    write_report(out, cfg, rows, summary, info)
    print(
        f"DPTrainer / hand-written loop per logical step: {summary['ratio_cpu_median']:.3f}x "
        f"CPU time, {summary['ratio_median']:.3f}x wall time (medians of {len(rows)} pairs); "
        f"epsilon {tr['epsilon']:.4f} (trainer) = "
        f"{lp['epsilon']:.4f} (PrivacyEngine loop)"
    )
    print(f"wrote {out / (NAME + '.md')} in {info['wall_s']} s")
    return 0


def write_report(out: Path, cfg: dict, rows: list[dict], summary: dict, info: dict) -> None:
    common.write_csv(out / f"{NAME}.csv", rows, COLUMNS)
    lines = [
        f"# DPTrainer overhead per logical step ({cfg['profile']} profile)",
        "",
        "`python -m benchmarks.trainer_overhead` (module docstring: what is measured and how).",
        f"Model: Llama, d = {cfg['hidden_size']}, {cfg['num_hidden_layers']} blocks, vocab "
        f"{cfg['vocab_size']} (tied), T = {cfg['seq_len']}; N = {cfg['n_examples']}, expected "
        f"batch {cfg['expected_batch_size']}, physical batch {cfg['physical_batch_size']}, "
        f"Hutchinson k = {cfg['sketch_dim']}, {cfg['steps']} steps ({cfg['warmup']} warm-up "
        f"dropped), {torch.get_num_threads()} thread(s).",
        "",
        common.markdown_table(rows, COLUMNS),
        "",
        f"**Ratio (median over pairs): {summary['ratio_cpu_median']:.3f}x CPU time** "
        f"(floor: <= 1.05x); wall time {summary['ratio_median']:.3f}x.",
        "",
        f"Epsilon after {summary['steps']} steps at delta = {cfg['delta']:g}: DPTrainer "
        f"{summary['trainer_epsilon']:.6f}, PrivacyEngine in the hand-written loop "
        f"{summary['loop_epsilon']:.6f} (equal: {summary['epsilon_equal']}); noise multiplier "
        f"{summary['noise_multiplier']:.6f}, sample rate {summary['sample_rate']:.6g}. "
        f"PrivacyEngine.make_private_with_epsilon for the same target and schedule: noise "
        f"multiplier {summary['engine_search_noise_multiplier']:.6f}, epsilon "
        f"{summary['engine_search_epsilon']:.6f}. One get_epsilon call: "
        f"{summary['get_epsilon_s']:.3f} s.",
        "",
        common.machine_markdown(info),
    ]
    common.write_text(out / f"{NAME}.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
