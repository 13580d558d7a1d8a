"""Item 1 of issue 5: cost of per-sample gradient norms of one nn.Linear over sequences.

Methods (``benchmarks/norm_methods.py``): Opacus ghost norm, Opacus materialized per-sample
gradients (FGC), the mixed rule min(ghost, FGC) of fastDP / private-transformers, and
opacus_rc's sketched sampler with Hutchinson and Hutch++ (``k`` columns, Hutch++ head ``s = k``),
on Gaussian activations ``A`` (B, T, d) and output gradients ``G`` (B, T, p = d), bias included.

For every configuration it reports

* ``flops``: FlopCounterMode total (matrix products; deterministic), next to the closed form;
* ``peak_extra_bytes``: peak memory allocated by the norm computation on top of its inputs. On
  CPU a TorchDispatchMode tracks live tensor bytes; Opacus' methods are measured on ``meta``
  tensors (shapes only, identical numbers, so even configurations that do not fit are measured)
  and opacus_rc's on real tensors. On CUDA: the caching allocator (``max_memory_allocated``);
* ``time_median_s``: median wall time of ``repeats`` calls after ``warmup`` calls.

Configurations whose inputs plus extra memory exceed ``memory_budget_gib`` are not run and are
marked ``skipped: would need X GiB``; their FLOPs and memory are still reported (from ``meta``).
Calls planned to take longer than ``max_call_seconds`` are marked ``not timed``.

Examples::

    python -m benchmarks.layer_norm_cost --quick            # CI size, seconds
    python -m benchmarks.layer_norm_cost --plan             # planned wall time of the full run
    python -m benchmarks.layer_norm_cost                    # full CPU grid -> benchmarks/results
    python -m benchmarks.layer_norm_cost --device cuda      # gpu profile
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import common
from benchmarks.norm_methods import (
    EXACT_METHODS,
    closed_form_flops,
    estimated_extra_bytes,
    get_method,
    mixed_choice,
)

NAME = "layer_norm_cost"
COLUMNS = [
    "method",
    "B",
    "T",
    "d",
    "p",
    "k",
    "bias",
    "flops",
    "flops_closed_form",
    "peak_extra_bytes",
    "memory_source",
    "time_median_s",
    "time_min_s",
    "repeats",
    "status",
    "note",
    "device",
]


def _configs(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows to measure, in order: for each (d, T), the exact methods, then the sketches."""
    out = []
    for d in cfg["d"]:
        for T in cfg["T"]:
            for method in cfg["methods"]:
                ks = cfg["k"] if method not in EXACT_METHODS else [None]
                for k in ks:
                    out.append({"method": method, "B": cfg["B"], "T": T, "d": d, "p": d, "k": k})
    return out


def _planned_seconds(row: dict[str, Any], rate: float, bandwidth: float) -> float:
    """Rough time of one call: FLOPs at the measured GEMM rate plus passes over the inputs."""
    B, T, d, p = row["B"], row["T"], row["d"], row["p"]
    flops = closed_form_flops(row["method"], B=B, T=T, d=d, p=p, k=row["k"], bias=True)
    method = mixed_choice(T, p, d) if row["method"] == "mixed" else row["method"]
    passes = 3 if method in ("hutchinson", "hutch++") else 2
    traffic = passes * 4 * B * T * (d + p)
    if method == "ghost":
        traffic += 4 * 4 * B * T * T  # write and read the Grams
    return flops / rate + traffic / bandwidth


def plan(cfg: dict[str, Any], rate: float) -> tuple[float, list[str]]:
    """Planned total wall time (s) of a run and one line per configuration."""
    bandwidth = cfg["bandwidth_gb_s"] * 1e9
    total = 0.0
    lines = []
    budget = cfg["memory_budget_gib"] * common.GiB
    for row in _configs(cfg):
        if row["method"] == "mixed":
            continue  # reuses the chosen method's measurement
        secs = _planned_seconds(row, rate, bandwidth)
        need = _need_bytes(row, cfg["bias"])
        if need > budget:
            status = common.skipped_memory(need)
            spent = 0.0
        elif secs > cfg["max_call_seconds"]:
            status, spent = f"not timed (~{secs:.0f} s per call)", 0.0
        else:
            n_calls = _n_calls(cfg, secs)
            status, spent = f"{n_calls} calls of ~{secs:.2g} s", n_calls * secs
        if row["method"] not in EXACT_METHODS:
            spent += 2 * secs  # FLOP and memory measurement calls
        total += spent
        lines.append(f"{row['method']:>10} d={row['d']:<5} T={row['T']:<6} k={row['k']}: {status}")
    return total, lines


