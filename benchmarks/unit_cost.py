"""Issue 23, item 5: the per-unit norm cost when the privacy unit is a long document.

A unit (a document, a user) of ``m`` windows of ``T`` tokens contributes the sum of its windows'
gradients, clipped once. For an ``nn.Linear`` that sum is ``sum_j A_j^T G_j``, the per-sample
gradient of the windows concatenated along the token axis, and its norm costs:

* ``rc_unit``: randomized clipping, one Hutchinson probe matrix ``Omega_u`` per unit,
  ``|| sum_j A_j^T (G_j Omega_u) ||_F``: ``2 m T k (p + d)`` FLOPs, linear in the unit's tokens;
* ``ghost_unit``: Opacus' ghost norm applied to the concatenated unit: ``(m T) x (m T)`` Gram
  matrices, quadratic in the unit's tokens in FLOPs and memory;
* ``per_sample_unit``: Opacus' per-sample gradients of the ``m`` windows, summed within the unit,
  then the norm: ``2 m T p d`` FLOPs and ``m p d`` floats.

Three parts, all in one process:

1. **Per-unit norm cost** (``part = norm``) of every trainable ``nn.Linear`` of the SmolLM2-135M
   architecture (30 blocks, 7 Linears each; ``benchmarks.models.causal_lm_config``) for units of
   ``windows`` x ``window`` tokens: FLOPs (``FlopCounterMode``, checked against the closed forms
   of :mod:`benchmarks.norm_methods`) and peak extra memory (the live-tensor tracker) on the
   meta device, so 64 x 2,048 tokens is measured too. FLOPs are the sum over all Linears of the
   model; memory is the largest single layer's (layers run one after the other).
2. **CPU wall time** (``part = time``) of the three methods on one Linear (``time_layer``) for
   units of ``time_windows`` x ``time_window`` tokens: tiny sizes, the methods in turn in one
   process (rotated order), median of ``repeats``; load average recorded before and after.
3. **The issue's floor** (``part = step``): a whole training step of the causal LM (all blocks
   and the final norm trainable, tied embedding / LM head frozen, activation checkpointing on)
   on one unit of ``floor.windows`` windows, on meta: ``non_private`` (the same tokens),
   ``rc_bookkeeping`` (randomized clipping, book-keeping, each window its own unit) and
   ``rc_unit_bookkeeping`` (the same with ``units=`` mapping every window to unit 0, i.e. the
   criterion's unit-level mode). The floor: ``rc_unit_bookkeeping`` FLOPs <= 1.05x and peak
   memory <= 1.1x non-private, each checkpointing mode. A method that raises (e.g. a library
   without ``units=``) is recorded as ``failed: ...`` and fails the floor.

Results: ``unit_cost.{csv,md,png}``.

Examples::

    python -m benchmarks.unit_cost --quick        # tiny Llama, seconds
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python -m benchmarks.unit_cost
    python -m benchmarks.unit_cost --no-time --no-step   # the norm-cost table only
"""

from __future__ import annotations

import gc
import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import common, long_context, models, norm_methods

NAME = "unit_cost"
UNIT_METHODS = norm_methods.UNIT_METHODS
STEP_METHODS = ("non_private", "rc_bookkeeping", "rc_unit_bookkeeping")
COLUMNS = [
    "part",
    "method",
    "windows",
    "window",
    "tokens",
    "checkpointing",
    "status",
    "flops",
    "closed_form_flops",
    "flops_ratio",
    "flops_per_token",
    "peak_extra_bytes",
    "peak_bytes",
    "memory_ratio",
    "growth_flops",
    "growth_memory",
    "time_median_s",
    "time_ratio",
    "repeats",
    "load_average",
    "k",
]


# ----------------------------------------------------------------------------------------------
# Part 1: per-unit norm cost of every Linear of the model, on meta
# ----------------------------------------------------------------------------------------------


def linear_shapes(cfg: dict[str, Any]) -> Counter[tuple[int, int]]:
    """``{(d, p): count}`` of the trainable ``nn.Linear`` layers of the model of ``cfg`` (built
    on meta; the frozen tied LM head is not among them)."""
    config = models.causal_lm_config(cfg["model"], num_hidden_layers=cfg["layers"])
    model = models.build_causal_lm(config, device="meta", seed=cfg["seed"])
    shapes: Counter[tuple[int, int]] = Counter()
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.requires_grad:
            if module.bias is not None:
                raise ValueError("unit_cost assumes bias-free Linears (Llama's default)")
            shapes[(module.in_features, module.out_features)] += 1
    return shapes


