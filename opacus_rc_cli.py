"""Launcher of the ``opacus-rc`` console script: the command line without the library.

This module is outside the package, so ``opacus-rc --help``, ``--version`` and an invalid
command line are answered from the standard library alone; :func:`main` imports
:mod:`opacus_rc.cli` only to compute a figure, and that imports the accountant (numpy, scipy,
prv-accountant), neither PyTorch nor Opacus (``opacus-rc epsilon`` for 1000 steps: about 1 s).
:mod:`opacus_rc.cli` re-exports :func:`arg_parser`, :func:`main` and :data:`EXAMPLES`.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ENVELOPE_NAMES", "EXAMPLES", "THREAT_MODEL_NAMES", "arg_parser", "main"]

#: Names of ``opacus_rc.accountants.analysis.envelope.ENVELOPES`` (tests/test_cli.py checks
#: that they are the registry's, so that the help need not import it).
ENVELOPE_NAMES = ("chi2", "schur", "chernoff")
#: Names of ``opacus_rc.accountants.analysis.threat_models.THREAT_MODELS`` (checked likewise).
THREAT_MODEL_NAMES = ("hidden", "revealed")


def _version() -> str:
    """``opacus_rc.version.__version__``, read from the file next to this one (the same tree)
    without importing the package; the installed metadata if the file is not there."""
    path = Path(__file__).resolve().with_name("opacus_rc") / "version.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except OSError:
        return importlib.metadata.version("opacus_rc")
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            return str(ast.literal_eval(node.value))
    raise RuntimeError(f"no __version__ in {path}")  # pragma: no cover - broken install


#: A complete command line per subcommand (shown in --help and in missing-option errors).
EXAMPLES = {
    "epsilon": "opacus-rc epsilon --noise-multiplier 1.0 --sample-rate 0.01 --steps 1000 "
    "--delta 1e-5 --sketch-dim 32",
    "noise-multiplier": "opacus-rc noise-multiplier --target-epsilon 3 --sample-rate 0.01 "
    "--epochs 10 --delta 1e-5 --sketch-dim 16 32 64",
}
#: The noise search at a run's schedule, from its public sizes (shown in --help).
SIZES_EXAMPLE = (
    "opacus-rc noise-multiplier --target-epsilon 3 --dataset-size 60000 --batch-size 256 "
    "--epochs 3 --delta 1e-5 --sketch-dim 32"
)
#: Options each subcommand needs, as (destination(s), how the error names them).
_REQUIRED = {
    "epsilon": ((("noise_multiplier",), "--noise-multiplier (-s)"),),
    "noise-multiplier": ((("target_epsilon",), "--target-epsilon (-e)"),),
}
_COMMON_REQUIRED = (
    (
        ("sample_rate", "num_batches", "dataset_size"),
        "the rate: --sample-rate (-q), --num-batches or --dataset-size with --batch-size",
    ),
    (("steps", "epochs"), "one of --steps or --epochs"),
)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0.0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    rate = p.add_argument_group(
        "sampling (one of)",
        "The public sizes of a run (--num-batches, or --dataset-size with --batch-size) give "
        "the schedule make_private_with_epsilon accounts: Poisson rate 1/n over n batches, "
        "int(1/q) steps per epoch each accounted at 1/int(1/q). A bare --sample-rate is "
        "accounted as given, for int(epochs / q) steps (Opacus' get_noise_multiplier); the "
        "output says which schedule was used.",
    )
    rate.add_argument(
        "--sample-rate",
        "-q",
        type=float,
        help="Poisson sampling probability q of each step, in (0, 1] (expected batch size / "
        "dataset size).",
    )
    rate.add_argument(
        "--num-batches",
        type=_positive_int,
        help="batches n of the run's data loader (len(loader)); the Poisson rate is 1/n.",
    )
    rate.add_argument(
        "--dataset-size",
        type=_positive_int,
        help="public number of records N (needs --batch-size): n = ceil(N / B) batches "
        "(floor with --drop-last), as make_private's dataset_size.",
    )
    rate.add_argument("--batch-size", type=_positive_int, help="the loader's batch size B.")
    rate.add_argument(
        "--drop-last", action="store_true", help="the loader's drop_last (with --dataset-size)."
    )
    length = p.add_mutually_exclusive_group()
    length.add_argument(
        "--steps", type=int, help="number of optimizer steps (>= 0); this or --epochs is required."
    )
    length.add_argument(
        "--epochs",
        type=_positive_float,
        help="number of epochs (> 0); steps = int(epochs / sample_rate), as in Opacus.",
    )
    p.add_argument(
        "--delta",
        type=float,
        default=1e-5,
        help="target delta of (epsilon, delta)-DP, in (0, 1) (default: 1e-5).",
    )
    p.add_argument(
        "--sketch-dim",
        "-k",
        type=_positive_int,
        nargs="+",
        default=[32],
        metavar="K",
        help="sketch columns k of randomized clipping, one column of output per value "
        "(default: 32). For Hutch++ give the tail columns "
        "(docs/privacy/hutchpp.md#hutchpp-privacy).",
    )
    p.add_argument(
        "--threat-model",
        choices=THREAT_MODEL_NAMES,
        default="hidden",
        help="'hidden' (default): per-sample secret sketches; 'revealed': the paper's analysis, "
        "valid for any sketch sharing.",
    )
    p.add_argument(
        "--envelope",
        choices=ENVELOPE_NAMES,
        default="chi2",
        help="law of the worst-case sensitivity: 'chi2' (default, the paper's), 'schur' "
        "(proved: Schur-convexity region plus a convex-order bound) or 'chernoff' (proved, "
        "the most conservative).",
    )
    p.add_argument(
        "--eps-error",
        type=_positive_float,
        default=0.01,
        help="discretisation error of the PRV accountant, in units of epsilon (default: 0.01).",
    )


def arg_parser() -> argparse.ArgumentParser:
    """The ``opacus-rc`` argument parser (subcommands ``epsilon`` and ``noise-multiplier``)."""
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The argument parser and its sub-parser per subcommand (kept as built: ``argparse`` has
    no public lookup of a sub-parser, which a missing-option error needs for its usage line)."""
    parser = argparse.ArgumentParser(
        prog="opacus-rc",
        description="Privacy accounting for DP-SGD with randomized clipping (opacus_rc): "
        "epsilon or noise multiplier for exact clipping and for sketched norms, side by side.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    eps = sub.add_parser(
        "epsilon",
        help="epsilon spent by a training run",
        epilog=f"example: {EXAMPLES['epsilon']}",
        description="Upper bound on epsilon at the given delta, max over the remove and add "
        "directions, for exact clipping and for randomized clipping with each sketch dimension.",
    )
    eps.add_argument(
        "--noise-multiplier",
        "-s",
        type=float,
        help="noise multiplier sigma: noise standard deviation divided by the clipping bound "
        "(> 0); required.",
    )
    _add_common(eps)
    nm = sub.add_parser(
        "noise-multiplier",
        help="noise multiplier needed for a target epsilon",
        epilog=f"examples: {EXAMPLES['noise-multiplier']}; at the schedule of a run over "
        f"60000 records in batches of 256: {SIZES_EXAMPLE}",
        description="Smallest noise multiplier (noise std / clipping bound) whose epsilon "
        "upper bound is at most the target, for exact clipping and randomized clipping.",
    )
    nm.add_argument(
        "--target-epsilon",
        "-e",
        type=_positive_float,
        help="target epsilon (> 0) at the given delta; required.",
    )
    nm.add_argument(
        "--epsilon-tolerance",
        type=_positive_float,
        default=0.01,
        help="accepted shortfall of epsilon below the target (default: 0.01).",
    )
    _add_common(nm)
    return parser, {"epsilon": eps, "noise-multiplier": nm}