def _n_calls(cfg: dict[str, Any], secs: float) -> int:
    if secs > cfg["slow_call_seconds"]:
        return 1
    return cfg["repeats"] + cfg["warmup"]


def _need_bytes(row: dict[str, Any], bias: bool) -> int:
    B, T, d, p = row["B"], row["T"], row["d"], row["p"]
    inputs = 4 * B * T * (d + p)
    return inputs + estimated_extra_bytes(row["method"], B=B, T=T, d=d, p=p, k=row["k"], bias=bias)


def _measure_meta(method: str, B: int, T: int, d: int, p: int, bias: bool) -> tuple[int, int]:
    """FLOPs and peak extra bytes of an exact (data-independent) method on ``meta`` tensors."""
    layer = nn.Linear(d, p, bias=bias, device="meta")
    A = torch.empty(B, T, d, device="meta")
    G = torch.empty(B, T, p, device="meta")
    fn = get_method(method)
    _, flops = common.count_flops(lambda: fn(layer, A, G))
    mem, _ = common.peak_extra_bytes(lambda: fn(layer, A, G), torch.device("meta"))
    return flops, mem


def run(
    cfg: dict[str, Any],
    device: torch.device,
    *,
    timed: bool = True,
    log: Any = print,
    on_row: Any = None,
) -> list[dict[str, Any]]:
    """Measure every configuration of ``cfg``; return the CSV rows.

    With ``timed=False`` only the deterministic columns (FLOPs, memory) are measured.
    ``on_row(rows)`` is called after every row (to save partial results).
    """
    torch.manual_seed(cfg["seed"])
    budget = cfg["memory_budget_gib"] * common.GiB
    rate = common.gemm_rate(device)
    bias = cfg["bias"]
    rows: list[dict[str, Any]] = []
    by_key: dict[tuple, dict[str, Any]] = {}
    inputs: dict[tuple[int, int], tuple[nn.Linear, torch.Tensor, torch.Tensor]] = {}
    for spec in _configs(cfg):
        method, B, T, d, p, k = (spec[c] for c in ("method", "B", "T", "d", "p", "k"))
        row: dict[str, Any] = {**spec, "bias": bias, "device": str(device), "note": ""}
        row["flops_closed_form"] = closed_form_flops(method, B=B, T=T, d=d, p=p, k=k, bias=bias)
        if method == "mixed":
            chosen = mixed_choice(T, p, d)
            row.update(
                {
                    c: by_key[(chosen, B, T, d, k)].get(c)
                    for c in COLUMNS
                    if c not in ("method", "k", "note")
                }
            )
            row["note"] = f"2T^2 {'<=' if chosen == 'ghost' else '>'} pd: uses {chosen}"
            rows.append(row)
            continue
        need = _need_bytes(spec, bias)
        if method in EXACT_METHODS:
            row["flops"], row["peak_extra_bytes"] = _measure_meta(method, B, T, d, p, bias)
            row["memory_source"] = "dispatch-tracker (meta)"
            need = 4 * B * T * (d + p) + row["peak_extra_bytes"]
        fits = need <= budget
        if fits and (d, T) not in inputs:
            inputs.clear()  # free the previous inputs first
            gen = torch.Generator(device="cpu").manual_seed(cfg["seed"] + T + d)
            A = torch.randn(B, T, d, generator=gen).to(device)
            G = torch.randn(B, T, p, generator=gen).to(device)
            layer = nn.Linear(d, p, bias=bias, device=device)
            inputs[(d, T)] = (layer, A, G)
        if not fits:
            row["status"] = common.skipped_memory(need)
            if method not in EXACT_METHODS:  # not expected: sketches are small
                row["flops"] = row["flops_closed_form"]
        else:
            layer, A, G = inputs[(d, T)]
            fn = get_method(method)
            gen = torch.Generator(device=device).manual_seed(cfg["seed"])

            def call(fn=fn, layer=layer, A=A, G=G, k=k, gen=gen):
                return fn(layer, A, G, k=k, generator=gen)

            secs = _planned_seconds(spec, rate, cfg["bandwidth_gb_s"] * 1e9)
            too_slow = secs > cfg["max_call_seconds"]
            if method not in EXACT_METHODS:
                _, row["flops"] = common.count_flops(call)
            if device.type == "cuda" and not too_slow:
                call()  # first call: cuBLAS/cuSOLVER workspaces are not the method's memory
            if method not in EXACT_METHODS or (device.type == "cuda" and not too_slow):
                row["peak_extra_bytes"], row["memory_source"] = common.peak_extra_bytes(
                    call, device
                )
            if not timed:
                row["status"] = "not timed (--no-time)"
            elif too_slow:
                row["status"] = f"not timed: ~{secs:.0f} s per call"
            else:
                slow = secs > cfg["slow_call_seconds"]
                times = common.time_calls(
                    call,
                    repeats=1 if slow else cfg["repeats"],
                    warmup=0 if slow else cfg["warmup"],
                    device=device,
                )
                row["time_median_s"] = common.median(times)
                row["time_min_s"] = min(times)
                row["repeats"] = len(times)
                row["status"] = "ok"
        by_key[(method, B, T, d, k)] = row
        rows.append(row)
        if on_row is not None:
            on_row(rows)
        log(
            f"{method:>10} d={d:<5} T={T:<6} k={k!s:<4} flops={common.fmt_flops(row.get('flops'))}"
            f" mem={common.fmt_bytes(row.get('peak_extra_bytes'))}"
            f" time={common.fmt_seconds(row.get('time_median_s'))} {row['status']}"
        )
    return rows