def measure_norm(method: str, *, m: int, T: int, d: int, p: int, k: int) -> tuple[int, int]:
    """FLOPs and peak extra bytes of one per-unit norm of a ``p x d`` Linear on meta."""
    layer = nn.Linear(d, p, bias=False, device="meta")
    A = torch.empty(m, T, d, device="meta")
    G = torch.empty(m, T, p, device="meta")
    gen = torch.Generator().manual_seed(0)  # torch.Generator has no meta device
    fn = norm_methods.get_unit_method(method)

    def call() -> Any:
        return fn(layer, A, G, k=k, generator=gen)

    with long_context.meta_autocast():
        _, flops = common.count_flops(call)
        extra, _ = common.peak_extra_bytes(call, torch.device("meta"))
    return flops, extra


def norm_rows(cfg: dict[str, Any], log: Any = print) -> list[dict[str, Any]]:
    """Part 1: one row per (method, windows), summed over the model's Linears."""
    shapes = linear_shapes(cfg)
    T, k = cfg["window"], cfg["k"]
    rows = []
    for m in cfg["windows"]:
        # The Linear weights' own forward + backward FLOPs over the unit's tokens (6 m T p d):
        # the non-private work the norm comes on top of.
        train = sum(6 * m * T * d * p * n for (d, p), n in shapes.items())
        for method in UNIT_METHODS:
            flops = closed = peak = 0
            for (d, p), n in shapes.items():
                f, e = measure_norm(method, m=m, T=T, d=d, p=p, k=k)
                flops += n * f
                closed += n * norm_methods.unit_closed_form_flops(method, m=m, T=T, d=d, p=p, k=k)
                peak = max(peak, e)
            rows.append(
                {
                    "part": "norm",
                    "method": method,
                    "windows": m,
                    "window": T,
                    "tokens": m * T,
                    "status": "ok" if flops == closed else "flops differ from closed form",
                    "flops": flops,
                    "closed_form_flops": closed,
                    "flops_ratio": flops / train,
                    "flops_per_token": flops / (m * T),
                    "peak_extra_bytes": peak,
                    "k": k if method == "rc_unit" else None,
                }
            )
            log(
                f"norm m={m:>3} {method:>16}: {common.fmt_flops(flops):>12} "
                f"({flops / train:.3g}x the Linears' fwd+bwd), peak {common.fmt_bytes(peak)}"
            )
    add_growth(rows)
    return rows


def add_growth(rows: list[dict[str, Any]]) -> None:
    """``growth_flops`` / ``growth_memory``: the log-log slope in tokens from the previous unit
    size of the same method (1: linear, 2: quadratic)."""
    for method in {r["method"] for r in rows}:
        series = sorted((r for r in rows if r["method"] == method), key=lambda r: r["tokens"])
        for prev, cur in zip(series, series[1:]):
            dt = math.log(cur["tokens"] / prev["tokens"])
            for col, out in (("flops", "growth_flops"), ("peak_extra_bytes", "growth_memory")):
                if cur.get(col) and prev.get(col):
                    cur[out] = math.log(cur[col] / prev[col]) / dt


# ----------------------------------------------------------------------------------------------
# Part 2: CPU wall time on one Linear, tiny sizes
# ----------------------------------------------------------------------------------------------


