"""Item 2 of issue 5: quality of the sketched per-sample norms on a real model's gradients.

One forward and backward of the pretrained SmolLM2-135M classifier (the tutorials' setting:
last ``trainable_layers`` blocks, final norm and head trainable) on ``batch_size`` real Brown
documents of ``seq_len`` tokens. Opacus' ``GradSampleModule`` (hooks mode, ``loss_reduction=
"sum"``) gives the exact per-sample gradients of every trainable parameter; hooks on the
trainable ``nn.Linear`` layers keep their inputs ``A`` and output gradients ``G``. Then, for each
estimator (Hutchinson, Hutch++ with head ``s = k``), each ``k`` and ``seeds`` independent sketch
seeds, opacus_rc's sampler ``compute_linear_sketched_norm_sample`` estimates every Linear
layer's per-sample norm from ``(A, G)``; the total per-sample norm combines them with the exact
norms of the other trainable parameters (RMSNorm weights), as randomized clipping does.

Reported (``estimate_quality*.csv``, ``.md``, ``.png``):

* the relative error ``n_hat / n - 1`` of the per-sample gradient norm, total and per layer
  type, over samples and seeds (mean, std, quantiles), next to the theory: for Hutchinson the
  squared-norm ratio is ``sum_j w_j chi2_k / k`` (docs/privacy/estimators.md#estimators-hutchinson),
  whose predicted std is computed per sample from the singular values of the exact gradients; the
  worst case (rank one) gives a norm std of about ``1 / sqrt(2k)``;
* the clip-decision flip rate: how often ``n_hat > C`` differs from ``n > C``, for ``C`` a
  multiple of the median exact norm of the batch, and the mean error of the clip factor
  ``min(1, C / n)``.

Examples::

    python -m benchmarks.estimate_quality --quick     # tiny random Llama, seconds
    python -m benchmarks.estimate_quality             # SmolLM2-135M, a few minutes on CPU
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from opacus import GradSampleModule
from torch import nn

from benchmarks import common, models
from opacus_rc.grad_sample.linear import compute_linear_sketched_norm_sample
from opacus_rc.sketching import get_estimator

NAME = "estimate_quality"
RAW_COLUMNS = ["estimator", "k", "sample", "seed", "exact_norm", "est_norm", "rel_err"]
SUMMARY_COLUMNS = [
    "estimator",
    "k",
    "scope",
    "n",
    "mean_rel_err",
    "std_rel_err",
    "q05_rel_err",
    "q50_rel_err",
    "q95_rel_err",
    "max_abs_rel_err",
    "pred_std_rel_err",
    "worst_case_std_rel_err",
    "median_effective_rank",
]
CLIP_COLUMNS = [
    "estimator",
    "k",
    "clip_multiplier",
    "C",
    "flip_rate",
    "frac_clipped_exact",
    "frac_clipped_est",
    "mean_abs_coef_err",
]


def _ks(cfg: dict[str, Any], estimator: str) -> list[int]:
    """The k values of an estimator (``k_by_estimator`` overrides ``k``)."""
    return list(cfg.get("k_by_estimator", {}).get(estimator, cfg["k"]))


def _layer_type(name: str) -> str:
    return name.rsplit(".", 1)[-1]


class _Capture:
    """Keeps each trainable Linear layer's input and output gradient of one forward/backward."""

    def __init__(self, layers: dict[str, nn.Linear]) -> None:
        self.A: dict[str, torch.Tensor] = {}
        self.G: dict[str, torch.Tensor] = {}
        self.handles = [
            layer.register_forward_hook(self._hook(name)) for name, layer in layers.items()
        ]

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor):
            self.A[name] = inputs[0].detach()

            def grad_hook(g: torch.Tensor) -> None:
                self.G[name] = g.detach()

            output.register_hook(grad_hook)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def collect(cfg: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Run the model once; return factors, exact norms and the exact non-Linear part."""
    model = models.load_model(cfg).to(device)
    counts = models.freeze_all_but_last(model, cfg["trainable_layers"])
    encode = models.encoder(cfg, model)
    ids, labels = models.brown_batch(
        encode,
        batch_size=cfg["batch_size"],
        seq_len=cfg["seq_len"],
        seed=cfg["seed"],
        num_labels=cfg.get("num_labels", 2),
    )
    ids, labels = ids.to(device), labels.to(device)
    linears = {
        name: m
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m.weight.requires_grad
    }
    capture = _Capture(linears)
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    logits = gsm(input_ids=ids).logits
    loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
    loss.backward()
    capture.remove()
    linear_params = {id(m.weight) for m in linears.values()}
    exact_sq_other = torch.zeros(len(ids), dtype=torch.float64, device=device)
    exact_linear: dict[str, torch.Tensor] = {}
    spectra: dict[str, list[torch.Tensor]] = {}
    for name, m in linears.items():
        gs = m.weight.grad_sample.double()  # (B, p, d)
        exact_linear[name] = gs.flatten(1).norm(dim=1)
        # Normalised eigenvalues of O_i = M_i M_i^T: squared singular values of M_i.
        sv2 = torch.linalg.svdvals(gs).pow(2)
        spectra[name] = list(sv2 / sv2.sum(dim=1, keepdim=True).clamp_min(1e-300))
        if m.bias is not None and m.bias.requires_grad:
            exact_sq_other += m.bias.grad_sample.double().flatten(1).pow(2).sum(1)
    for p in model.parameters():
        if p.requires_grad and id(p) not in linear_params and hasattr(p, "grad_sample"):
            if any(p is m.bias for m in linears.values()):
                continue
            exact_sq_other += p.grad_sample.double().flatten(1).pow(2).sum(1)
    # Cross-check: Opacus' per-sample gradient norm equals ||G_i^T A_i||_F from the factors.
    check = 0.0
    for name in linears:
        A, G = capture.A[name].double(), capture.G[name].double()
        direct = torch.einsum("btp,btd->bpd", G, A).flatten(1).norm(dim=1)
        rel = ((direct - exact_linear[name]).abs() / exact_linear[name].clamp_min(1e-30)).max()
        check = max(check, float(rel))
    gsm._close()
    return {
        "linears": linears,
        "A": capture.A,
        "G": capture.G,
        "exact_linear": exact_linear,
        "exact_sq_other": exact_sq_other,
        "spectra": spectra,
        "factor_check": check,
        "counts": counts,
        "labels": labels,
    }


def estimate(
    data: dict[str, Any], cfg: dict[str, Any], device: torch.device, log: Any = print
) -> tuple[list[dict], dict]:
    """All sketched estimates: raw rows (total norm) and per-layer relative errors."""
    rows = []
    per_layer: dict[tuple[str, int, str], list[np.ndarray]] = defaultdict(list)
    exact_total = (
        sum(v.pow(2) for v in data["exact_linear"].values()) + data["exact_sq_other"]
    ).sqrt()
    for est_name in cfg["estimators"]:
        estimator = get_estimator(est_name)
        for k in _ks(cfg, est_name):
            for seed in range(cfg["seeds"]):
                gen = torch.Generator(device=device).manual_seed(10_000 * k + seed)
                sq = data["exact_sq_other"].clone()
                for name, layer in data["linears"].items():
                    norms = compute_linear_sketched_norm_sample(
                        layer,
                        [data["A"][name]],
                        data["G"][name],
                        estimator=estimator,
                        sketch_dim=k,
                        generator=gen,
                    )
                    est = norms[layer.weight].double()
                    sq = sq + est.pow(2)
                    rel = (est / data["exact_linear"][name] - 1).cpu().numpy()
                    per_layer[(est_name, k, _layer_type(name))].append(rel)
                est_total = sq.sqrt()
                for i in range(len(est_total)):
                    exact_i, est_i = float(exact_total[i]), float(est_total[i])
                    rows.append(
                        {
                            "estimator": est_name,
                            "k": k,
                            "sample": i,
                            "seed": seed,
                            "exact_norm": exact_i,
                            "est_norm": est_i,
                            "rel_err": est_i / exact_i - 1,
                        }
                    )
            log(f"{est_name} k={k}: {cfg['seeds']} seeds done")
    return rows, {"per_layer": per_layer, "exact_total": exact_total}


def _predicted_std(data: dict[str, Any], k: int) -> np.ndarray:
    """Per-sample std of ``n_hat / n - 1`` for Hutchinson
    (docs/privacy/estimators.md#estimators-hutchinson, delta method).

    The squared-norm ratio is ``W = sum_l (n_l / n) W_l`` with independent
    ``W_l = sum_j w_lj chi2_k / k``, so ``Var W = sum_l (n_l / n)^2 (2 / k) sum_j w_lj^2``; the
    norm ratio ``sqrt(W)`` has std about ``sqrt(Var W) / 2``.
    """
    exact_sq = {n: v.pow(2) for n, v in data["exact_linear"].items()}
    total = sum(exact_sq.values()) + data["exact_sq_other"]
    var = torch.zeros_like(total)
    for name, sq in exact_sq.items():
        w2 = torch.stack([w.pow(2).sum() for w in data["spectra"][name]])
        var += (sq / total).pow(2) * (2.0 / k) * w2
    return (var.sqrt() / 2).cpu().numpy()


def _stats(rel: np.ndarray) -> dict[str, float]:
    return {
        "n": int(rel.size),
        "mean_rel_err": float(rel.mean()),
        "std_rel_err": float(rel.std()),
        "q05_rel_err": float(np.quantile(rel, 0.05)),
        "q50_rel_err": float(np.quantile(rel, 0.5)),
        "q95_rel_err": float(np.quantile(rel, 0.95)),
        "max_abs_rel_err": float(np.abs(rel).max()),
    }


def summarize(
    rows: list[dict], extra: dict, data: dict[str, Any], cfg: dict[str, Any]
) -> tuple[list[dict], list[dict]]:
    summary, clip = [], []
    exact_total = extra["exact_total"].cpu().numpy()
    median_norm = float(np.median(exact_total))
    eff_rank_by_type: dict[str, list[float]] = defaultdict(list)
    for name, spectra in data["spectra"].items():
        for w in spectra:
            eff_rank_by_type[_layer_type(name)].append(float(1.0 / w.pow(2).sum()))
    for est_name in cfg["estimators"]:
        for k in _ks(cfg, est_name):
            sel = [r for r in rows if r["estimator"] == est_name and r["k"] == k]
            rel = np.array([r["rel_err"] for r in sel])
            pred = float(np.mean(_predicted_std(data, k))) if est_name == "hutchinson" else None
            summary.append(
                {
                    "estimator": est_name,
                    "k": k,
                    "scope": "total",
                    **_stats(rel),
                    "pred_std_rel_err": pred,
                    "worst_case_std_rel_err": 1 / math.sqrt(2 * k),
                }
            )
            for ltype in sorted(eff_rank_by_type):
                lrel = np.concatenate(extra["per_layer"][(est_name, k, ltype)])
                summary.append(
                    {
                        "estimator": est_name,
                        "k": k,
                        "scope": ltype,
                        **_stats(lrel),
                        "worst_case_std_rel_err": 1 / math.sqrt(2 * k),
                        "median_effective_rank": float(np.median(eff_rank_by_type[ltype])),
                    }
                )
            exact = np.array([r["exact_norm"] for r in sel])
            est = np.array([r["est_norm"] for r in sel])
            for mult in cfg["clip_multipliers"]:
                C = mult * median_norm
                coef_exact = np.minimum(1.0, C / exact)
                coef_est = np.minimum(1.0, C / est)
                clip.append(
                    {
                        "estimator": est_name,
                        "k": k,
                        "clip_multiplier": mult,
                        "C": C,
                        "flip_rate": float(np.mean((exact > C) != (est > C))),
                        "frac_clipped_exact": float(np.mean(exact > C)),
                        "frac_clipped_est": float(np.mean(est > C)),
                        "mean_abs_coef_err": float(np.mean(np.abs(coef_est - coef_exact))),
                    }
                )
    return summary, clip


def summary_markdown(
    summary: list[dict], clip: list[dict], data: dict[str, Any], cfg: dict, info: dict
) -> str:
    c = data["counts"]
    fmt = {
        c_: (lambda v: "" if v is None else f"{100 * float(v):+.2f}%")
        for c_ in ("mean_rel_err", "q05_rel_err", "q50_rel_err", "q95_rel_err")
    }
    pct = lambda v: "" if v is None else f"{100 * float(v):.2f}%"  # noqa: E731
    fmt.update(dict.fromkeys(("std_rel_err", "max_abs_rel_err", "pred_std_rel_err"), pct))
    fmt["worst_case_std_rel_err"] = pct
    total = [r for r in summary if r["scope"] == "total"]
    parts = [
        "# Quality of sketched per-sample norms on real gradients (issue 5, item 2)",
        "",
        f"Model `{cfg['model']}` (classification head), last {cfg['trainable_layers']} "
        f"block(s) + final norm + head trainable ({c['trainable']:,} of {c['total']:,} "
        f"parameters); {cfg['batch_size']} Brown documents of {cfg['seq_len']} tokens; "
        f"{cfg['seeds']} sketch seeds per k (k = "
        + "; ".join(f"{e}: {', '.join(map(str, _ks(cfg, e)))}" for e in cfg["estimators"])
        + "). Exact norms: Opacus per-sample gradients (their "
        f"norms match ||G_i^T A_i||_F from the captured factors to {data['factor_check']:.1e} "
        "relative). Relative error = estimated / exact per-sample gradient norm - 1; the total "
        "combines the sketched Linear norms with the exact RMSNorm norms.",
        "",
        common.machine_markdown(info),
        "",
        "## Total per-sample norm",
        "",
        "`predicted std` is the Hutchinson law of docs/privacy/estimators.md#estimators-hutchinson "
        "evaluated on the exact gradients' spectra; `worst case` is the rank-one value "
        "1/sqrt(2k).",
        "",
        common.markdown_table(
            total,
            [
                "estimator",
                "k",
                "n",
                "mean_rel_err",
                "std_rel_err",
                "pred_std_rel_err",
                "worst_case_std_rel_err",
                "q05_rel_err",
                "q95_rel_err",
                "max_abs_rel_err",
            ],
            [
                "estimator",
                "k",
                "n",
                "mean",
                "std",
                "predicted std",
                "worst case",
                "5%",
                "95%",
                "max |err|",
            ],
            fmt,
        ),
        "",
        "## Clip decisions",
        "",
        "C = multiple of the median exact per-sample norm of the batch; flip = the estimate and "
        "the exact norm fall on different sides of C.",
        "",
        common.markdown_table(
            clip,
            [
                "estimator",
                "k",
                "clip_multiplier",
                "flip_rate",
                "frac_clipped_exact",
                "frac_clipped_est",
                "mean_abs_coef_err",
            ],
            [
                "estimator",
                "k",
                "C / median",
                "flip rate",
                "clipped (exact)",
                "clipped (est.)",
                "mean abs clip-factor error",
            ],
            {
                "flip_rate": pct,
                "frac_clipped_exact": pct,
                "frac_clipped_est": pct,
                "mean_abs_coef_err": lambda v: f"{float(v):.4f}",
            },
        ),
        "",
        "## Per layer type",
        "",
        "Effective rank = 1 / sum_j w_j^2 of the per-sample gradient's normalised squared "
        "singular values (median over samples): the larger, the smaller the Hutchinson variance "
        "(2 / (k * effective rank)).",
        "",
        common.markdown_table(
            [r for r in summary if r["scope"] != "total" and r["k"] == cfg["k_reference"]],
            [
                "estimator",
                "scope",
                "median_effective_rank",
                "mean_rel_err",
                "std_rel_err",
                "worst_case_std_rel_err",
                "max_abs_rel_err",
            ],
            ["estimator", "layer", "effective rank", "mean", "std", "worst case", "max |err|"],
            {**fmt, "median_effective_rank": lambda v: f"{float(v):.1f}"},
        ),
    ]
    return "\n".join(parts)


def plot(rows: list[dict], clip: list[dict], summary: list[dict], cfg: dict, path: Path) -> None:
    plt = common.pyplot()
    ests = cfg["estimators"]
    ks = cfg["k"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    width = 0.35
    colors = {"hutchinson": "tab:blue", "hutch++": "tab:green"}
    for j, est in enumerate(ests):
        est_ks = [k for k in ks if k in _ks(cfg, est)]
        data = [
            [100 * r["rel_err"] for r in rows if r["estimator"] == est and r["k"] == k]
            for k in est_ks
        ]
        pos = [ks.index(k) + (j - (len(ests) - 1) / 2) * width for k in est_ks]
        bp = ax.boxplot(
            data,
            positions=pos,
            widths=width * 0.9,
            whis=(1, 99),
            showfliers=False,
            patch_artist=True,
        )
        for box in bp["boxes"]:
            box.set_facecolor(colors.get(est, "gray"))
            box.set_alpha(0.5)
        ax.plot([], [], color=colors.get(est, "gray"), lw=6, alpha=0.5, label=est)
    wc = [100 / math.sqrt(2 * k) for k in ks]
    ax.plot(range(len(ks)), wc, "k--", lw=1, label="±1/sqrt(2k) (worst case std)")
    ax.plot(range(len(ks)), [-w for w in wc], "k--", lw=1)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_xlabel("k")
    ax.set_ylabel("relative error of per-sample norm (%)")
    ax.set_title("total norm: 1-99% whiskers, over samples x seeds", fontsize=9)
    ax.legend(fontsize=8)
    ax = axes[1]
    for est in ests:
        for mult, ls in zip(cfg["clip_multipliers"], ["-", "--", ":", "-."]):
            pts = [
                (r["k"], 100 * r["flip_rate"])
                for r in clip
                if r["estimator"] == est and r["clip_multiplier"] == mult
            ]
            ax.plot(
                *zip(*pts),
                ls=ls,
                marker="o",
                color=colors.get(est, "gray"),
                label=f"{est}, C={mult}x median",
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("clip decisions flipped (%)")
    ax.set_title("clip-decision flip rate", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[2]
    for est in ests:
        tot = [r for r in summary if r["estimator"] == est and r["scope"] == "total"]
        ax.plot(
            [r["k"] for r in tot],
            [100 * r["std_rel_err"] for r in tot],
            "o-",
            color=colors.get(est, "gray"),
            label=f"{est} (measured)",
        )
        if est == "hutchinson":
            ax.plot(
                [r["k"] for r in tot],
                [100 * r["pred_std_rel_err"] for r in tot],
                "x--",
                color=colors.get(est, "gray"),
                label="hutchinson (predicted law)",
            )
    ax.plot(ks, wc, "k:", label="worst case 1/sqrt(2k)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.01)  # Hutch++ is exact (round-off only) when rank <= s
    ax.set_xlabel("k")
    ax.set_ylabel("std of relative error (%)")
    ax.set_title("spread vs theory", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    args = parser.parse_args(argv)
    cfg, out, device = common.resolve(args, NAME)
    common.quiet_warnings()
    info = common.machine_info(device)
    data = collect(cfg, device)
    rows, extra = estimate(data, cfg, device)
    summary, clip = summarize(rows, extra, data, cfg)
    stem = common.result_stem(NAME, cfg, device)
    common.write_csv(out / f"{stem}_raw.csv", rows, RAW_COLUMNS)
    common.write_csv(out / f"{stem}.csv", summary, SUMMARY_COLUMNS)
    common.write_csv(out / f"{stem}_clip.csv", clip, CLIP_COLUMNS)
    common.write_text(out / f"{stem}.md", summary_markdown(summary, clip, data, cfg, info))
    plot(rows, clip, summary, cfg, out / f"{stem}.png")
    print(f"wrote {out / stem}.csv, _raw.csv, _clip.csv, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
