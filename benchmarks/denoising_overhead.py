"""Issue 6, item 5: what spectral denoising costs per step, and what it buys.

Part 1, **overhead**: the time the denoiser (:class:`opacus_rc.denoising.SpectralDenoiser`,
attached as ``make_private(denoise="spectral")`` attaches it) takes inside a DP training step,
as a fraction of that step's time. The paper (Dadsetan and Rudzicz, arXiv:2510.01137) reports
under 1 %. Settings, all on the packaged SmolLM2-135M classifier with its top block trained
under randomized clipping on Brown documents:

* ``lora_qv``: LoRA (r = 8) on ``q_proj`` and ``v_proj`` (4 small matrices, the tutorial);
* ``lora_all``: LoRA (r = 8) on all 7 linear layers of the block (14 matrices);
* ``full_exact`` / ``full_randomized``: the block itself trained (7 weight matrices up to
  576 x 1536), exact or randomized SVD: the worst case for the denoiser.

The frozen blocks below are run once and cached (as in the tutorial), so a step here costs only
the trained block and the fraction is an upper bound; ``overhead_fraction_uncached`` adds the
measured forward time of the frozen blocks for one batch back to the step time.

Part 2, **steps to target**: the tutorial's DP-LoRA run (``lora_qv``, verbalizer head, Adam
with the learning rate decayed linearly to 0)
with and without ``denoise="spectral"``, over 3 seeds: the first evaluated step at which the
validation cross-entropy reaches ``target_loss``, the best and final loss, and epsilon (which
must be identical with and without denoising: post-processing).

Settings are in ``PROFILES`` below (``full``: the committed CPU results; ``quick``: a tiny
random Llama for CI). Results: ``benchmarks/results/denoising_overhead.{csv,md}`` and
``denoising_steps_to_target.csv`` (``--quick``: a temporary folder).

Examples::

    python -m benchmarks.denoising_overhead --quick     # seconds
    python -m benchmarks.denoising_overhead             # SmolLM2 on CPU, ~10-15 minutes
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import common, models

NAME = "denoising_overhead"
STEPS_NAME = "denoising_steps_to_target"

#: The 7 linear layers of a Llama block.
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

PROFILES: dict[str, dict[str, Any]] = {
    "full": {
        "model": "smollm2",
        "max_length": 32,
        "train_docs": None,  # all 400
        "test_docs": None,  # all 100
        "label_words": (" report", " story"),
        "batch_size": 64,
        "noise_multiplier": 1.2,
        "max_grad_norm": 0.05,
        "lr": 5e-3,
        "kappa": 1.05,
        "lora_rank": 8,
        "overhead": [
            {"setting": "lora_qv", "trainable": "lora", "targets": ("q_proj", "v_proj")},
            {"setting": "lora_all", "trainable": "lora", "targets": ALL_LINEAR},
            {"setting": "full_exact", "trainable": "block", "svd": "exact"},
            {"setting": "full_randomized", "trainable": "block", "svd": "randomized"},
        ],
        "overhead_warmup": 2,
        "overhead_steps": 8,
        "steps": 30,
        "eval_every": 2,
        "target_loss": 1.05,  # the tutorial's target
        "seeds": (0, 1, 2),
        # One intra-op thread: on the shared 2-core machine, 2 threads made a single 8 x 576
        # SVD take 24 ms instead of 0.27 ms (LAPACK threads waiting for busy cores), which
        # measures the machine's load, not the denoiser.
        "threads": 1,
    },
    "quick": {
        "model": "tiny-llama",
        "max_length": 16,
        "train_docs": 64,
        "test_docs": 32,
        "label_words": None,  # token ids 1 and 2
        "batch_size": 16,
        "overhead": [
            {"setting": "lora_qv", "trainable": "lora", "targets": ("q_proj", "v_proj")},
            {"setting": "full_exact", "trainable": "block", "svd": "exact"},
        ],
        "overhead_warmup": 1,
        "overhead_steps": 2,
        "steps": 4,
        "eval_every": 1,
        "target_loss": 0.66,
        "threads": 1,
    },
}

OVERHEAD_COLUMNS = [
    "setting",
    "trainable",
    "svd",
    "B",
    "T",
    "matrices",
    "largest_matrix",
    "steps",
    "step_time_median_s",
    "denoise_time_median_s",
    "overhead_fraction",
    "frozen_forward_per_batch_s",
    "overhead_fraction_uncached",
]
STEPS_COLUMNS = [
    "seed",
    "denoise",
    "steps",
    "target_loss",
    "steps_to_target",
    "best_loss",
    "final_loss",
    "final_accuracy",
    "epsilon",
    "step_time_mean_s",
    "denoised_fraction",
]
#: Columns of the report's summary table (one row per denoise setting).
SUMMARY_COLUMNS = ["denoise", "reached", "steps_to_target", "best_loss", "final_loss", "epsilon"]


def profile(name: str) -> dict[str, Any]:
    """Settings of a profile: ``full``, updated by the profile's overrides."""
    cfg = dict(PROFILES["full"])
    cfg.update(PROFILES[name])
    cfg["profile"] = name
    return cfg