def time_rows(cfg: dict[str, Any], log: Any = print) -> list[dict[str, Any]]:
    """Part 2: median CPU time of each method on one Linear, the methods in turn (rotated)."""
    d, p = cfg["time_layer"]
    T, k = cfg["time_window"], cfg["k"]
    torch.manual_seed(cfg["seed"])
    layer = nn.Linear(d, p, bias=False)
    gen = torch.Generator().manual_seed(cfg["seed"])
    rows = []
    for m in cfg["time_windows"]:
        A = torch.randn(m, T, d)
        G = torch.randn(m, T, p)
        fns = {name: norm_methods.get_unit_method(name) for name in UNIT_METHODS}
        times: dict[str, list[float]] = {name: [] for name in UNIT_METHODS}
        load = [long_context.load_average()]
        order = list(UNIT_METHODS)
        for r in range(cfg["warmup"] + cfg["repeats"]):
            for name in order:
                fn = fns[name]
                t = common.time_one(
                    lambda fn=fn, A=A, G=G: fn(layer, A, G, k=k, generator=gen), torch.device("cpu")
                )
                if r >= cfg["warmup"]:
                    times[name].append(t)
            order = order[1:] + order[:1]
        load.append(long_context.load_average())
        base = common.median(times["rc_unit"])
        for name in UNIT_METHODS:
            med = common.median(times[name])
            rows.append(
                {
                    "part": "time",
                    "method": name,
                    "windows": m,
                    "window": T,
                    "tokens": m * T,
                    "status": "ok",
                    "time_median_s": med,
                    "time_ratio": med / base,
                    "repeats": len(times[name]),
                    "load_average": " -> ".join(load),
                    "k": k if name == "rc_unit" else None,
                }
            )
            log(f"time m={m:>3} {name:>16}: {common.fmt_seconds(med)} ({med / base:.3g}x rc_unit)")
    return rows


# ----------------------------------------------------------------------------------------------
# Part 3: the floor, a whole step on one unit of ``floor.windows`` windows, on meta
# ----------------------------------------------------------------------------------------------


def step_rows(cfg: dict[str, Any], log: Any = print) -> list[dict[str, Any]]:
    """Part 3: FLOPs and peak memory of a step on one unit, per method and checkpointing."""
    common.quiet_warnings()
    m, T = cfg["floor"]["windows"], cfg["window"]
    meta = torch.device("meta")
    rows = []
    for ckpt in cfg["step_checkpointing"]:
        for name in cfg["step_methods"]:
            row: dict[str, Any] = {
                "part": "step",
                "method": name,
                "windows": m,
                "window": T,
                "tokens": m * T,
                "checkpointing": ckpt,
                "k": cfg["k"] if name.startswith("rc_") else None,
            }
            rows.append(row)
            method = model = None
            try:
                model, ids = long_context.build_base(cfg, T, m, meta)
                units = None
                base_name = name
                if name == "rc_unit_bookkeeping":
                    # Every window of the batch belongs to unit 0: one unit of m windows.
                    units = torch.zeros(m, dtype=torch.long)
                    base_name = "rc_bookkeeping"
                method = long_context.LMMethod(base_name, model, ids, cfg, ckpt, units=units)
                measured = long_context.measure_step(method, meta)
                row.update(
                    status="ok",
                    flops=measured["step_flops"],
                    peak_extra_bytes=measured["step_extra_bytes"],
                    peak_bytes=measured["peak_bytes"],
                )
            except Exception as err:  # noqa: BLE001 - reported in the results
                row["status"] = long_context.first_line(err)
            method = model = None
            gc.collect()
            log(
                f"step {ckpt} m={m} {name:>20}: {common.fmt_flops(row.get('flops'))} "
                f"{common.fmt_bytes(row.get('peak_bytes'))} {row['status']}"
            )
        base = next(
            (r for r in rows if r["checkpointing"] == ckpt and r["method"] == "non_private"), {}
        )
        for r in rows:
            if r["checkpointing"] == ckpt and r.get("flops") and base.get("flops"):
                r["flops_ratio"] = r["flops"] / base["flops"]
                r["memory_ratio"] = r["peak_bytes"] / base["peak_bytes"]
    return rows


