"""Issue 34: what the randomized-clipping step cannot be cheaper than, measured in one process.

The step of :mod:`benchmarks.step_overhead` (``LlamaForCausalLM`` with SmolLM2-135M's shapes,
4 blocks, every block trainable, SGD, sigma = 1, C = 1, Hutchinson ``k``) carries four costs
over the non-private step that no change inside ``opacus_rc`` can remove while the project draws
its noise with Opacus, hooks its modules with Opacus, clips by book-keeping and sketches with
``k`` Gaussian probes per sample:

* ``noise``: Opacus' Gaussian draw over every trainable parameter
  (``opacus_rc._compat.opacus.generate_noise``, the draw of Opacus' ``add_noise``), its addition
  to a clipped sum and the division by the batch size (Opacus' ``scale_grad``);
* ``opacus_hooks``: the private model's forward and backward with its hooks **disabled**
  (``disable_hooks()``: no activation stored, no norm, no sketch; what remains are the
  ``register_full_backward_hook`` wrappers around every hooked module that Opacus installs)
  minus the non-private forward and backward, the same plain loss;
* ``deferred_products``: the products that replace autograd's weight gradients, minus those
  weight gradients (the non-private backward with and without the ``nn.Linear`` weights
  trainable, where autograd forms each right after the layer's input gradient): where every
  layer keeps its input and output gradient (``p d > T (p + d)``, e.g. ``T = 64``), the clipped
  sums ``sum_i c_i G_i^T A_i``, computed after the backward from the stored tensors, no longer
  in cache; where every layer keeps its per-sample gradients (``B = 1``, ``T >= 1024``), the
  products that form them in the backward hooks (Opacus' grad sampler) plus the clipped sums
  (then a scaling in place);
* ``sketch``: the sketched norms on random tensors of every sketched layer's shapes, by the
  step's own functions: :func:`opacus_rc.grad_sample.linear.compute_linear_sketched_norm_sample`
  of the factors (probes, the two batched products, the squares summed in float64), or
  :func:`opacus_rc.grad_sample.linear.sketched_weight_norm_of_gradients` of the per-sample
  gradients where the layers keep those. (Before Hutchinson's norms lost their max-abs pass,
  2026-12-08, this term was the estimator alone and the max-abs pass fell in ``rest``.)

A cell where some layers keep per-sample gradients and others their factors is refused.

Per round (``rounds``, the order rotated), each is timed in CPU time (``time.process_time``, one
thread) next to one non-private and one randomized-clipping step. Reported: each component's
median in ms and as a fraction of the non-private step, ``bound`` = non-private + the four
components (as a ratio to non-private: the lowest ratio this design can reach on this machine),
the measured rc step's ratio, and ``rest`` = rc - bound (the scaling, hooks' and checks' Python,
norm layers, clip factors, the step protocol: what ``opacus_rc`` can still shrink).

Run with one thread and ``OMP_WAIT_POLICY=PASSIVE`` on a quiet machine::

    OMP_NUM_THREADS=1 python -m benchmarks.overhead_bound --threads 1 --cell off:64:8

Results: ``overhead_bound_<checkpointing>_<T>x<B>.{csv,md}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import gc  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import common, long_context  # noqa: E402

NAME = "overhead_bound"
SECTION = "step_overhead"  # the same model and settings as step_overhead.py
COMPONENTS = ("noise", "opacus_hooks", "deferred_products", "sketch")
COLUMNS = ["quantity", "ms", "fraction_of_non_private", "ratio"]


def _cpu(fn: Callable[[], Any]) -> float:
    gc.collect()
    start = time.process_time()
    fn()
    return time.process_time() - start


class Bound:
    """The non-private and rc methods of one cell and the timed pieces of the bound."""

    def __init__(self, cfg: dict[str, Any], checkpointing: str, T: int, B: int) -> None:
        from opacus_rc._compat.opacus import generate_noise
        from opacus_rc.grad_sample.linear import (
            compute_linear_sketched_norm_sample,
            sketched_weight_norm_of_gradients,
        )
        from opacus_rc.grad_sample.norms import prefers_grad_sample_stash
        from opacus_rc.sketching import hutchinson_sqnorm, hutchinson_sqnorm_of_gradients

        device = torch.device("cpu")
        self.np = long_context.LMMethod(
            "non_private", *long_context.build_base(cfg, T, B, device), cfg, checkpointing
        )
        self.rc = long_context.LMMethod(
            "rc_bookkeeping", *long_context.build_base(cfg, T, B, device), cfg, checkpointing
        )
        linears = [
            m
            for m in self.rc.model.modules()
            if isinstance(m, nn.Linear) and m.weight.requires_grad
        ]
        # The step's own rule (shapes only, so meta tensors): a layer keeps its per-sample
        # gradients (formed in the backward hook, sketched in gradient form) where they are no
        # larger than its input and output gradient.
        keeps = [
            m
            for m in linears
            if prefers_grad_sample_stash(
                tuple(p for p in m.parameters() if p.requires_grad),
                [torch.empty(B, T, m.in_features, device="meta")],
                torch.empty(B, T, m.out_features, device="meta"),
            )
        ]
        if keeps and len(keeps) != len(linears):
            raise SystemExit(
                f"cell {checkpointing}:{T}:{B}: {len(keeps)} of {len(linears)} nn.Linear layers "
                "keep per-sample gradients and the others their input and output gradient; the "
                "bound describes a cell where all keep the one or all the other"
            )
        self.gradient_stash = bool(keeps)
        self.loss = nn.CrossEntropyLoss(ignore_index=-100)
        self.linear_weights = [
            m.weight
            for m in self.np.model.modules()
            if isinstance(m, nn.Linear) and m.weight.requires_grad
        ]
        gen = torch.Generator().manual_seed(cfg["seed"])
        if self.gradient_stash:
            grads = [torch.randn(B, m.out_features, m.in_features, generator=gen) for m in linears]
        else:
            factors = [
                (
                    torch.randn(B, T, m.in_features, generator=gen),
                    torch.randn(B, T, m.out_features, generator=gen),
                )
                for m in linears
            ]
        params = list(self.rc.trainable)
        sums = [torch.randn(p.shape, generator=gen) for p in params]
        probe_gen = torch.Generator().manual_seed(cfg["seed"] + 1)
        noise_gen = torch.Generator().manual_seed(cfg["seed"] + 2)

        def noise() -> None:
            for s in sums:
                n = generate_noise(std=1.0, reference=s, generator=noise_gen, secure_mode=False)
                n.add_(s).div_(B)

        def sketch() -> None:
            k = int(cfg["k"])
            if self.gradient_stash:
                for g in grads:
                    sketched_weight_norm_of_gradients(
                        g,
                        estimator=hutchinson_sqnorm_of_gradients,
                        sketch_dim=k,
                        generator=probe_gen,
                    )
            else:
                for m, (A, G) in zip(linears, factors):
                    compute_linear_sketched_norm_sample(
                        m, [A], G, estimator=hutchinson_sqnorm, sketch_dim=k, generator=probe_gen
                    )

        self.noise, self.sketch = noise, sketch
        self.clipped_sums = 0.0
        step = self.rc.model.private_step
        write = step._write_clipped_sums  # timed on this instance only

        def timed_write(*args: Any, **kwargs: Any) -> None:
            start = time.process_time()
            try:
                write(*args, **kwargs)
            finally:
                self.clipped_sums = time.process_time() - start

        step._write_clipped_sums = timed_write
        # The nn.Linear per-sample gradients formed in the hooks (timed on this instance only).
        self.stash_products = 0.0
        samplers = dict(step.norms._stash_grad_samplers)
        linear_sampler = samplers[nn.Linear]

        def timed_sampler(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return linear_sampler(*args, **kwargs)
            finally:
                self.stash_products += time.process_time() - start

        samplers[nn.Linear] = timed_sampler
        step.norms._stash_grad_samplers = samplers
        for fn in (self.np.step, self.rc.step, noise, sketch):
            fn()

    def forward_backward(self, method: long_context.LMMethod, *, frozen_weights: bool) -> float:
        """CPU seconds of a forward and backward of ``method.model`` with the plain loss
        (``frozen_weights``: the ``nn.Linear`` weights take no gradient)."""
        for w in self.linear_weights:
            w.requires_grad_(not frozen_weights)
        try:

            def run() -> None:
                out = method.model(input_ids=method.input_ids, position_ids=method.position_ids)
                logits = out.logits
                self.loss(logits.view(-1, logits.shape[-1]), method.labels).backward()

            return _cpu(run)
        finally:
            for w in self.linear_weights:
                w.requires_grad_(True)
            for p in method.model.parameters():
                p.grad = None

    def rc_step(self) -> float:
        """CPU seconds of one rc step (its clipped sums and stash products recorded)."""
        self.stash_products = 0.0
        return _cpu(self.rc.step)

    def hooks_disabled(self) -> float:
        """The private model's forward and backward with Opacus' hooks disabled."""
        self.rc.model.disable_hooks()
        try:
            return self.forward_backward(self.rc, frozen_weights=False)
        finally:
            self.rc.model.enable_hooks()

    def round(self, index: int) -> dict[str, float]:
        """One round: every quantity once (the order rotated by ``index``), in seconds."""
        timed: dict[str, Callable[[], float]] = {
            "non_private": lambda: _cpu(self.np.step),
            "rc": self.rc_step,
            "np_forward_backward": lambda: self.forward_backward(self.np, frozen_weights=False),
            "np_no_weight_grads": lambda: self.forward_backward(self.np, frozen_weights=True),
            "rc_hooks_disabled": self.hooks_disabled,
            "noise": lambda: _cpu(self.noise),
            "sketch": lambda: _cpu(self.sketch),
        }
        names = list(timed)
        k = index % len(names)
        out: dict[str, float] = {}
        for name in names[k:] + names[:k]:
            out[name] = timed[name]()
            if name == "rc":
                out["clipped_sums"] = self.clipped_sums
                out["stash_products"] = self.stash_products
        return out


def summarize(rounds: list[dict[str, float]]) -> list[dict[str, Any]]:
    """The table's rows from the rounds (medians, in ms)."""
    med = {k: 1e3 * common.median([r[k] for r in rounds]) for k in rounds[0]}
    weight_grads = med["np_forward_backward"] - med["np_no_weight_grads"]
    parts = {
        "noise": med["noise"],
        "opacus_hooks": med["rc_hooks_disabled"] - med["np_forward_backward"],
        "deferred_products": med["clipped_sums"] + med["stash_products"] - weight_grads,
        "sketch": med["sketch"],
    }
    base = med["non_private"]
    rows: list[dict[str, Any]] = [{"quantity": "non_private step", "ms": base, "ratio": 1.0}]
    for name in COMPONENTS:
        rows.append(
            {"quantity": name, "ms": parts[name], "fraction_of_non_private": parts[name] / base}
        )
    bound = base + sum(parts.values())
    rows.append({"quantity": "bound", "ms": bound, "ratio": bound / base})
    rows.append({"quantity": "rc step (measured)", "ms": med["rc"], "ratio": med["rc"] / base})
    rows.append(
        {
            "quantity": "rest (rc - bound)",
            "ms": med["rc"] - bound,
            "fraction_of_non_private": (med["rc"] - bound) / base,
        }
    )
    rows.append({"quantity": "clipped sums (rc)", "ms": med["clipped_sums"]})
    rows.append({"quantity": "per-sample gradients in the hooks (rc)", "ms": med["stash_products"]})
    rows.append({"quantity": "weight gradients (non-private)", "ms": weight_grads})
    return rows


