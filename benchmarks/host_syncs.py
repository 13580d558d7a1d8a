"""Issue 12: host synchronisations per randomized-clipping training step, by phase and call site.

A host synchronisation is an op that makes the host wait for the device: reading a tensor's
value into Python (``.item()``, ``float(t)``, ``bool(t)``, ``if t.any():``; all of them dispatch
``aten._local_scalar_dense``), comparing tensors on the host (``aten.equal``), an op whose output
shape depends on the data (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``), and
a copy from a device to the CPU (``.cpu()``, ``.to("cpu")``). :class:`HostSyncCounter`, a
``TorchDispatchMode``, counts them. On CPU nothing waits, but the same ops are dispatched, so
counting them on CPU tells how many a GPU step would have (device-to-host copies only exist off
the CPU). ``aten.item`` and ``aten.is_nonzero`` are composite: they reach a dispatch mode as
``_local_scalar_dense`` and are counted once, as that.

The step (book-keeping on, the library's default) is that of :mod:`benchmarks.long_context`:
``LlamaForCausalLM`` with the SmolLM2-135M architecture (random init, tied embedding / head
frozen, every block and the final norm trainable), ``opacus_rc.PrivacyEngine(
clipping="randomized")``, Hutchinson ``k``, SGD. Phases: ``forward`` (with the loss),
``backward`` (``loss.backward()``: the pass, the clip factors and the clipped sum),
``step`` (``optimizer.step()``: noise, accountant) and ``zero_grad``. Every sync is attributed to
the innermost Python frame inside ``opacus_rc`` or ``opacus`` (``path:line (function)``), else to
the innermost frame outside torch, marked ``other:`` (e.g. transformers' mask preparation).
``library`` counts only the ``opacus_rc``/``opacus`` ones: that is what issue 12's target
(at most 2 per step) is about.

Examples::

    python -m benchmarks.host_syncs                # 30 blocks, T = 64, B = 2, CPU
    python -m benchmarks.host_syncs --layers 4
    python -m benchmarks.host_syncs --quick        # tiny Llama, seconds

Import :func:`count_host_syncs` to assert on the counts.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import common, long_context

NAME = "host_syncs"
PHASES = ("forward", "backward", "step", "zero_grad")
COLUMNS = ["phase", "kind", "op", "site", "library", "per_step", "layers", "T", "B", "device"]
aten = torch.ops.aten

_SCALAR_READS = (aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal)
_DATA_DEPENDENT_SHAPE = (
    aten.nonzero,
    aten.masked_select,
    aten._unique2,
    aten.unique_consecutive,
    aten.unique_dim,
)
_COPIES = (aten._to_copy, aten.copy_, aten._copy_from, aten._copy_from_and_resize)


def _is_device_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type not in ("cpu", "meta")


def sync_kind(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The kind of host synchronisation ``func(*args, **kwargs)`` is, or None.

    Returns:
        ``"scalar read"``, ``"data-dependent shape"``, ``"copy to host"`` or None.
    """
    packet = func.overloadpacket
    if packet in _SCALAR_READS:
        return "scalar read"
    if packet in _DATA_DEPENDENT_SHAPE:
        return "data-dependent shape"
    if packet is aten.index and len(args) > 1:
        indices = args[1] or ()
        if any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        ):
            return "data-dependent shape"
    if packet in _COPIES:
        if packet is aten._to_copy:
            target = kwargs.get("device")
            if (
                _is_device_tensor(args[0])
                and target is not None
                and torch.device(target).type == "cpu"
            ):
                return "copy to host"
        elif len(args) >= 2:
            dst, src = args[0], args[1]
            if (
                isinstance(dst, torch.Tensor)
                and dst.device.type == "cpu"
                and _is_device_tensor(src)
            ):
                return "copy to host"
    return None


@dataclass
class SyncRecord:
    """Counts of host synchronisations keyed by ``(phase, kind, op, site)``."""

    counts: Counter = field(default_factory=Counter)

    def total(self, *, phase: str | None = None, library_only: bool = False) -> int:
        return sum(
            n
            for (ph, _kind, _op, site), n in self.counts.items()
            if (phase is None or ph == phase) and (not library_only or is_library_site(site))
        )


def is_library_site(site: str) -> bool:
    """Whether a :func:`benchmarks.common.call_site` string is inside ``opacus_rc`` or
    ``opacus``."""
    return not site.startswith("other:")