# ----------------------------------------------------------------------------------------------
# Data and model (the tutorial's setting: frozen blocks run once, verbalizer head)
# ----------------------------------------------------------------------------------------------


class Task:
    """Brown 2-way classification on the first ``max_length`` tokens, features of the frozen
    blocks precomputed, and a template of the trained top of the network.

    Attributes:
        features: ``{"train"|"test": (N, T, hidden)}`` inputs of the first trained block.
        labels: ``{"train"|"test": (N,)}``.
        top: The classifier with only its last block (deep-copied for every run).
        frozen_seconds_per_doc: Forward time of the frozen blocks per document.
    """

    def __init__(self, cfg: dict[str, Any]) -> None:
        from tutorials import rc_data
        from tutorials.rc_models import SMOLLM2_GGUF

        model = models.load_model({**cfg, "num_labels": 2, "seed": 0})
        encode = models.encoder(cfg, model)
        T = cfg["max_length"]
        self.features: dict[str, torch.Tensor] = {}
        self.labels: dict[str, torch.Tensor] = {}
        words = cfg["label_words"]
        rows = [1, 2] if words is None else [encode(w)[0] for w in words]
        with torch.no_grad():  # verbalizer head: pretrained output embeddings of two words
            model.score.weight.copy_(model.model.embed_tokens.weight[rows])
        first = len(model.model.layers) - 1
        seconds = 0.0
        docs = 0
        for split, limit in (("train", cfg["train_docs"]), ("test", cfg["test_docs"])):
            records = rc_data.load_brown(split=split)
            if limit is not None:
                records = records[:: max(1, len(records) // limit)][:limit]
            ids = torch.tensor([encode(r["text"])[:T] for r in records], dtype=torch.long)
            self.labels[split] = torch.tensor([r["label"] for r in records])
            # The tutorial's cache key, so that either run reuses the other's features.
            key = hashlib.sha256(
                repr((SMOLLM2_GGUF, cfg["label_words"], first, ids.shape)).encode()
                + ids.numpy().tobytes()
            )
            path = _cache_dir() / f"{split}-{key.hexdigest()[:16]}.pt"
            if path.is_file():
                self.features[split] = torch.load(path)
                continue
            t0 = time.perf_counter()
            self.features[split] = _frozen_features(model, ids, layer=first)
            seconds += time.perf_counter() - t0
            docs += len(ids)
            if cfg["model"] == "smollm2":
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(self.features[split], path)
        if docs == 0:  # all cached: time one batch (after a warm-up) for the per-document cost
            ids = torch.tensor([encode(r["text"])[:T] for r in rc_data.load_brown()[:16]])
            _frozen_features(model, ids[:2], layer=first)  # first call: loads the weights
            t0 = time.perf_counter()
            _frozen_features(model, ids, layer=first)
            seconds, docs = time.perf_counter() - t0, len(ids)
        self.frozen_seconds_per_doc = seconds / docs
        blocks = model.model.layers
        model.model.layers = nn.ModuleList(list(blocks)[first:])
        self.top = copy.deepcopy(model)
        model.model.layers = blocks


def _cache_dir() -> Path:
    from tutorials.rc_models import smollm2_cache_dir

    return smollm2_cache_dir().parent / "tutorial_features"


def _frozen_features(model: nn.Module, input_ids: torch.Tensor, *, layer: int) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for i in range(0, len(input_ids), 25):
            hidden = model.model(input_ids=input_ids[i : i + 25], output_hidden_states=True)
            out.append(hidden.hidden_states[layer].float())
    return torch.cat(out)


def build_model(task: Task, cfg: dict[str, Any], setting: dict[str, Any], seed: int) -> nn.Module:
    """A fresh copy of the top; LoRA (peft) or the whole block trainable; head frozen."""
    torch.manual_seed(seed)
    top = copy.deepcopy(task.top)
    if setting["trainable"] == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg["lora_rank"],
            lora_alpha=2 * cfg["lora_rank"],
            lora_dropout=0.0,
            target_modules=list(setting["targets"]),
        )
        return get_peft_model(top, lora)
    for p in top.parameters():
        p.requires_grad_(False)
    for p in top.model.layers.parameters():
        p.requires_grad_(True)
    return top


def make_private(
    task: Task, cfg: dict[str, Any], model: nn.Module, seed: int, **kwargs: Any
) -> tuple[Any, ...]:
    from opacus_rc import PrivacyEngine

    engine = PrivacyEngine()
    trainable = [p for p in model.parameters() if p.requires_grad]
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.Adam(trainable, lr=cfg["lr"]),
        data_loader=DataLoader(
            TensorDataset(task.features["train"], task.labels["train"]),
            batch_size=cfg["batch_size"],
        ),
        criterion=nn.CrossEntropyLoss(),
        noise_multiplier=cfg["noise_multiplier"],
        max_grad_norm=cfg["max_grad_norm"],
        clipping="randomized",
        noise_generator=torch.Generator().manual_seed(seed + 1),
        **kwargs,
    )
    return (engine, *out)