def summary_markdown(rows: list[dict[str, Any]], cell: str, cfg: dict, info: dict) -> str:
    table = common.markdown_table(
        rows,
        COLUMNS,
        ["quantity", "ms per step (median)", "of the non-private step", "ratio"],
        formats={
            "ms": lambda v: "" if v is None else f"{v:.1f}",
            "fraction_of_non_private": lambda v: "" if v is None else f"{100 * v:.2f}%",
            "ratio": lambda v: "" if v is None else f"{v:.3f}x",
        },
    )
    return "\n".join(
        [
            "# The floor under the randomized-clipping step (issue 34)",
            "",
            f"Cell {cell} (checkpointing:T:B), {cfg['rounds']} rounds, CPU time, one thread; "
            f"k = {cfg['k']}. `bound` = non-private + Opacus' noise + Opacus' hook wrappers + "
            "the deferred clipped-sum products over autograd's weight gradients + the sketch "
            "(see the module docstring of `benchmarks/overhead_bound.py`).",
            "",
            table,
            "",
            common.machine_markdown(info),
        ]
    )


def result_stem(cell: str) -> str:
    """``overhead_bound_<checkpointing>_<T>x<B>`` for the cell ``checkpointing:T:B``."""
    checkpointing, T, B = cell.split(":")
    return f"{NAME}_{checkpointing}_{T}x{B}"


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--cell", default=None, help="checkpointing:T:B (default off:64:8)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: config)")
    args = parser.parse_args(argv)
    cfg, out, device = common.resolve(args, SECTION)
    if device.type != "cpu":
        raise SystemExit("overhead_bound measures CPU time: run it with --device cpu")
    common.quiet_warnings()
    cell = args.cell or ("off:8:2" if cfg["profile"] == "quick" else "off:64:8")
    checkpointing, T, B = cell.split(":")
    rounds = args.rounds or cfg["rounds"]
    cfg["rounds"] = rounds
    info = common.machine_info(device)
    info["uptime_load_average_at_start"] = long_context.load_average()
    bound = Bound(cfg, checkpointing, int(T), int(B))
    measured = [bound.round(i) for i in range(rounds)]
    info["uptime_load_average_now"] = long_context.load_average()
    rows = summarize(measured)
    stem = result_stem(cell)
    common.write_csv(out / f"{stem}.csv", rows, COLUMNS)
    common.write_text(out / f"{stem}.md", summary_markdown(rows, cell, cfg, info))
    for row in rows:
        print(f"{row['quantity']:32s} {row['ms']:9.1f} ms", row.get("ratio") or "")
    print(f"wrote {out / stem}.csv and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
