"""Item 3 of issue 5: one DP training step end to end on the real model, across T.

Methods, each on its own copy of the model, with SGD, ``noise_multiplier = 1`` and
``max_grad_norm = 1``:

* ``non_private``: forward, ``loss.backward()``, ``optimizer.step()``;
* ``opacus_hooks``: Opacus per-sample gradients (``grad_sample_mode="hooks"``), where they fit;
* ``opacus_ghost``: Opacus ghost clipping (``grad_sample_mode="ghost"``, two backward passes);
* ``rc_hutchinson`` / ``rc_hutch++``: ``opacus_rc.PrivacyEngine`` with
  ``clipping="randomized"``, ``sketch_dim = k`` (book-keeping: one backward pass, the default);
* ``rc_hutchinson_two_pass``: the same with ``bookkeeping=False`` (two backward passes, as
  Opacus' ghost clipping), to show what book-keeping saves.

For every T a fresh process (``--worker``) builds all methods and runs ``warmup + repeats``
rounds, each round one step of every method in a rotated order, so that all methods see the
same machine conditions. Reported per (T, method): median step time, peak memory (persistent
model bytes + peak bytes allocated during the step: dispatch tracker on CPU, CUDA allocator on
GPU) and both as ratios to ``non_private``.

Settings (``config.json``, ``training_step``): the model (SmolLM2-135M classifier), which blocks
are trainable, B, the T list and ``frozen_prefix``. With ``frozen_prefix = "cached"`` (the CPU
profile: only the last blocks train) the frozen blocks' output is computed once per T and each
timed step starts from it (``inputs_embeds`` into the trainable blocks): it is identical for all
methods, so the step time then measures the trainable part only (a conservative ratio); the
prefix forward time is reported separately, and ``full_step_ratio`` adds it back to every
method. With ``"run"`` (the GPU profile: full fine-tuning) every step runs the whole model.

Examples::

    python -m benchmarks.training_step --quick          # tiny random Llama, seconds
    python -m benchmarks.training_step                  # SmolLM2-135M on CPU
    python -m benchmarks.training_step --device cuda    # gpu profile (full fine-tuning)
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import common, models

NAME = "training_step"
COLUMNS = [
    "T",
    "B",
    "method",
    "k",
    "time_median_s",
    "time_min_s",
    "repeats",
    "time_ratio",
    "full_step_ratio",
    "peak_bytes",
    "step_extra_bytes",
    "persistent_bytes",
    "memory_ratio",
    "memory_source",
    "step_flops",
    "flops_ratio",
    "prefix_forward_s",
    "prefix_flops",
    "full_step_flops_ratio",
    "trainable_params",
    "status",
    "device",
]
BASELINE = "non_private"
TWO_PASS = "_two_pass"  # method-name suffix: bookkeeping=False


# ----------------------------------------------------------------------------------------------
# Model and inputs
# ----------------------------------------------------------------------------------------------


def build_model_and_inputs(
    cfg: dict[str, Any], T: int, device: torch.device
) -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor, dict[str, float], int]:
    """The model as timed (maybe only its trainable suffix), its inputs, labels, prefix cost.

    The frozen-prefix forward is timed once with the FLOP counter on (its per-op overhead is
    far below 1% of a forward over thousands of tokens).

    Returns:
        ``(model, inputs, labels, {"prefix_forward_s", "prefix_flops"}, trainable_params)``.
    """
    model = models.load_model(cfg).to(device)
    n_layers = len(models.decoder_layers(model))
    L = n_layers if cfg["trainable_layers"] == "all" else int(cfg["trainable_layers"])
    counts = models.freeze_all_but_last(model, L)
    encode = models.encoder(cfg, model)
    ids, labels = models.brown_batch(
        encode,
        batch_size=cfg["batch_size"],
        seq_len=T,
        seed=cfg["seed"],
        num_labels=cfg.get("num_labels", 2),
    )
    ids, labels = ids.to(device), labels.to(device)
    prefix = {"prefix_forward_s": 0.0, "prefix_flops": 0}
    if cfg["frozen_prefix"] == "cached" and n_layers > L:
        n_prefix = n_layers - L
        layers = models.decoder_layers(model)
        captured: list[torch.Tensor] = []
        handle = layers[n_prefix - 1].register_forward_hook(
            lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out)
        )
        with torch.no_grad():
            flops: dict[str, int] = {}

            def counted_prefix() -> None:
                _, flops["n"] = common.count_flops(lambda: _prefix_forward(model, ids, n_prefix))

            prefix["prefix_forward_s"] = common.time_one(counted_prefix, device)
            prefix["prefix_flops"] = flops["n"]
            reference = None
            if cfg.get("check_max_T", 512) >= T:
                reference = model(input_ids=ids).logits
        handle.remove()
        hidden = captured[0].detach()
        model.model.layers = nn.ModuleList(list(layers)[n_prefix:])
        model.config.num_hidden_layers = L
        inputs = {"inputs_embeds": hidden}
        # The frozen embedding is not used on cached states: leave it out of every copy's
        # persistent memory (the reference logits above were computed with it).
        model.model.embed_tokens = None
        if reference is not None:  # the truncated model on the cached states = the full model
            with torch.no_grad():
                check = model(**inputs).logits
            err = float((check - reference).abs().max() / reference.abs().max().clamp_min(1e-12))
            if err > 1e-4:
                raise RuntimeError(f"cached-prefix model disagrees with the full model ({err:.2e})")
    elif cfg["frozen_prefix"] not in ("cached", "run"):
        raise ValueError(f"frozen_prefix must be 'cached' or 'run', got {cfg['frozen_prefix']!r}")
    else:
        inputs = {"input_ids": ids}
    return model, inputs, labels, prefix, counts["trainable"]


def _prefix_forward(model: nn.Module, ids: torch.Tensor, n_prefix: int) -> torch.Tensor:
    """Forward of the embeddings and the first ``n_prefix`` blocks (what ``cached`` skips)."""
    n_layers = model.config.num_hidden_layers
    model.config.num_hidden_layers = n_prefix
    try:
        return model.model(input_ids=ids).last_hidden_state
    finally:
        model.config.num_hidden_layers = n_layers


# ----------------------------------------------------------------------------------------------
# Methods
# ----------------------------------------------------------------------------------------------


class Method:
    """One training-step variant on its own copy of the model."""

    def __init__(
        self,
        name: str,
        base: nn.Module,
        inputs: dict[str, torch.Tensor],
        labels: torch.Tensor,
        cfg: dict[str, Any],
    ) -> None:
        self.name = name
        self.k: int | None = None
        self.inputs = inputs
        self.labels = labels
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        criterion = nn.CrossEntropyLoss()
        B = len(labels)
        loader = DataLoader(TensorDataset(torch.zeros(B, 1), labels.cpu()), batch_size=B)
        dp = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "poisson_sampling": False}
        self.criterion = criterion
        if name == BASELINE:
            self.model, self.optimizer = model, optimizer
        elif name.startswith("opacus_"):
            import opacus

            mode = name.removeprefix("opacus_")
            engine = opacus.PrivacyEngine(accountant="prv")
            out = engine.make_private(
                module=model,
                optimizer=optimizer,
                data_loader=loader,
                criterion=criterion,
                grad_sample_mode=mode,
                **dp,
            )
            self.model, self.optimizer = out[0], out[1]
            if mode == "ghost":
                self.criterion = out[2]
        elif name.startswith("rc_"):
            from opacus_rc import PrivacyEngine

            self.k = int(cfg["k"])
            engine = PrivacyEngine()
            self.model, self.optimizer, self.criterion, _ = engine.make_private(
                module=model,
                optimizer=optimizer,
                data_loader=loader,
                criterion=criterion,
                clipping="randomized",
                sketch=name.removeprefix("rc_").removesuffix(TWO_PASS),
                sketch_dim=self.k,
                bookkeeping=not name.endswith(TWO_PASS),
                **dp,
            )
        else:
            raise ValueError(f"unknown method {name!r}")

    def step(self) -> None:
        logits = self.model(**self.inputs).logits
        loss = self.criterion(logits, self.labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def persistent_bytes(self) -> int:
        """Parameters and buffers of this method's model copy plus optimizer state."""
        total = sum(t.numel() * t.element_size() for t in self.model.parameters())
        total += sum(t.numel() * t.element_size() for t in self.model.buffers())
        opt = getattr(self.optimizer, "original_optimizer", self.optimizer)
        for state in opt.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        return total