class HostSyncCounter(TorchDispatchMode):
    """Counts host synchronisations (:func:`sync_kind`) per phase, op and call site.

    Set :attr:`phase` as the measured code moves on; ops run while it is None are not counted.
    Sites are :func:`benchmarks.common.call_site` strings with ``callers`` calling library frames
    appended (``site <- caller``).

    Example::

        with HostSyncCounter() as counter:
            counter.phase = "forward"
            t.sum().item()
        counter.record.total()  # 1
    """

    def __init__(self, *, callers: int = 1) -> None:
        super().__init__()
        self.callers = callers
        self.phase: str | None = "all"
        self.record = SyncRecord()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.phase is not None:
            kind = sync_kind(func, args, kwargs)
            if kind is not None:
                site = common.call_site(callers=self.callers)
                self.record.counts[(self.phase, kind, func.overloadpacket.__name__, site)] += 1
        return func(*args, **kwargs)


@dataclass
class HostSyncResult:
    """What :func:`count_host_syncs` measured (counts are per step, averaged over ``steps``).

    Attributes:
        per_phase: ``{phase: syncs per step}`` for :data:`PHASES` (all call sites).
        library_per_phase: The same, only syncs inside ``opacus_rc`` / ``opacus``.
        per_site: ``{(phase, kind, op, site): syncs per step}``.
        total: Syncs per step, all call sites.
        library_total: Syncs per step inside ``opacus_rc`` / ``opacus``.
        steps_agree: Every counted step had the same counts.
        layers, T, B, device: The measured configuration.
    """

    per_phase: dict[str, float]
    library_per_phase: dict[str, float]
    per_site: dict[tuple[str, str, str, str], float]
    total: float
    library_total: float
    steps_agree: bool
    layers: int
    T: int
    B: int
    device: str


