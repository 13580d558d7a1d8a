"""``opacus-rc``: privacy figures of DP-SGD with randomized clipping next to exact clipping.

Examples::

    opacus-rc epsilon --noise-multiplier 1.0 --sample-rate 0.01 --steps 1000 --delta 1e-5 \\
        --sketch-dim 32
    opacus-rc noise-multiplier --target-epsilon 3 --sample-rate 0.01 --epochs 10 --delta 1e-5 \\
        --sketch-dim 16 32 64

Every figure is an upper bound on epsilon (the maximum over the remove and add adjacency
directions) from :class:`opacus_rc.accountants.RCAccountant`; the first column is always exact
clipping (plain DP-SGD), the others randomized clipping with ``k`` sketch columns.

The command line itself (:func:`arg_parser`, :func:`main`, :data:`EXAMPLES`) lives in the
top-level module ``opacus_rc_cli``, which the console script runs: it answers ``--help`` and
``--version`` without importing this package. This module computes the figures (:func:`run`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from opacus_rc.accountants import (
    EpsilonOutOfRangeError,
    NumericalLimitError,
    RCAccountant,
    get_noise_multiplier,
)
from opacus_rc.sampling_schedule import batches_per_epoch, poisson_epoch, steps_for_epochs
from opacus_rc.sketch_spec import SketchSpec

try:
    from opacus_rc_cli import EXAMPLES, arg_parser, main
except ModuleNotFoundError as err:
    if err.name != "opacus_rc_cli":
        raise
    # An editable install made before the launcher existed maps the package only.
    raise ModuleNotFoundError(
        "opacus_rc.cli needs the top-level module opacus_rc_cli (the opacus-rc command line, "
        "installed beside the package), which this installation does not provide: reinstall "
        "opacus_rc (in a checkout: pip install -e .)",
        name="opacus_rc_cli",
    ) from err

__all__ = ["EXAMPLES", "arg_parser", "main", "run"]


def _schedule(args: argparse.Namespace) -> tuple[float, int, str]:
    """``(rate, steps, note)``: the rate each step is accounted at, the number of steps, and
    a line saying which schedule that is.

    From the public sizes (``--num-batches``, or ``--dataset-size`` with ``--batch-size``) it
    is the schedule ``make_private_with_epsilon`` accounts (:func:`~opacus_rc.sampling_schedule.
    poisson_epoch`); a bare ``--sample-rate`` is accounted as given, for ``int(epochs / q)``
    steps as Opacus' ``get_noise_multiplier`` counts them.

    Raises:
        ValueError: on negative ``--steps`` or sizes that give no batch.
    """
    if args.steps is not None and args.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {args.steps}")
    if args.sample_rate is not None:
        q = args.sample_rate
        if args.steps is not None:
            return q, args.steps, f"schedule: every step accounted at the given rate {q:g}"
        steps = int(args.epochs / q)
        rate, per_epoch = poisson_epoch(q)
        note = (
            f"schedule: every step accounted at the given rate {q:g}, int(epochs / rate) = "
            f"{steps} steps (as Opacus' get_noise_multiplier)"
        )
        if (rate, steps_for_epochs(args.epochs, per_epoch)) != (q, steps):
            note += (
                f"; a Poisson loader at this rate has int(1 / q) = {per_epoch} batches, each "
                f"accounted at 1/{per_epoch}, for {steps_for_epochs(args.epochs, per_epoch)} "
                "steps: give --num-batches or --dataset-size and --batch-size to search at "
                "the schedule make_private_with_epsilon accounts"
            )
        return q, steps, note
    if args.num_batches is not None:
        n, source = args.num_batches, f"{args.num_batches} batches"
    else:
        n = batches_per_epoch(args.dataset_size, args.batch_size, drop_last=args.drop_last)
        source = (
            f"{args.dataset_size} records in batches of {args.batch_size}"
            f"{' (drop_last)' if args.drop_last else ''}: {n} batches"
        )
        if n == 0:
            raise ValueError(
                f"--dataset-size {args.dataset_size} gives no batch of {args.batch_size}"
            )
    rate, per_epoch = poisson_epoch(1 / n)
    steps = args.steps if args.steps is not None else steps_for_epochs(args.epochs, per_epoch)
    note = (
        f"schedule: {source}, Poisson rate 1/{n}; accounted as make_private_with_epsilon: "
        f"{per_epoch} steps per epoch at rate 1/{per_epoch}"
    )
    return rate, steps, note


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cols = [header, *rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in cols]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _run_epsilon(args: argparse.Namespace) -> str:
    sample_rate, steps, note = _schedule(args)
    header = ["", "exact clipping"] + [f"k = {k}" for k in args.sketch_dim]
    upper, estimate, remove, add = ["epsilon (upper)"], ["estimate"], ["remove"], ["add"]
    notes: list[str] = []
    for k in [None, *args.sketch_dim]:
        acc = RCAccountant(
            envelope=args.envelope, threat_model=args.threat_model, eps_error=args.eps_error
        )
        spec = None if k is None else SketchSpec(estimator="hutchinson", sketch_dim=k).to_dict()
        acc.history = [(args.noise_multiplier, sample_rate, steps, spec)]
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
        f"sample rate {sample_rate:g}, {steps} steps, threat model {args.threat_model}, "
        f"envelope {args.envelope}"
    )
    return "\n".join([title, note, _table(header, [upper, estimate, remove, add]), *notes])


def _run_noise(args: argparse.Namespace) -> str:
    sample_rate, steps, note = _schedule(args)
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
            sample_rate=sample_rate,
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
        f"sample rate {sample_rate:g}, {steps} steps, threat model {args.threat_model}, "
        f"envelope {args.envelope}"
    )
    return "\n".join([title, note, _table(header, [sigmas, ratios])])


def run(args: argparse.Namespace) -> int:
    """Compute and print the figures of a parsed ``opacus-rc`` command line.

    Args:
        args: What :func:`arg_parser` parsed (every required option present).

    Returns:
        0 on success, 2 on an invalid value, 1 if a figure cannot be computed.
    """
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