def hooks_bytes_estimate(trainable: int, B: int) -> int:
    """Opacus hooks mode keeps a per-sample gradient (fp32) of every trainable parameter."""
    return 4 * B * trainable * 2


# ----------------------------------------------------------------------------------------------
# Worker: one process per T
# ----------------------------------------------------------------------------------------------


def worker(
    cfg: dict[str, Any], T: int, device: torch.device, *, timed: bool = True, log: Any = print
) -> list[dict]:
    """Build every method at this T and run the rounds; return one row per method.

    With ``timed=False`` only one step per method runs, measuring memory (deterministic).
    """
    common.quiet_warnings()
    torch.manual_seed(cfg["seed"])
    base, inputs, labels, prefix, trainable = build_model_and_inputs(cfg, T, device)
    B = len(labels)
    budget = cfg["memory_budget_gib"] * common.GiB
    methods: list[Method] = []
    rows: dict[str, dict[str, Any]] = {}
    for name in cfg["methods"]:
        row = {
            "T": T,
            "B": B,
            "method": name,
            "k": cfg["k"] if name.startswith("rc_") else None,
            **prefix,
            "trainable_params": trainable,
            "device": str(device),
        }
        rows[name] = row
        if name == "opacus_hooks" and hooks_bytes_estimate(trainable, B) > budget:
            row["status"] = common.skipped_memory(hooks_bytes_estimate(trainable, B))
            continue
        try:
            methods.append(Method(name, base, inputs, labels, cfg))
        except Exception as err:  # noqa: BLE001 - reported in the results
            row["status"] = f"failed: {type(err).__name__}: {err}"[:200]
            log(traceback.format_exc())
    del base
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    memory: dict[str, tuple[int, str]] = {}
    flops: dict[str, int] = {}
    rounds = cfg["warmup"] + cfg["repeats"] if timed else 1
    for r in range(rounds):
        order = methods[r % len(methods) :] + methods[: r % len(methods)] if methods else []
        for m in order:
            if "status" in rows[m.name]:
                continue
            try:
                if r == 0 and (cfg["warmup"] > 0 or not timed):
                    # The first (untimed) round measures memory and FLOPs.
                    memory[m.name], flops[m.name] = _measure_step(m, device)
                    continue
                t = common.time_one(m.step, device)
            except torch.OutOfMemoryError as err:
                rows[m.name]["status"] = f"failed: out of memory ({str(err)[:80]})"
                continue
            if r >= cfg["warmup"]:
                times[m.name].append(t)
        done = ", ".join(f"{m.name}={times[m.name][-1]:.3g}s" for m in methods if times[m.name])
        first = r == 0 and (cfg["warmup"] > 0 or not timed)
        log(f"T={T} round {r + 1}/{rounds}: {'memory and FLOPs (untimed)' if first else done}")
    for m in methods:
        row = rows[m.name]
        if "status" in row:
            continue
        ts = times[m.name]
        if ts:
            row.update(time_median_s=common.median(ts), time_min_s=min(ts), repeats=len(ts))
        if m.name not in memory:
            memory[m.name], flops[m.name] = _measure_step(m, device)
        extra, source = memory[m.name]
        row["step_flops"] = flops[m.name]
        row.update(
            step_extra_bytes=extra,
            persistent_bytes=m.persistent_bytes(),
            memory_source=source,
            status="ok" if timed else "memory only (--no-time)",
        )
        row["peak_bytes"] = row["step_extra_bytes"] + row["persistent_bytes"]
    if cfg.get("profile_methods") and cfg.get("profile_T") == T:
        for m in methods:
            if m.name in cfg["profile_methods"] and rows[m.name].get("status") == "ok":
                rows[m.name]["profile"] = profile_step(m, device)
    return [rows[name] for name in cfg["methods"]]