# ----------------------------------------------------------------------------------------------
# Floors, summary and plots
# ----------------------------------------------------------------------------------------------


def _key(v: Any) -> str:
    return "" if v is None else str(v)


def _find(rows: list[dict[str, Any]], **where: Any) -> dict[str, Any] | None:
    """The first row whose columns equal ``where`` (compared as CSV text; ``None`` == "")."""
    for row in rows:
        if all(_key(row.get(c)) == _key(v) for c, v in where.items()):
            return row
    return None


def check_floors(rows: list[dict[str, Any]], floors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Evaluate the issue's floors: ``metric(method) / metric(baseline) <= max_ratio``."""
    results = []
    for floor in floors:
        where = dict(floor["where"])
        ours = _find(rows, method=floor["method"], **where)
        where.pop("k", None)
        base = _find(rows, method=floor["baseline"], k=None, **where)
        result = {**floor, "value": None, "baseline_value": None, "ratio": None, "passed": None}
        metric = floor["metric"]
        v = _num(ours.get(metric)) if ours else math.nan
        b = _num(base.get(metric)) if base else math.nan
        if not (math.isnan(v) or math.isnan(b)):
            result.update(
                value=v, baseline_value=b, ratio=v / b, passed=v / b <= floor["max_ratio"]
            )
        results.append(result)
    return results


def _floors_markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| floor | ours | baseline | ratio | required | result |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        where = ", ".join(f"{k}={v}" for k, v in r["where"].items())
        fmt = common.fmt_flops if r["metric"] == "flops" else common.fmt_bytes
        verdict = "not measured" if r["passed"] is None else ("PASS" if r["passed"] else "FAIL")
        lines.append(
            f"| {r['metric']} of {r['method']} vs {r['baseline']} ({where}) | {fmt(r['value'])} "
            f"| {fmt(r['baseline_value'])} | {common.fmt_ratio(r['ratio'])} "
            f"| <= {common.fmt_ratio(r['max_ratio'])} | {verdict} |"
        )
    return "\n".join(lines)


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def summary_markdown(
    rows: list[dict[str, Any]], cfg: dict[str, Any], floors: list[dict[str, Any]], info: dict
) -> str:
    k_ref = cfg["k_reference"]
    parts = [
        "# Per-layer norm estimation cost (issue 5, item 1)",
        "",
        f"nn.Linear d = p, B = {cfg['B']}, bias = {cfg['bias']}, fp32, Gaussian inputs. "
        f"Sketches at k = {k_ref} below (all k in the CSV). FLOPs: FlopCounterMode (matrix "
        "products). Memory: peak extra bytes of the norm computation (dispatch tracker of live "
        "tensor bytes on CPU, `meta` tensors for Opacus' methods; CUDA allocator on GPU). Time: "
        "median wall time.",
        "",
        common.machine_markdown(info),
        "",
        "## Floors",
        "",
        _floors_markdown(floors),
        "",
    ]
    methods = list(cfg["methods"])
    for title, col, fmt in (
        ("FLOPs", "flops", common.fmt_flops),
        ("Peak extra memory", "peak_extra_bytes", common.fmt_bytes),
        ("Wall time (median)", "time_median_s", common.fmt_seconds),
    ):
        parts += [f"## {title}", ""]
        table = []
        for d in cfg["d"]:
            for T in cfg["T"]:
                line: dict[str, Any] = {"d": d, "T": T}
                for m in methods:
                    k = None if m in EXACT_METHODS else k_ref
                    r = _find(rows, method=m, T=T, d=d, k=k)
                    if r is None:
                        line[m] = ""
                    elif math.isnan(_num(r.get(col))):
                        line[m] = str(r.get("status", ""))
                    else:
                        line[m] = fmt(r[col])
                        if col == "time_median_s" and r.get("status") != "ok":
                            line[m] = str(r.get("status", ""))
                ghost = _find(rows, method="ghost", T=T, d=d, k=None)
                ours = _find(rows, method="hutchinson", T=T, d=d, k=k_ref)
                if ghost and ours:
                    ratio = _num(ours.get(col)) / _num(ghost.get(col))
                    line["ratio"] = common.fmt_ratio(ratio) if not math.isnan(ratio) else ""
                table.append(line)
        headers = ["d", "T", *[m if m in EXACT_METHODS else f"{m} k={k_ref}" for m in methods]]
        parts += [
            common.markdown_table(
                table, ["d", "T", *methods, "ratio"], [*headers, "hutchinson / ghost"]
            ),
            "",
        ]
    skipped = [r for r in rows if str(r.get("status", "")).startswith("skipped")]
    if skipped:
        parts += [
            "## Skipped (do not fit in memory)",
            "",
            ", ".join(
                sorted({f"{r['method']} d={r['d']} T={r['T']} ({r['status']})" for r in skipped})
            ),
            "",
        ]
    return "\n".join(parts)


def plot(rows: list[dict[str, Any]], cfg: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    k_ref = cfg["k_reference"]
    ds = cfg["d"]
    metrics = [
        ("flops", "FLOPs"),
        ("peak_extra_bytes", "peak extra memory (bytes)"),
        ("time_median_s", "median time (s)"),
    ]
    metrics = [m for m in metrics if any(not math.isnan(_num(r.get(m[0]))) for r in rows)]
    other_styles = iter([":", "--", "-."] * 4)
    k_styles = {k: ("-" if k == k_ref else next(other_styles)) for k in cfg["k"]}
    fig, axes = plt.subplots(
        len(metrics), len(ds), figsize=(4.2 * len(ds), 3.2 * len(metrics)), squeeze=False
    )
    styles = {
        "ghost": ("tab:red", "o"),
        "fgc": ("tab:orange", "s"),
        "mixed": ("tab:gray", "x"),
        "hutchinson": ("tab:blue", "^"),
        "hutch++": ("tab:green", "v"),
    }
    for j, d in enumerate(ds):
        for i, (col, label) in enumerate(metrics):
            ax = axes[i][j]
            for m in cfg["methods"]:
                ks = [None] if m in EXACT_METHODS else cfg["k"]
                for k in ks:
                    pts = [
                        (r["T"], _num(r.get(col)))
                        for r in rows
                        if r["method"] == m and r["d"] == d and r["k"] == k
                    ]
                    pts = [(t, v) for t, v in pts if not math.isnan(v) and v > 0]
                    if not pts:
                        continue
                    color, marker = styles.get(m, ("k", "."))
                    ls = "-" if k is None else k_styles[k]
                    name = m if k is None else f"{m} k={k}"
                    ax.plot(*zip(*pts), ls=ls, marker=marker, color=color, label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("T")
            ax.set_title(f"{label}, d=p={d}", fontsize=9)
            ax.grid(True, which="major", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    parser.add_argument(
        "--plan", action="store_true", help="print the planned wall time of the run and exit"
    )
    parser.add_argument("--strict", action="store_true", help="exit with status 1 if a floor fails")
    parser.add_argument(
        "--no-time",
        action="store_true",
        help="measure only the deterministic columns (FLOPs, memory); no wall times",
    )
    args = parser.parse_args(argv)
    cfg, out, device = common.resolve(args, NAME)
    if args.plan:
        rate = common.gemm_rate(device)
        total, lines = plan(cfg, rate)
        print("\n".join(lines))
        print(f"GEMM rate {rate / 1e9:.1f} GFLOP/s; planned total {total / 60:.1f} min")
        return 0
    info = common.machine_info(device)
    stem = common.result_stem(NAME, cfg, device)
    rows = run(
        cfg,
        device,
        timed=not args.no_time,
        on_row=lambda rows: common.write_csv(out / f"{stem}.csv", rows, COLUMNS),
    )
    common.write_csv(out / f"{stem}.csv", rows, COLUMNS)
    floors = check_floors(rows, cfg.get("floors", []))
    common.write_text(out / f"{stem}.md", summary_markdown(rows, cfg, floors, info))
    plot(rows, cfg, out / f"{stem}.png")
    print(_floors_markdown(floors))
    print(f"wrote {out / stem}.csv, .md, .png")
    failed = [f for f in floors if f["passed"] is False]
    return 1 if (failed and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