def _missing(args: argparse.Namespace) -> list[str]:
    """The required options absent from ``args``, named as the user types them."""
    out = []
    for dests, name in (*_REQUIRED[args.command], *_COMMON_REQUIRED):
        if all(getattr(args, d) is None for d in dests):
            out.append(name)
    return out


def _conflicts(args: argparse.Namespace) -> str | None:
    """What is wrong with the sampling options given together, or None."""
    given = [
        name
        for name, dest in (
            ("--sample-rate", "sample_rate"),
            ("--num-batches", "num_batches"),
            ("--dataset-size", "dataset_size"),
        )
        if getattr(args, dest) is not None
    ]
    if len(given) > 1:
        return f"give one of {' or '.join(given)}, not both: each sets the sampling rate"
    if (args.dataset_size is None) != (args.batch_size is None):
        return "--dataset-size and --batch-size go together (n = ceil(N / B) batches)"
    if args.drop_last and args.dataset_size is None:
        return "--drop-last applies to --dataset-size with --batch-size"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``opacus-rc`` console script; returns the exit status.

    Args:
        argv: Arguments without the program name; default ``sys.argv[1:]``.

    Returns:
        0 on success, 2 on invalid input (argparse's convention; a missing option is named
        with a complete example command), 1 if a figure cannot be computed.
    """
    parser, subcommands = _parsers()
    args = parser.parse_args(argv)
    missing = _missing(args)
    if missing:
        subcommands[args.command].error(
            f"missing {', '.join(missing)}; a complete command is: {EXAMPLES[args.command]}"
        )
    conflict = _conflicts(args)
    if conflict:
        subcommands[args.command].error(conflict)
    from opacus_rc.cli import run  # the library: imported only to compute

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