def _measure_step(method: Method, device: torch.device) -> tuple[tuple[int, str], int]:
    """Peak extra memory (and its source) and FLOPs of one step."""
    result: dict[str, Any] = {}

    def step() -> None:
        _, result["flops"] = common.count_flops(method.step)

    memory = common.peak_extra_bytes(step, device)
    return memory, result["flops"]


def profile_step(method: Method, device: torch.device, top: int = 12) -> str:
    """Top operators by self time of one step (torch.profiler), as a text table."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        method.step()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=top)


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``time_ratio``, ``full_step_ratio`` and ``memory_ratio`` against non_private per T."""
    for T in sorted({r["T"] for r in rows}):
        group = [r for r in rows if r["T"] == T]
        base = next((r for r in group if r["method"] == BASELINE and r.get("peak_bytes")), None)
        if base is None:
            continue
        for r in group:
            if not r.get("peak_bytes"):
                continue
            r["memory_ratio"] = r["peak_bytes"] / base["peak_bytes"]
            if r.get("step_flops") and base.get("step_flops"):
                r["flops_ratio"] = r["step_flops"] / base["step_flops"]
                pf = r.get("prefix_flops") or 0
                r["full_step_flops_ratio"] = (r["step_flops"] + pf) / (base["step_flops"] + pf)
            if r.get("status") != "ok" or base.get("status") != "ok":
                continue
            r["time_ratio"] = r["time_median_s"] / base["time_median_s"]
            prefix = r.get("prefix_forward_s") or 0.0
            r["full_step_ratio"] = (r["time_median_s"] + prefix) / (base["time_median_s"] + prefix)