def count_host_syncs(
    *,
    layers: int = 30,
    seq_len: int = 64,
    batch_size: int = 2,
    sketch_dim: int = 32,
    model: str = "smollm2",
    steps: int = 2,
    warmup: int = 1,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> HostSyncResult:
    """Host synchronisations of one randomized-clipping step with book-keeping.

    Args:
        layers: Transformer blocks (all trainable).
        seq_len: ``T``.
        batch_size: ``B``.
        sketch_dim: Hutchinson ``k``.
        model: ``"smollm2"`` (SmolLM2-135M's shapes) or ``"tiny-llama"``.
        steps: Counted steps (the result is per step).
        warmup: Uncounted steps first (lazy initialisation).
        device: Where the step runs.
        seed: Seed of the weights and tokens.

    Returns:
        A :class:`HostSyncResult`.

    Raises:
        RuntimeError: If the step raises (e.g. a trainable parameter without gradient).
    """
    common.quiet_warnings()
    device = torch.device(device)
    cfg = {"model": model, "layers": layers, "seed": seed, "k": sketch_dim}
    base, ids = long_context.build_base(cfg, seq_len, batch_size, device)
    method = long_context.LMMethod("rc_bookkeeping", base, ids, cfg)
    for _ in range(warmup):
        method.step()
    per_step: list[Counter] = []
    for _ in range(steps):
        with HostSyncCounter() as counter:
            method.step(
                phase=lambda name: setattr(counter, "phase", None if name == "done" else name)
            )
        per_step.append(counter.record.counts)
    summed: Counter = Counter()
    for c in per_step:
        summed.update(c)
    record = SyncRecord(Counter({k: v / steps for k, v in summed.items()}))
    return HostSyncResult(
        per_phase={p: record.total(phase=p) for p in PHASES},
        library_per_phase={p: record.total(phase=p, library_only=True) for p in PHASES},
        per_site=dict(record.counts),
        total=record.total(),
        library_total=record.total(library_only=True),
        steps_agree=all(c == per_step[0] for c in per_step),
        layers=layers,
        T=seq_len,
        B=batch_size,
        device=str(device),
    )


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    return f"{x:g}"


def rows_of(result: HostSyncResult) -> list[dict[str, Any]]:
    rows = []
    order = {p: i for i, p in enumerate(PHASES)}
    for (phase, kind, op, site), n in sorted(
        result.per_site.items(), key=lambda kv: (order.get(kv[0][0], 9), -kv[1], kv[0][3])
    ):
        rows.append(
            {
                "phase": phase,
                "kind": kind,
                "op": op,
                "site": site,
                "library": is_library_site(site),
                "per_step": n,
                "layers": result.layers,
                "T": result.T,
                "B": result.B,
                "device": result.device,
            }
        )
    return rows


def summary_markdown(result: HostSyncResult, cfg: dict, info: dict) -> str:
    L = result.layers
    target = cfg.get("target", 2)
    passed = result.library_total <= target
    phase_rows = [
        {
            "phase": p,
            "all": _fmt(result.per_phase[p]),
            "library": _fmt(result.library_per_phase[p]),
        }
        for p in PHASES
    ]
    phase_rows.append(
        {"phase": "**total**", "all": _fmt(result.total), "library": _fmt(result.library_total)}
    )
    site_rows = [
        {**r, "per_step": _fmt(r["per_step"]), "per_layer": f"{r['per_step'] / L:.3g}"}
        for r in rows_of(result)
    ]
    parts = [
        "# Host synchronisations per randomized-clipping step (issue 12)",
        "",
        f"`LlamaForCausalLM`, SmolLM2-135M architecture (`{cfg['model']}`), {L} blocks (all "
        f"trainable, tied embedding / head frozen), T = {result.T}, B = {result.B}, "
        f'`clipping="randomized"`, Hutchinson k = {cfg["k"]}, book-keeping on (one backward '
        f"pass), SGD, on `{result.device}`. Counted by `benchmarks.host_syncs.HostSyncCounter` "
        "(a `TorchDispatchMode`): scalar reads (`aten._local_scalar_dense`, what `.item()`, "
        "`bool(t)`, `float(t)` dispatch; `aten.equal`), ops with a data-dependent output shape, "
        "device-to-host copies (none exist on CPU). Per step, mean of "
        f"{cfg['steps']} step(s) after {cfg['warmup']} warm-up step(s); the counted steps "
        f"{'agree' if result.steps_agree else 'DIFFER'}. `library`: syncs whose innermost "
        "Python frame outside torch is in `opacus_rc` or `opacus` (`<-` names the library "
        "function that called it); `other:` sites are outside both (`via`: the library frame "
        "that led there).",
        "",
        common.machine_markdown(info),
        "",
        "## Target",
        "",
        "| requirement | value | bound | result |",
        "|---|---|---|---|",
        f"| library host syncs per step, {L} blocks | {_fmt(result.library_total)} | <= {target} "
        f"| {'PASS' if passed else 'FAIL'} |",
        "",
        "## Per phase",
        "",
        common.markdown_table(phase_rows, ["phase", "all", "library"]),
        "",
        "## Per call site",
        "",
        common.markdown_table(
            site_rows,
            ["phase", "kind", "op", "site", "per_step", "per_layer"],
            ["phase", "kind", "op", "call site", "per step", f"per step / {L} blocks"],
        ),
        "",
    ]
    return "\n".join(parts)


def plot(result: HostSyncResult, path: Path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 1.6]})
    lib = [result.library_per_phase[p] for p in PHASES]
    other = [result.per_phase[p] - result.library_per_phase[p] for p in PHASES]
    axes[0].bar(PHASES, lib, label="opacus_rc / opacus")
    axes[0].bar(PHASES, other, bottom=lib, label="other")
    axes[0].set_ylabel("host syncs per step")
    axes[0].tick_params(axis="x", labelrotation=30)
    axes[0].legend(fontsize=8, loc="upper left")
    axes[0].set_title(f"{result.layers} blocks, T={result.T}, B={result.B}", fontsize=9)
    sites: Counter = Counter()
    for (_ph, _k, _op, site), n in result.per_site.items():
        sites[site.split(" <- ")[0].split(" via ")[0]] += n  # the innermost frame only
    top = sites.most_common(12)[::-1]
    if top:
        axes[1].barh([s for s, _ in top], [n for _, n in top])
    axes[1].set_xlabel("host syncs per step")
    axes[1].tick_params(axis="y", labelsize=7)
    axes[1].set_title("by call site (innermost frame; all phases)", fontsize=9)
    fig.tight_layout()
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: profile's)")
    args = parser.parse_args(argv)
    cfg, out, device = common.resolve(args, NAME)
    if args.layers:
        cfg["layers"] = args.layers
    result = count_host_syncs(
        layers=cfg["layers"],
        seq_len=cfg["T"],
        batch_size=cfg["B"],
        sketch_dim=cfg["k"],
        model=cfg["model"],
        steps=cfg["steps"],
        warmup=cfg["warmup"],
        device=device,
        seed=cfg["seed"],
    )
    info = common.machine_info(device)
    stem = common.result_stem(NAME, cfg, device)
    common.write_csv(out / f"{stem}.csv", rows_of(result), COLUMNS)
    common.write_text(out / f"{stem}.md", summary_markdown(result, cfg, info))
    plot(result, out / f"{stem}.png")
    width = max((len(s) for (_p, _k, _o, s) in result.per_site), default=10)
    print(f"host syncs per step ({result.layers} blocks, T={result.T}, B={result.B}):")
    for p in PHASES:
        print(
            f"  {p:>9}: {_fmt(result.per_phase[p]):>6} "
            f"(library {_fmt(result.library_per_phase[p])})"
        )
    print(f"  {'total':>9}: {_fmt(result.total):>6} (library {_fmt(result.library_total)})")
    for r in rows_of(result):
        print(f"  {r['phase']:>9}  {r['site']:<{width}}  {r['op']:<20} {_fmt(r['per_step']):>6}")
    print(f"wrote {out / stem}.csv, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
