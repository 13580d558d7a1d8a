"""Print a short table of items 1 and 3 from their CSV files (the last thing gpu.sh prints).

Item 1: at the reference layer size and k, per T: time and peak extra memory of ghost, FGC and
Hutchinson. Item 3: per T, time and memory of every method as ratios to non-private.

Example::

    python -m benchmarks.summary_table --dir benchmarks/results --suffix _gpu
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from benchmarks import common


def _f(v: str) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def layer_table(path: Path, d: int, k: int) -> str:
    rows = common.read_csv(path)
    Ts = sorted({int(r["T"]) for r in rows if int(r["d"]) == d})
    out = [f"Item 1: nn.Linear d=p={d}, B={rows[0]['B']}, sketch k={k} ({path.name})"]
    out.append(f"{'T':>6} | {'ghost':>21} | {'fgc':>21} | {'hutchinson':>21}")
    for T in Ts:
        cells = []
        for m, kk in (("ghost", ""), ("fgc", ""), ("hutchinson", str(k))):
            r = next(
                (
                    x
                    for x in rows
                    if x["method"] == m and int(x["T"]) == T and int(x["d"]) == d and x["k"] == kk
                ),
                None,
            )
            if r is None:
                cells.append("-")
                continue
            t = _f(r["time_median_s"])
            time_s = common.fmt_seconds(t) if not math.isnan(t) else "n/t"
            cells.append(f"{time_s} {common.fmt_bytes(_f(r['peak_extra_bytes']))}")
        out.append(f"{T:>6} | " + " | ".join(f"{c:>21}" for c in cells))
    return "\n".join(out)


def training_table(path: Path) -> str:
    rows = common.read_csv(path)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    out = [f"Item 3: training step, time / memory vs non_private ({path.name})"]
    out.append(f"{'T':>6} | " + " | ".join(f"{m:>15}" for m in methods))
    for T in sorted({int(r["T"]) for r in rows}):
        cells = []
        for m in methods:
            r = next((x for x in rows if x["method"] == m and int(x["T"]) == T), None)
            if r is None or r.get("status") != "ok":
                cells.append((r or {}).get("status", "-")[:15])
                continue
            cells.append(f"{_f(r['time_ratio']):.2f}x/{_f(r['memory_ratio']):.2f}x")
        out.append(f"{T:>6} | " + " | ".join(f"{c:>15}" for c in cells))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, default=common.RESULTS_DIR, help="results folder")
    parser.add_argument("--suffix", default="", help="file-name suffix, e.g. _gpu")
    parser.add_argument("--d", type=int, default=None, help="layer width (default: largest)")
    parser.add_argument("--k", type=int, default=None, help="sketch k (default: the CSV's k_ref)")
    args = parser.parse_args(argv)
    layer_csv = args.dir / f"layer_norm_cost{args.suffix}.csv"
    train_csv = args.dir / f"training_step{args.suffix}.csv"
    status = 0
    if layer_csv.exists():
        rows = common.read_csv(layer_csv)
        ds = sorted({int(r["d"]) for r in rows})
        ks = sorted({int(r["k"]) for r in rows if r["k"]})
        d = args.d or (1024 if 1024 in ds else ds[-1])
        k = args.k or (32 if 32 in ks else ks[len(ks) // 2])
        print(layer_table(layer_csv, d, k))
    else:
        print(f"missing {layer_csv}")
        status = 1
    print()
    if train_csv.exists():
        print(training_table(train_csv))
    else:
        print(f"missing {train_csv}")
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
