"""Run the whole benchmark set in sequence, one process per item.

Items: issue 5's 1-4 (``layer_norm_cost``, ``estimate_quality``, ``training_step``,
``privacy_cost``), issue 12's ``host_syncs``, issue 13's ``long_context`` (its full grid takes
about an hour on the 2-core CPU machine; ``--only`` picks items) and issue 23's ``unit_cost``
(about a minute and a half).

Examples::

    python -m benchmarks.run_all                 # full CPU set -> benchmarks/results (~1.5 h)
    python -m benchmarks.run_all --quick         # CI size, about a minute
    python -m benchmarks.run_all --only layer_norm_cost privacy_cost

Each item's own options (``--profile``, ``--device``, ``--out``, ``--threads``) are passed on.
The run ends with the short table of items 1 and 3 (``benchmarks.summary_table``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from benchmarks import common

ITEMS = (
    "layer_norm_cost",
    "estimate_quality",
    "training_step",
    "privacy_cost",
    "host_syncs",
    "long_context",
    "unit_cost",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", choices=ITEMS, default=list(ITEMS))
    parser.add_argument("--quick", action="store_true", help="CI-size profile for every item")
    parser.add_argument("--profile", choices=common.PROFILES, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    passed = []
    for flag in ("profile", "device", "out", "threads"):
        value = getattr(args, flag)
        if value is not None:
            passed += [f"--{flag}", str(value)]
    if args.quick:
        passed.append("--quick")
    failed = []
    durations = {}
    for item in args.only:
        start = time.perf_counter()
        print(f"=== {item} {' '.join(passed)}", flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", f"benchmarks.{item}", *passed], cwd=common.REPO_ROOT
        )
        durations[item] = time.perf_counter() - start
        if proc.returncode != 0:
            failed.append(item)
        print(
            f"=== {item}: exit {proc.returncode} after {durations[item] / 60:.1f} min", flush=True
        )
    print()
    for item, secs in durations.items():
        print(f"{item:>18}: {secs / 60:5.1f} min{'  FAILED' if item in failed else ''}")
    print(f"{'total':>18}: {sum(durations.values()) / 60:5.1f} min")
    if "layer_norm_cost" in args.only and "training_step" in args.only:
        out = args.out or (common.QUICK_RESULTS_DIR if args.quick else common.RESULTS_DIR)
        cuda = (args.device or "").startswith("cuda") or args.profile == "gpu"
        print()
        common_args = ["--dir", str(out)] + (["--suffix", "_gpu"] if cuda else [])
        subprocess.run(
            [sys.executable, "-m", "benchmarks.summary_table", *common_args], cwd=common.REPO_ROOT
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