def floors(rows: list[dict[str, Any]], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 23's floor, per checkpointing mode: ``rc_unit_bookkeeping`` against non-private."""
    where = cfg["floor"]
    out = []
    for ckpt in cfg["step_checkpointing"]:
        r = next(
            (
                x
                for x in rows
                if x["part"] == "step"
                and x["checkpointing"] == ckpt
                and x["method"] == "rc_unit_bookkeeping"
            ),
            None,
        )
        for col, bound in (("flops_ratio", where["flops"]), ("memory_ratio", where["memory"])):
            value = r.get(col) if r else None
            out.append(
                {
                    "requirement": f"unit-level step (book-keeping) {col} vs non_private, "
                    f"checkpointing {ckpt}, unit of {where['windows']} x {cfg['window']} tokens",
                    "value": value,
                    "bound": f"<= {bound}",
                    "passed": value is not None and value <= bound,
                    "status": (r or {}).get("status", "not measured"),
                }
            )
    return out


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def norm_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per unit size, each method's FLOPs, ratio to the Linears' training FLOPs,
    growth exponent and peak memory."""
    norm = [r for r in rows if r["part"] == "norm"]
    table = []
    for m in sorted({r["windows"] for r in norm}):
        line: dict[str, Any] = {"windows": m, "tokens": m * norm[0]["window"]}
        for r in (x for x in norm if x["windows"] == m):
            g = r.get("growth_flops")
            growth = f", slope {g:.2f}" if g is not None else ""
            line[r["method"]] = (
                f"{common.fmt_flops(r['flops'])} ({common.fmt_ratio(r['flops_ratio'])}x{growth})"
            )
            line[r["method"] + "_mem"] = common.fmt_bytes(r["peak_extra_bytes"])
        table.append(line)
    cols = ["windows", "tokens"]
    heads = ["windows", "tokens"]
    for m in UNIT_METHODS:
        cols += [m, m + "_mem"]
        heads += [f"{m} FLOPs (/ Linears fwd+bwd, slope)", f"{m} peak"]
    return common.markdown_table(table, cols, heads)


def time_table(rows: list[dict[str, Any]]) -> str:
    timed = [r for r in rows if r["part"] == "time"]
    table = []
    for m in sorted({r["windows"] for r in timed}):
        line: dict[str, Any] = {"windows": m}
        for r in (x for x in timed if x["windows"] == m):
            line["tokens"] = r["tokens"]
            line[r["method"]] = f"{common.fmt_seconds(r['time_median_s'])} ({r['time_ratio']:.3g}x)"
            line["load"] = r["load_average"]
        table.append(line)
    return common.markdown_table(table, ["windows", "tokens", *UNIT_METHODS, "load"])


def step_table(rows: list[dict[str, Any]]) -> str:
    steps = [r for r in rows if r["part"] == "step"]
    table = []
    for r in steps:
        table.append(
            {
                "checkpointing": r["checkpointing"],
                "method": r["method"],
                "flops": common.fmt_flops(r.get("flops")),
                "flops_ratio": f"{r['flops_ratio']:.4f}x" if r.get("flops_ratio") else "",
                "peak": common.fmt_bytes(r.get("peak_bytes")),
                "memory_ratio": f"{r['memory_ratio']:.4f}x" if r.get("memory_ratio") else "",
                "status": r["status"],
            }
        )
    cols = ["checkpointing", "method", "flops", "flops_ratio", "peak", "memory_ratio", "status"]
    heads = ["checkpointing", "method", "FLOPs", "/ non-private", "peak memory", "/ non-private"]
    return common.markdown_table(table, cols, [*heads, "status"])


def floor_table(crit: list[dict[str, Any]]) -> str:
    lines = ["| requirement | value | bound | result | status |", "|---|---|---|---|---|"]
    for c in crit:
        value = "" if c["value"] is None else f"{c['value']:.4f}"
        lines.append(
            f"| {c['requirement']} | {value} | {c['bound']} | "
            f"{'PASS' if c['passed'] else 'FAIL'} | {c['status']} |"
        )
    return "\n".join(lines)


def summary_markdown(
    rows: list[dict[str, Any]], cfg: dict[str, Any], info: dict[str, Any], crit: list[dict]
) -> str:
    arch = (
        "the SmolLM2-135M architecture"
        if cfg["model"] == "smollm2"
        else f"the `{cfg['model']}` architecture (quick profile)"
    )
    parts = [
        "# Per-unit norm cost: a long document as the privacy unit (issue 23, item 5)",
        "",
        f"Units of m windows of {cfg['window']} tokens on {arch} ({cfg['layers']} blocks, "
        "all trainable; tied embedding / LM head frozen). The unit's summed gradient of an "
        "`nn.Linear` is the per-sample gradient of its windows concatenated along the token "
        f"axis. `rc_unit`: randomized clipping, Hutchinson k = {cfg['k']}, one probe matrix per "
        "unit, 2 m T k (p + d) FLOPs per layer; `ghost_unit`: Opacus' ghost norm "
        "(`compute_linear_norm_sample`) on the concatenated unit, (mT) x (mT) Gram matrices; "
        "`per_sample_unit`: Opacus' per-sample gradients of the m windows "
        "(`compute_linear_grad_sample`) summed within the unit, then the norm. See "
        "`benchmarks/unit_cost.py` for how it measures.",
        "",
        info.get("machine_line") or common.machine_markdown(info),
        "",
    ]
    if crit:
        parts += ["## Floor (issue 23)", "", floor_table(crit), ""]
    if any(r["part"] == "norm" for r in rows):
        parts += [
            "## Per-unit norm of every Linear of the model (meta: FLOPs summed over the "
            "model's Linears, peak extra memory of the largest layer)",
            "",
            "In parentheses: the ratio to the Linears' own forward + backward FLOPs over the "
            "unit's tokens (6 m T p d summed over layers), and the log-log slope in tokens from "
            "the previous row (1: linear, 2: quadratic). Every FLOP count equals its closed form "
            "(`norm_methods.unit_closed_form_flops`).",
            "",
            norm_table(rows),
            "",
        ]
    if any(r["part"] == "time" for r in rows):
        d, p = cfg["time_layer"]
        parts += [
            f"## CPU wall time, one {d} -> {p} Linear, windows of {cfg['time_window']} tokens "
            "(median; ratio to rc_unit)",
            "",
            f"{info.get('torch_threads', '?')} torch thread(s), the three methods in turn in one "
            f"process, {cfg['repeats']} repeats after {cfg['warmup']} warm-up; load average "
            "(`uptime`) before -> after each size.",
            "",
            time_table(rows),
            "",
        ]
    if any(r["part"] == "step" for r in rows):
        parts += [
            f"## Whole step on one unit of {cfg['floor']['windows']} windows (meta)",
            "",
            "Ratios to the non-private step on the same tokens with the same checkpointing. "
            "`rc_bookkeeping`: each window its own unit; `rc_unit_bookkeeping`: the criterion's "
            "`units=` maps every window to one unit.",
            "",
            step_table(rows),
            "",
        ]
    return "\n".join(parts)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    norm = [r for r in rows if r["part"] == "norm"]
    if not norm:
        return
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, (col, label) in enumerate(
        (("flops", "per-unit norm FLOPs (all Linears)"), ("peak_extra_bytes", "peak extra bytes"))
    ):
        ax = axes[i]
        for j, method in enumerate(UNIT_METHODS):
            pts = sorted((r["tokens"], r[col]) for r in norm if r["method"] == method)
            ax.plot(*zip(*pts), marker="o", label=method, color=f"C{j}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per unit")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Per-unit gradient norm: linear (randomized) vs quadratic (ghost) in tokens")
    fig.tight_layout()
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--no-time", action="store_true", help="skip part 2 (CPU wall time)")
    parser.add_argument("--no-step", action="store_true", help="skip part 3 (the floor)")
    args = parser.parse_args(argv)
    cfg, out, device = common.resolve(args, NAME)
    if device.type != "cpu":
        raise SystemExit("unit_cost measures on meta and times on CPU; use --device cpu")
    started = time.perf_counter()
    info = common.machine_info(device)
    info["uptime_load_average"] = long_context.load_average()
    rows = norm_rows(cfg)
    if not args.no_time:
        rows += time_rows(cfg)
    if not args.no_step:
        rows += step_rows(cfg)
    crit = floors(rows, cfg) if not args.no_step else []
    info["uptime_load_average_after"] = long_context.load_average()
    info["run_minutes"] = round((time.perf_counter() - started) / 60, 1)
    stem = common.result_stem(NAME, cfg, device)
    common.write_csv(out / f"{stem}.csv", rows, COLUMNS)
    text = summary_markdown(rows, cfg, info, crit)
    common.write_text(out / f"{stem}.md", text)
    plot(rows, out / f"{stem}.png")
    print()
    print(text)
    for c in crit:
        value = "n/a" if c["value"] is None else f"{c['value']:.4f}"
        print(f"{'PASS' if c['passed'] else 'FAIL'} {c['requirement']}: {value} ({c['status']})")
    print(f"wrote {out / stem}.csv, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
