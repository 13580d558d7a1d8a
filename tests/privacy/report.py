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


def rows() -> list[list[str]]:
    """One table row per path."""
    out = []
    for name, (run, has_public) in nb.PATHS.items():
        a = run(neighbour=False, noise_multiplier=0.0, public_size=False)
        b = run(neighbour=True, noise_multiplier=0.0, public_size=False)
        c = a.mechanism.max_grad_norm
        bound = nb.sensitivity_bound(
            max_grad_norm=c, sketch_dim=a.sketch_dim, others=len(b.sampled)
        )
        row = [name, f"{nb.release_distance(a, b) / c:.4f} ({bound / c:.4f})"]
        a, b = (run(neighbour=n, noise_multiplier=1.0, public_size=False) for n in (False, True))
        row += _mechanism_cells(a.mechanism, b.mechanism)
        if has_public:
            a, b = (run(neighbour=n, noise_multiplier=1.0, public_size=True) for n in (False, True))
            cells = _mechanism_cells(a.mechanism, b.mechanism)
            row.append(f"{cells[3]}; {cells[4]}")
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
    "public size: divisor; noise sd",
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