# ----------------------------------------------------------------------------------------------
# Part 1: overhead
# ----------------------------------------------------------------------------------------------


class TimedDenoiser:
    """Wraps a denoiser and records the wall time of each call."""

    def __init__(self, denoiser: Any) -> None:
        self.denoiser = denoiser
        self.seconds: list[float] = []

    def __call__(self, optimizer: Any) -> None:
        t0 = time.perf_counter()
        self.denoiser(optimizer)
        self.seconds.append(time.perf_counter() - t0)


def measure_overhead(task: Task, cfg: dict[str, Any], setting: dict[str, Any]) -> dict[str, Any]:
    """Median denoiser time and step time over ``overhead_steps`` steps after warm-up."""
    from opacus_rc import attach_post_processing_hook
    from opacus_rc.denoising import SpectralDenoiser

    model = build_model(task, cfg, setting, seed=0)
    engine, module, optimizer, criterion, loader = make_private(task, cfg, model, seed=0)
    svd = setting.get("svd", "exact")
    timed = TimedDenoiser(SpectralDenoiser(kappa=cfg["kappa"], svd=svd))
    # Exactly what make_private(denoise="spectral") attaches, wrapped in a timer.
    attach_post_processing_hook(optimizer, timed)
    step_seconds: list[float] = []
    total = cfg["overhead_warmup"] + cfg["overhead_steps"]
    while len(step_seconds) < total:
        for x, y in loader:
            t0 = time.perf_counter()
            if len(y) > 0:
                criterion(module(inputs_embeds=x).logits, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            step_seconds.append(time.perf_counter() - t0)
            if len(step_seconds) == total:
                break
    warm = cfg["overhead_warmup"]
    step_s = common.median(step_seconds[warm:])
    den_s = common.median(timed.seconds[warm:])
    shapes = [tuple(p.shape) for p in optimizer.params if p.dim() == 2]
    frozen_s = task.frozen_seconds_per_doc * cfg["batch_size"]
    if hasattr(module, "cleanup"):
        module.cleanup()
    return {
        "setting": setting["setting"],
        "trainable": setting["trainable"],
        "svd": svd,
        "B": cfg["batch_size"],
        "T": cfg["max_length"],
        "matrices": len(shapes),
        "largest_matrix": "x".join(map(str, max(shapes, key=lambda s: s[0] * s[1]))),
        "steps": cfg["overhead_steps"],
        "step_time_median_s": step_s,
        "denoise_time_median_s": den_s,
        "overhead_fraction": den_s / step_s,
        "frozen_forward_per_batch_s": frozen_s,
        "overhead_fraction_uncached": den_s / (step_s + frozen_s),
    }


# ----------------------------------------------------------------------------------------------
# Part 2: steps to target
# ----------------------------------------------------------------------------------------------


def evaluate(task: Task, model: nn.Module) -> tuple[float, float]:
    with torch.no_grad():
        logits = model(inputs_embeds=task.features["test"]).logits
    y = task.labels["test"]
    loss = nn.functional.cross_entropy(logits, y).item()
    return loss, (logits.argmax(-1) == y).float().mean().item()


def steps_to_target(task: Task, cfg: dict[str, Any], *, seed: int, denoise: bool) -> dict:
    """One tutorial run (LoRA on q, v) with or without ``denoise="spectral"``."""
    setting = cfg["overhead"][0]
    model = build_model(task, cfg, setting, seed=seed)
    extra = {"denoise": "spectral", "denoise_kappa": cfg["kappa"]} if denoise else {}
    engine, module, optimizer, criterion, loader = make_private(
        task, cfg, model, seed, check_lora_update=True, **extra
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / cfg["steps"])
    torch.manual_seed(seed)  # the same Poisson batches with and without denoising
    history = [(0, *evaluate(task, model))]
    times: list[float] = []
    denoised = checked = 0
    while len(times) < cfg["steps"]:
        for x, y in loader:
            t0 = time.perf_counter()
            if len(y) > 0:
                criterion(module(inputs_embeds=x).logits, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            times.append(time.perf_counter() - t0)
            if engine.denoiser is not None:
                records = engine.denoiser.last_report.records
                denoised += sum(r.status == "denoised" for r in records)
                checked += len(records)
            step = len(times)
            if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
                history.append((step, *evaluate(task, model)))
            if step == cfg["steps"]:
                break
    reached = [s for s, loss, _ in history if loss <= cfg["target_loss"]]
    if hasattr(module, "cleanup"):
        module.cleanup()
    return {
        "seed": seed,
        "denoise": "spectral" if denoise else "none",
        "steps": cfg["steps"],
        "target_loss": cfg["target_loss"],
        "steps_to_target": reached[0] if reached else None,
        "best_loss": min(loss for _, loss, _ in history),
        "final_loss": history[-1][1],
        "final_accuracy": history[-1][2],
        "epsilon": engine.get_epsilon(delta=1e-5),
        "step_time_mean_s": statistics.fmean(times),
        "denoised_fraction": denoised / checked if checked else None,
    }


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def summary(steps_rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per ``denoise``: seeds reaching the target, mean steps to it (reached only), losses."""
    out = []
    for denoise in ("none", "spectral"):
        rows = [r for r in steps_rows if r["denoise"] == denoise]
        reached = [r["steps_to_target"] for r in rows if r["steps_to_target"] is not None]
        out.append(
            {
                "denoise": denoise,
                "reached": f"{len(reached)}/{len(rows)}",
                "steps_to_target": statistics.fmean(reached) if reached else None,
                "best_loss": statistics.fmean(r["best_loss"] for r in rows),
                "final_loss": statistics.fmean(r["final_loss"] for r in rows),
                "epsilon": rows[0]["epsilon"] if rows else None,
            }
        )
    return out


def write_report(
    out: Path, cfg: dict[str, Any], overhead: list[dict], steps_rows: list[dict], info: dict
) -> None:
    common.write_csv(out / f"{NAME}.csv", overhead, OVERHEAD_COLUMNS)
    common.write_csv(out / f"{STEPS_NAME}.csv", steps_rows, STEPS_COLUMNS)
    formats = dict.fromkeys(("overhead_fraction", "overhead_fraction_uncached"), _pct)
    for c in ("step_time_median_s", "denoise_time_median_s", "frozen_forward_per_batch_s"):
        formats[c] = common.fmt_seconds
    settings = {k: v for k, v in cfg.items() if k != "overhead"}
    text = f"""# Spectral denoising: overhead per step and steps to a target loss

`python -m benchmarks.denoising_overhead{" --quick" if cfg["profile"] == "quick" else ""}`
(profile `{cfg["profile"]}`). {common.machine_markdown(info)}

Settings: {settings}

## Overhead of the denoiser per DP step

The denoiser's own time inside a randomized-clipping step, median over {cfg["overhead_steps"]}
steps after {cfg["overhead_warmup"]} warm-up steps. `overhead_fraction` divides by the step of
the trained block alone (the frozen blocks are cached); `overhead_fraction_uncached` adds the
frozen blocks' forward for one batch back. The paper reports under 1 %.

The denoiser's time is its SVDs: one per 2-D gradient (batched for equal shapes). LoRA factors
are rank-`r` matrices (`8 x 576`, ...), so their SVDs cost well under 1 % of a step; a full
`576 x 1536` weight costs much more with the exact SVD on a CPU, and `svd="randomized"`
(`denoise_options`), which only computes the singular values above the noise bulk edge, cuts
that by about 10x. Threads: {cfg["threads"]} intra-op thread (with 2 threads on this busy 2-core
machine a single `8 x 576` SVD took 24 ms instead of 0.27 ms: LAPACK threads waiting for cores
taken by other processes).

{common.markdown_table(overhead, OVERHEAD_COLUMNS, formats=formats)}

## Steps to validation loss {cfg["target_loss"]} (tutorial setting, LoRA on q_proj and v_proj)

Evaluated every {cfg["eval_every"]} steps, {cfg["steps"]} steps per run. `steps_to_target` is
empty when the run did not reach the target. Epsilon is identical with and without denoising
(post-processing).

{common.markdown_table(summary(steps_rows), SUMMARY_COLUMNS)}

Per seed:

{common.markdown_table(steps_rows, STEPS_COLUMNS)}
"""
    common.write_text(out / f"{NAME}.md", text)


def _pct(v: Any) -> str:
    return "" if v is None or v == "" else f"{100 * float(v):.3g} %"


def arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny random Llama, seconds (CI)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output folder (default: {common.RESULTS_DIR.relative_to(common.REPO_ROOT)}, or "
        f"{common.QUICK_RESULTS_DIR} with --quick)",
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="seeds of part 2 (default: 0 1 2)"
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per run of part 2")
    parser.add_argument(
        "--skip-overhead", action="store_true", help="run part 2 only (steps to target)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = arg_parser().parse_args(argv)
    cfg = profile("quick" if args.quick else "full")
    if args.seeds:
        cfg["seeds"] = tuple(args.seeds)
    if args.steps:
        cfg["steps"] = args.steps
    torch.set_num_threads(args.threads or cfg["threads"])
    out = args.out or (common.QUICK_RESULTS_DIR if args.quick else common.RESULTS_DIR)
    out.mkdir(parents=True, exist_ok=True)
    common.quiet_warnings()
    import warnings

    warnings.filterwarnings("ignore", message=".*will not detect padding tokens")
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
    info = common.machine_info(torch.device("cpu"))
    t0 = time.perf_counter()
    task = Task(cfg)
    print(f"features ready in {time.perf_counter() - t0:.0f} s", flush=True)
    overhead = []
    if not args.skip_overhead:
        for setting in cfg["overhead"]:
            row = measure_overhead(task, cfg, setting)
            overhead.append(row)
            print(
                f"{row['setting']:>16}: step {row['step_time_median_s']:.3f} s, denoise "
                f"{row['denoise_time_median_s'] * 1e3:.2f} ms = {row['overhead_fraction']:.2%} "
                f"({row['overhead_fraction_uncached']:.2%} with the frozen blocks)",
                flush=True,
            )
    steps_rows = []
    for seed in cfg["seeds"]:
        for denoise in (False, True):
            row = steps_to_target(task, cfg, seed=seed, denoise=denoise)
            steps_rows.append(row)
            print(
                f"seed {seed} {row['denoise']:>8}: steps to {cfg['target_loss']} = "
                f"{row['steps_to_target']}, best {row['best_loss']:.4f}, final "
                f"{row['final_loss']:.4f}, epsilon {row['epsilon']:.3f}",
                flush=True,
            )
    for seed in cfg["seeds"]:
        eps = {r["epsilon"] for r in steps_rows if r["seed"] == seed}
        if len(eps) != 1:
            raise RuntimeError(f"epsilon differs with and without denoising: {eps}")
    info["wall_s"] = round(time.perf_counter() - t0)
    write_report(out, cfg, overhead, steps_rows, info)
    print(f"wrote {out / (NAME + '.md')} in {info['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
