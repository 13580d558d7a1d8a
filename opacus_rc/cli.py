"""``opacus-rc``: privacy figures of DP-SGD with randomized clipping next to exact clipping.

Examples::

    opacus-rc epsilon --noise-multiplier 1.0 --sample-rate 0.01 --steps 1000 --delta 1e-5 \\
        --sketch-dim 32
    opacus-rc noise-multiplier --target-epsilon 3 --sample-rate 0.01 --epochs 10 --delta 1e-5 \\
        --sketch-dim 16 32 64

Every figure is an upper bound on epsilon (the maximum over the remove and add adjacency
directions) from :class:`opacus_rc.accountants.RCAccountant`; the first column is always exact
clipping (plain DP-SGD), the others randomized clipping with ``k`` sketch columns.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from opacus_rc._compat.stdlib import subcommand_parser
from opacus_rc.accountants import (
    EpsilonOutOfRangeError,
    NumericalLimitError,
    RCAccountant,
    get_noise_multiplier,
)
from opacus_rc.accountants.analysis.envelope import ENVELOPES
from opacus_rc.accountants.analysis.threat_models import THREAT_MODELS
from opacus_rc.sketching import SketchSpec
from opacus_rc.version import __version__

__all__ = ["EXAMPLES", "arg_parser", "main"]

#: A complete command line per subcommand (shown in --help and in missing-option errors).
EXAMPLES = {
    "epsilon": "opacus-rc epsilon --noise-multiplier 1.0 --sample-rate 0.01 --steps 1000 "
    "--delta 1e-5 --sketch-dim 32",
    "noise-multiplier": "opacus-rc noise-multiplier --target-epsilon 3 --sample-rate 0.01 "
    "--epochs 10 --delta 1e-5 --sketch-dim 16 32 64",
}
#: Options each subcommand needs, as (destination(s), how the error names them).
_REQUIRED = {
    "epsilon": ((("noise_multiplier",), "--noise-multiplier (-s)"),),
    "noise-multiplier": ((("target_epsilon",), "--target-epsilon (-e)"),),
}
_COMMON_REQUIRED = (
    (("sample_rate",), "--sample-rate (-q)"),
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
    p.add_argument(
        "--sample-rate",
        "-q",
        type=float,
        help="Poisson sampling probability q of each step, in (0, 1] (expected batch size / "
        "dataset size); required.",
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
        choices=THREAT_MODELS,
        default="hidden",
        help="'hidden' (default): per-sample secret sketches; 'revealed': the paper's analysis, "
        "valid for any sketch sharing.",
    )
    p.add_argument(
        "--envelope",
        choices=ENVELOPES,
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
    parser = argparse.ArgumentParser(
        prog="opacus-rc",
        description="Privacy accounting for DP-SGD with randomized clipping (opacus_rc): "
        "epsilon or noise multiplier for exact clipping and for sketched norms, side by side.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
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
        epilog=f"example: {EXAMPLES['noise-multiplier']}",
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
    return parser


def _missing(args: argparse.Namespace) -> list[str]:
    """The required options absent from ``args``, named as the user types them."""
    out = []
    for dests, name in (*_REQUIRED[args.command], *_COMMON_REQUIRED):
        if all(getattr(args, d) is None for d in dests):
            out.append(name)
    return out


def _steps(args: argparse.Namespace) -> int:
    if args.steps is not None:
        if args.steps < 0:
            raise ValueError(f"--steps must be >= 0, got {args.steps}")
        return args.steps
    return int(args.epochs / args.sample_rate)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cols = [header, *rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in cols]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _run_epsilon(args: argparse.Namespace) -> str:
    steps = _steps(args)
    header = ["", "exact clipping"] + [f"k = {k}" for k in args.sketch_dim]
    upper, estimate, remove, add = ["epsilon (upper)"], ["estimate"], ["remove"], ["add"]
    notes: list[str] = []
    for k in [None, *args.sketch_dim]:
        acc = RCAccountant(
            envelope=args.envelope, threat_model=args.threat_model, eps_error=args.eps_error
        )
        spec = None if k is None else SketchSpec(estimator="hutchinson", sketch_dim=k).to_dict()
        acc.history = [(args.noise_multiplier, args.sample_rate, steps, spec)]
        try:
            rep = acc.get_epsilon_report(args.delta)
        except (EpsilonOutOfRangeError, NumericalLimitError) as err:
            # out of range: epsilon exceeds what the analysis certifies (a privacy answer);
            # numerical limit: not computable at this --eps-error (no statement about epsilon)
            limit = isinstance(err, NumericalLimitError)
            upper.append("numerical limit" if limit else "out of range")
            notes.append(f"{'exact clipping' if k is None else f'k = {k}'}: {err}")
            estimate.append("-")
            remove.append("-")
            add.append("-")
            continue
        upper.append(f"{rep.upper:.4f}")
        estimate.append(f"{rep.estimate:.4f}")
        remove.append(f"{rep.remove[2]:.4f}")
        add.append(f"{rep.add[2]:.4f}")
    title = (
        f"epsilon at delta={args.delta:g}: noise multiplier {args.noise_multiplier:g}, "
        f"sample rate {args.sample_rate:g}, {steps} steps, threat model {args.threat_model}, "
        f"envelope {args.envelope}"
    )
    return "\n".join([title, _table(header, [upper, estimate, remove, add]), *notes])


def _run_noise(args: argparse.Namespace) -> str:
    steps = _steps(args)
    if steps < 1:
        raise ValueError("noise-multiplier needs at least one step")
    template = RCAccountant(
        envelope=args.envelope, threat_model=args.threat_model, eps_error=args.eps_error
    )
    header = ["", "exact clipping"] + [f"k = {k}" for k in args.sketch_dim]
    sigmas, ratios = ["noise multiplier"], ["ratio to exact"]
    base = None
    for k in [None, *args.sketch_dim]:
        spec = None if k is None else SketchSpec(estimator="hutchinson", sketch_dim=k)
        sigma = get_noise_multiplier(
            target_epsilon=args.target_epsilon,
            target_delta=args.delta,
            sample_rate=args.sample_rate,
            steps=steps,
            sketch_spec=spec,
            accountant=template,
            epsilon_tolerance=args.epsilon_tolerance,
        )
        base = sigma if base is None else base
        sigmas.append(f"{sigma:.4f}")
        ratios.append(f"{sigma / base:.3f}")
    title = (
        f"noise multiplier for epsilon={args.target_epsilon:g} at delta={args.delta:g}: "
        f"sample rate {args.sample_rate:g}, {steps} steps, threat model {args.threat_model}, "
        f"envelope {args.envelope}"
    )
    return title + "\n" + _table(header, [sigmas, ratios])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``opacus-rc`` console script; returns the exit status.

    Args:
        argv: Arguments without the program name; default ``sys.argv[1:]``.

    Returns:
        0 on success, 2 on invalid input (argparse's convention; a missing option is named
        with a complete example command), 1 if a figure cannot be computed.
    """
    parser = arg_parser()
    args = parser.parse_args(argv)
    missing = _missing(args)
    if missing:
        subcommand_parser(parser, args.command).error(
            f"missing {', '.join(missing)}; a complete command is: {EXAMPLES[args.command]}"
        )
    try:
        out = _run_epsilon(args) if args.command == "epsilon" else _run_noise(args)
    except (ValueError, TypeError) as err:
        print(f"opacus-rc: error: {err}", file=sys.stderr)
        return 2
    except (EpsilonOutOfRangeError, NumericalLimitError) as err:
        print(f"opacus-rc: error: {err}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
