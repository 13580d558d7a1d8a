"""Item 4 of issue 5: the privacy cost of randomized clipping, as a noise multiplier.

For each setting (Poisson sample rate ``q``, number of steps), target epsilon and delta, the
noise multiplier sigma that the project's accountant (``opacus_rc.accountants``:
``get_noise_multiplier``, PRV accounting of docs/privacy/prv.md#prv, both adjacency directions)
needs for

* exact clipping (``sketch_spec=None``), and
* randomized clipping with a Hutchinson sketch of ``k`` columns, threat model ``hidden``
  (per-sample secret sketches; the default) and ``revealed`` (the paper's; any sketch sharing).

The ratio sigma(randomized) / sigma(exact) is the price of the sketch: to keep epsilon, the noise
must grow by that factor. Each sigma is re-checked by composing an ``RCAccountant`` history and
reading its epsilon. Where docs/privacy/reference_numbers.md#reference-sigma has a reference sigma
(q = 0.01, 100 or 1000 steps, k = 32), it is shown next to ours.

Examples::

    python -m benchmarks.privacy_cost --quick     # one setting, a few searches
    python -m benchmarks.privacy_cost             # the full table (about 2 minutes)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

NAME = "privacy_cost"
COLUMNS = [
    "sample_rate",
    "steps",
    "delta",
    "target_epsilon",
    "clipping",
    "k",
    "threat_model",
    "noise_multiplier",
    "ratio_to_exact",
    "epsilon_check",
    "theory_noise_multiplier",
    "search_s",
    "status",
]


def _theory_reference() -> dict[tuple[int, float], tuple[float, ...]]:
    """docs/privacy/reference_numbers.md#reference-sigma (q = 0.01, delta = 1e-5), from
    tests/reference if present."""
    try:
        from tests.reference.theory_tables import SIGMA_FOR_EPS
    except ImportError:
        return {}
    return SIGMA_FOR_EPS


def _theory_sigma(ref: dict, row: dict[str, Any]) -> float | None:
    if row["sample_rate"] != 0.01 or row["delta"] != 1e-5:
        return None
    entry = ref.get((row["steps"], row["target_epsilon"]))
    if entry is None:
        return None
    if row["clipping"] == "exact":
        return entry[0]
    if row["k"] == 32:
        return entry[1] if row["threat_model"] == "hidden" else entry[2]
    return None


def run(cfg: dict[str, Any], log: Any = print) -> list[dict[str, Any]]:
    from opacus_rc.accountants import AccountingError, RCAccountant, get_noise_multiplier
    from opacus_rc.sketching import SketchSpec

    ref = _theory_reference()
    rows = []
    for setting in cfg["settings"]:
        q, steps = setting["sample_rate"], setting["steps"]
        for eps in cfg["target_epsilon"]:
            variants: list[tuple[str, int | None, str]] = [("exact", None, "-")]
            variants += [("randomized", k, tm) for k in cfg["k"] for tm in cfg["threat_models"]]
            exact_sigma = None
            for clipping, k, tm in variants:
                row: dict[str, Any] = {
                    "sample_rate": q,
                    "steps": steps,
                    "delta": cfg["delta"],
                    "target_epsilon": eps,
                    "clipping": clipping,
                    "k": k,
                    "threat_model": tm,
                }
                spec = SketchSpec(estimator="hutchinson", sketch_dim=k) if k else None
                template = RCAccountant(threat_model="hidden" if tm == "-" else tm)
                t0 = time.perf_counter()
                try:
                    sigma = get_noise_multiplier(
                        target_epsilon=eps,
                        target_delta=cfg["delta"],
                        sample_rate=q,
                        steps=steps,
                        sketch_spec=spec,
                        accountant=template,
                    )
                except (ValueError, AccountingError) as err:  # a failed search is a result row
                    row["status"] = f"failed: {err}"[:200]
                    rows.append(row)
                    continue
                row["search_s"] = time.perf_counter() - t0
                check = RCAccountant(threat_model=template.threat_model)
                check.history = [(sigma, q, steps, spec.to_dict() if spec else None)]
                row["epsilon_check"] = check.get_epsilon(delta=cfg["delta"])
                row["noise_multiplier"] = sigma
                if clipping == "exact":
                    exact_sigma = sigma
                if exact_sigma:
                    row["ratio_to_exact"] = sigma / exact_sigma
                row["theory_noise_multiplier"] = _theory_sigma(ref, row)
                row["status"] = "ok"
                rows.append(row)
                log(
                    f"q={q} steps={steps} eps={eps} {clipping} k={k} {tm}: sigma={sigma:.4f}"
                    f" (eps check {row['epsilon_check']:.3f}, {row['search_s']:.1f} s)"
                )
    return rows


def summary_markdown(rows: list[dict], cfg: dict, info: dict) -> str:
    parts = [
        "# Privacy cost of randomized clipping (issue 5, item 4)",
        "",
        f"Noise multiplier sigma needed for epsilon at delta = {cfg['delta']}, from "
        "`opacus_rc.accountants.get_noise_multiplier` (PRV, max over remove/add adjacency). "
        "Randomized clipping: Hutchinson sketch with k columns; `hidden` = per-sample secret "
        "sketches, `revealed` = the paper's threat model. Ratio = sigma / sigma(exact): the "
        "noise increase that keeps epsilon. `ref` is the reference value of "
        "docs/privacy/reference_numbers.md#reference-sigma where one exists (precision +-0.003).",
        "",
        common.machine_markdown(info),
        "",
    ]
    devs = [
        r["noise_multiplier"] / r["theory_noise_multiplier"] - 1
        for r in rows
        if r.get("status") == "ok" and r.get("theory_noise_multiplier")
    ]
    if devs:
        parts += [
            f"Against the reference values ({len(devs)}): sigma / reference - 1 in "
            f"[{100 * min(devs):+.2f}%, {100 * max(devs):+.2f}%]. The accountant's search makes "
            "the epsilon *upper bound* (estimate + eps_error, both directions) meet the target, "
            "the reference the remove-direction estimate, so ours is the same or slightly larger "
            "(compare an upper bound with value + eps_error).",
            "",
        ]
    for setting in cfg["settings"]:
        q, steps = setting["sample_rate"], setting["steps"]
        parts += [f"## q = {q}, {steps} steps", ""]
        table = []
        for eps in cfg["target_epsilon"]:
            line: dict[str, Any] = {"eps": eps}
            for r in rows:
                if (r["sample_rate"], r["steps"], r["target_epsilon"]) != (q, steps, eps):
                    continue
                key = "exact" if r["clipping"] == "exact" else f"k={r['k']} {r['threat_model']}"
                if r.get("status") != "ok":
                    line[key] = r.get("status", "")
                    continue
                cell = f"{r['noise_multiplier']:.4f}"
                if r["clipping"] != "exact" and r.get("ratio_to_exact"):
                    cell += f" ({r['ratio_to_exact']:.3f}x)"
                if r.get("theory_noise_multiplier"):
                    cell += f" [ref: {r['theory_noise_multiplier']:.4f}]"
                line[key] = cell
            table.append(line)
        keys = ["exact"] + [f"k={k} {tm}" for k in cfg["k"] for tm in cfg["threat_models"]]
        parts += [common.markdown_table(table, ["eps", *keys], ["target epsilon", *keys]), ""]
    return "\n".join(parts)


def plot(rows: list[dict], cfg: dict, path: Path) -> None:
    plt = common.pyplot()
    settings = cfg["settings"]
    fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 4), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        q, steps = setting["sample_rate"], setting["steps"]
        for tm, ls in zip(cfg["threat_models"], ["-", "--"]):
            for eps, color in zip(cfg["target_epsilon"], ["tab:blue", "tab:orange", "tab:green"]):
                pts = [
                    (r["k"], r["ratio_to_exact"])
                    for r in rows
                    if r.get("status") == "ok"
                    and r["clipping"] == "randomized"
                    and r["threat_model"] == tm
                    and r["target_epsilon"] == eps
                    and (r["sample_rate"], r["steps"]) == (q, steps)
                ]
                if pts:
                    ax.plot(*zip(*pts), ls=ls, marker="o", color=color, label=f"eps={eps}, {tm}")
        ax.axhline(1, color="k", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k (sketch columns)")
        ax.set_ylabel("sigma(randomized) / sigma(exact)")
        ax.set_title(f"q={q}, {steps} steps, delta={cfg['delta']}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    args = parser.parse_args(argv)
    cfg, out, device = common.resolve(args, NAME)
    info = common.machine_info(device)
    rows = run(cfg)
    stem = common.result_stem(NAME, cfg, device)
    common.write_csv(out / f"{stem}.csv", rows, COLUMNS)
    common.write_text(out / f"{stem}.md", summary_markdown(rows, cfg, info))
    plot(rows, cfg, out / f"{stem}.png")
    print(f"wrote {out / stem}.csv, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
