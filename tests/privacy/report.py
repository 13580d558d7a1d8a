"""Print the neighbouring-dataset harness' numbers as a markdown table (issue 30's closing note).

Run from the repository root: ``python -m tests.privacy.report`` (about a minute on one CPU
thread). Per path of :data:`tests.privacy.neighbouring.PATHS`: the measured
``||release(D) - release(D - 1)|| / C`` at ``sigma = 0`` and its bound, and the mechanism's
quantities at ``sigma = 1`` for ``D`` and ``D - 1`` without a public size, and with one where
the path takes one (``make_private``'s ``dataset_size``).
"""

from __future__ import annotations

import logging
import warnings

from tests.privacy import neighbouring as nb


def _pair(a: float, b: float, fmt: str = "{:g}") -> str:
    return fmt.format(a) if a == b else f"{fmt.format(a)} / {fmt.format(b)}"


def _mechanism_cells(a: nb.Mechanism, b: nb.Mechanism) -> list[str]:
    expected = _pair(a.expected_noise_sd, b.expected_noise_sd, "{:.4f}")
    return [
        _pair(a.sample_rate, b.sample_rate, "{:.4g}"),
        _pair(a.accounted_rate, b.accounted_rate, "{:.4g}"),
        _pair(a.steps_per_epoch, b.steps_per_epoch),
        _pair(a.divisor, b.divisor),
        f"{_pair(a.noise_sd, b.noise_sd, '{:.4f}')} ({expected})",
    ]


def _refused(run: object, **kw: object) -> str | None:
    """The refusal of both neighbours (a short reason), or None if they run."""
    from opacus_rc.batch_independence import BatchIndependenceError

    try:
        for neighbour in (False, True):
            run(neighbour=neighbour, **kw)  # type: ignore[operator]
    except BatchIndependenceError:
        return "refused (batch independence)"
    except ValueError as error:
        if "Opacus #819" in str(error):
            return "refused (no public size)"
        raise
    return None


def rows() -> list[list[str]]:
    """One table row per path (a refused path says so)."""
    from tests.privacy.test_neighbouring import UNIT_PATHS

    out = []
    for name, (run, has_public) in nb.PATHS.items():
        public = name in UNIT_PATHS  # refused without a public number of units
        refused = _refused(run, noise_multiplier=0.0, public_size=public)
        if refused:
            out.append([name, refused] + [""] * (len(HEADER) - 2))
            continue
        a = run(neighbour=False, noise_multiplier=0.0, public_size=public)
        b = run(neighbour=True, noise_multiplier=0.0, public_size=public)
        c = a.mechanism.max_grad_norm
        bound = nb.sensitivity_bound(
            max_grad_norm=c, sketch_dim=a.sketch_dim, others=len(b.sampled)
        )
        row = [name, f"{nb.release_distance(a, b) / c:.4f} ({bound / c:.4f})"]
        refused = _refused(run, noise_multiplier=1.0, public_size=False)
        if refused:
            row += [refused] + [""] * 4
        else:
            a, b = (
                run(neighbour=n, noise_multiplier=1.0, public_size=False) for n in (False, True)
            )
            row += _mechanism_cells(a.mechanism, b.mechanism)
        if has_public:
            a, b = (run(neighbour=n, noise_multiplier=1.0, public_size=True) for n in (False, True))
            cells = _mechanism_cells(a.mechanism, b.mechanism)
            row.append(f"{cells[0]}; {cells[3]}; {cells[4]}")
        else:
            row.append("none")
        out.append(row)
    return out


HEADER = [
    "path",
    "‖Δ‖/C at σ=0 (bound)",
    "q",
    "accounted q",
    "steps/epoch",
    "divisor",
    "noise sd (σC/divisor)",
    "with a public size: q; divisor; noise sd",
]


def main() -> None:
    """Print the table (cells ``x / y``: ``D`` and ``D - 1`` differ; one value: the same)."""
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:  # pragma: no cover - datasets comes with trl
        pass
    import transformers

    transformers.logging.set_verbosity_error()
    table = rows()
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for row in table:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