# ----------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------


def _get(rows: list[dict], T: int, method: str) -> dict | None:
    return next((r for r in rows if r["T"] == T and r["method"] == method), None)


def criteria(rows: list[dict], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's training-step requirements, evaluated on the results.

    On wall time where measured; otherwise (``--no-time``) on FLOPs per step, marked as such.
    """
    out = []
    for T in cfg["T"]:
        if cfg["faster_than_ghost_from_T"] > T:
            continue
        ghost = _get(rows, T, "opacus_ghost")
        for m in ("rc_hutchinson", "rc_hutch++"):
            ours = _get(rows, T, m)
            if not ours or not ghost:
                continue
            col, what = "time_median_s", "faster than"
            if ours.get(col) is None or ghost.get(col) is None:
                col, what = "step_flops", "fewer FLOPs than"
            if not ours.get(col) or not ghost.get(col):
                continue
            out.append(
                {
                    "requirement": f"{m} {what} opacus_ghost at T={T}",
                    "value": ours[col] / ghost[col],
                    "passed": ours[col] < ghost[col],
                    "bound": "< 1",
                }
            )
    T0 = cfg["within_T"]
    ours = _get(rows, T0, "rc_hutchinson")
    if ours:
        cols = ("time_ratio", "full_step_ratio")
        if ours.get("time_ratio") is None:
            cols = ("flops_ratio", "full_step_flops_ratio")
        for col in cols:
            if ours.get(col) is None:
                continue
            out.append(
                {
                    "requirement": f"rc_hutchinson {col} vs non_private at T={T0}",
                    "value": ours[col],
                    "passed": ours[col] <= cfg["within_ratio"],
                    "bound": f"<= {cfg['within_ratio']}",
                }
            )
    return out


def summary_markdown(rows: list[dict], cfg: dict, info: dict, crit: list[dict]) -> str:
    def cell(r: dict | None, col: str, fmt) -> str:
        if r is None:
            return ""
        if r.get(col) is None:
            return str(r.get("status", ""))
        return fmt(r[col])

    setting = (
        f"last {cfg['trainable_layers']} block(s) + final norm + head trainable"
        if cfg["trainable_layers"] != "all"
        else "all blocks + final norm + head trainable (embeddings frozen)"
    )
    prefix_note = (
        " The frozen blocks' output is cached per T (`frozen_prefix = cached`): step times "
        "cover the trainable blocks only and `time_ratio` is therefore conservative; "
        "`full step` adds the measured prefix forward to every method."
        if cfg["frozen_prefix"] == "cached"
        else ""
    )
    parts = [
        "# Training step end to end (issue 5, item 3)",
        "",
        f"Model `{cfg['model']}` classifier, {setting}; B = {cfg['batch_size']}; SGD, sigma = 1, "
        f"C = 1; randomized clipping with k = {cfg['k']}. One process per T, methods "
        f"alternating, median of {cfg['repeats']} steps after {cfg['warmup']} warm-up "
        "round(s). Peak memory = model copy (parameters, buffers, optimizer state) + peak bytes "
        "allocated during a step (measured in the warm-up round; dispatch tracker on CPU, CUDA "
        "allocator on GPU)." + prefix_note,
        "",
        common.machine_markdown(info),
        "",
    ]
    if crit:
        parts += [
            "## Requirements",
            "",
            "| requirement | value | bound | result |",
            "|---|---|---|---|",
        ]
        for c in crit:
            parts.append(
                f"| {c['requirement']} | {c['value']:.3g} | {c['bound']} | "
                f"{'PASS' if c['passed'] else 'FAIL'} |"
            )
        parts.append("")
    methods = cfg["methods"]
    for title, col, fmt in (
        ("Time per step (median)", "time_median_s", common.fmt_seconds),
        ("Time per step / non-private", "time_ratio", lambda v: f"{float(v):.2f}x"),
        (
            "Full step (with the frozen prefix) / non-private",
            "full_step_ratio",
            lambda v: f"{float(v):.2f}x",
        ),
        ("FLOPs per step / non-private", "flops_ratio", lambda v: f"{float(v):.2f}x"),
        (
            "FLOPs of the full step (with the frozen prefix forward) / non-private",
            "full_step_flops_ratio",
            lambda v: f"{float(v):.2f}x",
        ),
        ("Peak memory", "peak_bytes", common.fmt_bytes),
        ("Peak memory / non-private", "memory_ratio", lambda v: f"{float(v):.2f}x"),
    ):
        if col in ("full_step_ratio", "full_step_flops_ratio") and cfg["frozen_prefix"] != "cached":
            continue
        parts += [f"## {title}", ""]
        table = []
        for T in cfg["T"]:
            line = {"T": T}
            for m in methods:
                line[m] = cell(_get(rows, T, m), col, fmt)
            if col == "time_median_s":
                r = _get(rows, T, BASELINE)
                line["prefix"] = common.fmt_seconds(r.get("prefix_forward_s")) if r else ""
            table.append(line)
        cols = ["T", *methods] + (["prefix"] if col == "time_median_s" else [])
        headers = ["T", *methods] + (["frozen prefix forward"] if col == "time_median_s" else [])
        parts += [common.markdown_table(table, cols, headers), ""]
    profiles = [r for r in rows if r.get("profile")]
    for r in profiles:
        parts += [
            f"## Profile of one {r['method']} step at T={r['T']} (top operators by self time)",
            "",
            "```",
            r["profile"].strip(),
            "```",
            "",
        ]
    return "\n".join(parts)


def plot(rows: list[dict], cfg: dict, path: Path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for col, ax, label in (
        ("time_ratio", axes[0], "time per step / non-private"),
        ("flops_ratio", axes[1], "FLOPs per step / non-private"),
        ("memory_ratio", axes[2], "peak memory / non-private"),
    ):
        for m in cfg["methods"]:
            pts = [(r["T"], r[col]) for r in rows if r["method"] == m and r.get(col) is not None]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=m)
        ax.axhline(1, color="k", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes)
    scope = (
        "trainable blocks only (frozen prefix cached)"
        if cfg["frozen_prefix"] == "cached"
        else "full model"
    )
    fig.suptitle(f"{cfg['model']}, B={cfg['batch_size']}, k={cfg['k']}; {scope}", fontsize=10)
    fig.tight_layout()
    common.save_figure(fig, path)


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def _run_worker_process(args: Any, T: int, device: torch.device) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.training_step",
            "--worker",
            str(T),
            "--worker-out",
            str(out),
            "--config",
            str(args.config),
            "--profile",
            args.resolved_profile,
            "--device",
            str(device),
        ]
        if args.no_time:
            cmd.append("--no-time")
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(common.REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
        )
        proc = subprocess.run(cmd, cwd=common.REPO_ROOT, env=env)
        if proc.returncode != 0 or not out.exists():
            return [
                {"T": T, "method": m, "status": f"failed: worker exit code {proc.returncode}"}
                for m in args.cfg["methods"]
            ]
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--worker", type=int, default=None, metavar="T", help=argparse_hidden())
    parser.add_argument("--worker-out", type=Path, default=None, help=argparse_hidden())
    parser.add_argument(
        "--T", type=int, nargs="*", default=None, help="override the profile's list of T"
    )
    parser.add_argument(
        "--no-time",
        action="store_true",
        help="one step per method: memory only (deterministic), no wall times",
    )
    args = parser.parse_args(argv)
    cfg, out, device = common.resolve(args, NAME)
    if args.worker is not None:
        rows = worker(cfg, args.worker, device, timed=not args.no_time)
        args.worker_out.write_text(json.dumps(rows))
        return 0
    if args.T:
        cfg["T"] = args.T
    args.cfg = cfg
    args.resolved_profile = cfg["profile"]
    info = common.machine_info(device)
    stem = common.result_stem(NAME, cfg, device)
    rows: list[dict] = []
    for T in cfg["T"]:
        if cfg.get("process_per_T", True):
            rows += _run_worker_process(args, T, device)
        else:  # quick profile: in-process, to keep CI short
            rows += worker(cfg, T, device, timed=not args.no_time)
        add_ratios(rows)
        crit = criteria(rows, cfg)
        # Written after every T, so that an interrupted run keeps what it measured.
        common.write_csv(out / f"{stem}.csv", rows, COLUMNS)
        common.write_text(out / f"{stem}.md", summary_markdown(rows, cfg, info, crit))
    plot(rows, cfg, out / f"{stem}.png")
    for c in crit:
        print(f"{'PASS' if c['passed'] else 'FAIL'} {c['requirement']}: {c['value']:.3g}")
    print(f"wrote {out / stem}.csv, .md, .png")
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
