"""Issue 34: the fixed per-step cost of randomized clipping, against the non-private step.

The model is :mod:`benchmarks.long_context`'s: ``LlamaForCausalLM`` with SmolLM2-135M's shapes
(hidden 576, 9 heads, 3 KV heads, MLP 1536, vocabulary 49,152), randomly initialised, cut to
``layers`` decoder blocks (4 in the full profile), every block and the final norm trainable, the
tied embedding / LM head frozen; next-token loss over the full ``B x T x V`` logits, one privacy
unit per sequence, SGD, ``sigma = 1``, ``C = 1``, Hutchinson ``k``. Methods
(:class:`benchmarks.long_context.LMMethod`): ``non_private``, ``rc_bookkeeping``
(``opacus_rc.PrivacyEngine(clipping="randomized")``, book-keeping on, the default),
``opacus_hooks`` and ``opacus_ghost``, with activation checkpointing ``off`` and
``non-reentrant`` (HF ``gradient_checkpointing_enable()``).

Per (checkpointing, T, B), every method is built in **one process** (same weights and tokens)
and timed **interleaved**: ``warmup`` untimed steps each, then ``rounds`` rounds in which every
method runs one step (the order rotated each round). Reported: the median step time, and
``time_ratio``, the median over rounds of the step's time divided by the non-private step's
time **in the same round** (drifts of the machine's load cancel), and ``cpu_ratio``, the same
with the process's CPU time (``time.process_time``: with one thread it leaves out the time the
step waited for a core, so it is the measure to read on a shared, loaded machine), and
``page_faults`` and ``system_median_s``, the median minor page faults per step and the kernel
CPU time of the step (``resource.getrusage``): glibc returns large freed blocks to the system,
so every step faults its big temporaries in again, a cost that varies between runs and
machines and that a GPU's caching allocator does not pay. The load average (``uptime``) before
and after each cell is recorded. Then, on one more step of each method:

* ``flops_ratio``: ``FlopCounterMode`` FLOPs (matrix products, CPU flash attention counted with
  torch's CUDA formulas, :func:`benchmarks.common.count_flops`) over the non-private step's;
* ``aten_ops`` and ``copies``: ops (and ``copy_`` / ``_to_copy`` ops) dispatched per step,
  counted by a ``TorchDispatchMode`` (:class:`OpCounter`; as :mod:`benchmarks.host_syncs`);
* ``package_calls``: Python function calls into the method's package per step (``opacus_rc``
  for rc, ``opacus`` for Opacus' methods), and ``torch_calls`` into ``torch``'s Python layer,
  counted with :func:`sys.setprofile` (as :mod:`benchmarks.step_functions`).

**Attribution** (``attribution_cells``): ``torch.profiler`` over ``profile_steps`` steps of the
non-private and the randomized-clipping step; every event's self CPU time is grouped by its
name and by the innermost ``opacus_rc`` frame of its Python stack (the line that issued it),
and the table lists, per group, rc minus non-private in ms per step, largest first. Ops issued
from ``opacus_rc`` exist only in the rc step; ops without a library frame (the model's forward,
autograd's backward kernels) are compared with the non-private step's ops of the same name.
``untracked`` is the profiled step's wall time minus the self time of all events (Python and
dispatch between ops).

Two micro-benchmarks of issue 34's item 2 are written next to it: the per-sample max-abs pass
before each sketch (``vector_norm(ord=inf)``, the code before issue 34, against
:func:`opacus_rc.sketching.sample_absmax` and ``|t|.amax()``) and the exact per-sample norm of
``LlamaRMSNorm`` (the closed form of :mod:`opacus_rc.grad_sample.norm_layers` against the
``torch.func`` replay, :class:`opacus_rc.grad_sample.functorch.FunctorchGradSampler`, that it
replaces).

Run with one thread and ``OMP_WAIT_POLICY=PASSIVE`` (set here if unset, before torch starts its
thread pool when this module is the entry point) on a quiet machine. Results:
``step_overhead.{csv,md}`` and ``step_overhead_attribution.csv``.

Examples::

    python -m benchmarks.step_overhead --quick          # tiny Llama, seconds
    python -m benchmarks.step_overhead                  # the config's grid
    python -m benchmarks.step_overhead --T 64 1024 --B 1 8
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import gc  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks import common, long_context  # noqa: E402

NAME = "step_overhead"
BASELINE = "non_private"
METHODS = ("non_private", "rc_bookkeeping", "opacus_hooks", "opacus_ghost")
CHECKPOINTING = ("off", "non-reentrant")
COLUMNS = [
    "checkpointing",
    "T",
    "B",
    "method",
    "status",
    "time_median_s",
    "time_ratio",
    "time_ratio_of_medians",
    "cpu_median_s",
    "cpu_ratio",
    "system_median_s",
    "page_faults",
    "rounds",
    "flops",
    "flops_ratio",
    "aten_ops",
    "aten_ops_ratio",
    "copies",
    "package_calls",
    "torch_calls",
    "load_before",
    "load_after",
]
ATTRIBUTION_COLUMNS = [
    "checkpointing",
    "T",
    "B",
    "name",
    "site",
    "rc_ms",
    "np_ms",
    "delta_ms",
    "rc_calls",
    "np_calls",
]
_COPY_OPS = ("copy_", "_to_copy")


# ----------------------------------------------------------------------------------------------
# Counters
# ----------------------------------------------------------------------------------------------


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, by overload packet name.

    Example::

        with OpCounter() as ops:
            (torch.ones(3) * 2).sum()
        ops.total  # 3: ones, mul, sum
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _package_root(name: str) -> str:
    module = __import__(name)
    return str(Path(module.__file__).resolve().parent) + os.sep


def count_python_calls(fn: Callable[[], Any], packages: tuple[str, ...]) -> dict[str, int]:
    """Python function calls (``sys.setprofile`` ``"call"`` events) into each package's files
    during ``fn()``.

    Args:
        fn: The measured call.
        packages: Top-level package names, e.g. ``("opacus_rc", "torch")``; a package nested in
            another's folder is counted for the more specific one only.

    Returns:
        ``{package: calls}``.
    """
    roots = sorted(((_package_root(p), p) for p in packages), key=lambda r: -len(r[0]))
    by_file: dict[str, str | None] = {}
    calls: Counter[str] = Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        owner = by_file.get(path, "")
        if owner == "":
            real = os.path.realpath(path)
            owner = next((p for root, p in roots if real.startswith(root)), None)
            by_file[path] = owner
        if owner is not None:
            calls[owner] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {p: calls[p] for p in packages}


def instrument(method: long_context.LMMethod) -> dict[str, Any]:
    """FLOPs, aten ops and Python calls of one step each (two steps of ``method``)."""
    with OpCounter() as ops:
        _, flops = common.count_flops(method.step)
    package = "opacus_rc" if method.name.startswith("rc_") else "opacus"
    calls = count_python_calls(method.step, (package, "torch"))
    return {
        "flops": flops,
        "aten_ops": ops.total,
        "copies": sum(ops.counts[c] for c in _COPY_OPS),
        "package_calls": calls[package] if method.name != BASELINE else 0,
        "torch_calls": calls["torch"],
    }


# ----------------------------------------------------------------------------------------------
# One cell: interleaved timing, then the counts
# ----------------------------------------------------------------------------------------------


def _runs(cfg: dict[str, Any], name: str, checkpointing: str, T: int) -> str | None:
    """Why ``name`` is not run in this cell (the config's ``max_T`` and ``checkpointed``), or
    None."""
    max_T = cfg.get("max_T", {}).get(name)
    if max_T is not None and max_T < T:
        return f"skipped: T > {max_T} for {name} (config max_T)"
    if checkpointing != "off" and name not in cfg.get("checkpointed", METHODS):
        return f"skipped: {name} not run with checkpointing (config checkpointed)"
    return None


def measure_cell(
    cfg: dict[str, Any], checkpointing: str, T: int, B: int, log: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """Interleaved step times and per-step counts of every method at one (checkpointing, T, B).

    Returns:
        One row per method of ``cfg["methods"]`` (:data:`COLUMNS`); a method that raises or is
        skipped gets its ``status`` and no numbers.
    """
    common.quiet_warnings()
    device = torch.device("cpu")
    rows: dict[str, dict[str, Any]] = {}
    methods: dict[str, long_context.LMMethod] = {}
    load_before = long_context.load_average()
    for name in cfg["methods"]:
        row = rows[name] = {"checkpointing": checkpointing, "T": T, "B": B, "method": name}
        skip = _runs(cfg, name, checkpointing, T)
        if skip:
            row["status"] = skip
            continue
        try:
            model, ids = long_context.build_base(cfg, T, B, device)  # same weights and tokens
            method = long_context.LMMethod(name, model, ids, cfg, checkpointing)
            for _ in range(cfg["warmup"]):
                method.step()
            methods[name] = method
            row["status"] = "ok"
        except Exception as err:  # noqa: BLE001 - reported in the results
            row["status"] = long_context.first_line(err)
            log(f"[{checkpointing} T={T} B={B} {name}] {row['status']}")
    times: dict[str, list[float]] = {n: [] for n in methods}
    cpu: dict[str, list[float]] = {n: [] for n in methods}
    system: dict[str, list[float]] = {n: [] for n in methods}
    faults: dict[str, list[int]] = {n: [] for n in methods}
    order = list(methods)
    for r in range(cfg["rounds"]):
        shift = r % max(len(order), 1)
        for name in order[shift:] + order[:shift]:
            if rows[name]["status"] != "ok":
                continue
            try:
                gc.collect()
                u0 = resource.getrusage(resource.RUSAGE_SELF)
                c0 = time.process_time()
                times[name].append(common.time_one(methods[name].step, device))
                cpu[name].append(time.process_time() - c0)
                u1 = resource.getrusage(resource.RUSAGE_SELF)
                system[name].append(u1.ru_stime - u0.ru_stime)
                faults[name].append(u1.ru_minflt - u0.ru_minflt)
            except Exception as err:  # noqa: BLE001
                rows[name]["status"] = long_context.first_line(err)
    base_times, base_cpu = times.get(BASELINE, []), cpu.get(BASELINE, [])
    for name, ts in times.items():
        row = rows[name]
        if row["status"] != "ok" or not ts:
            continue
        row["time_median_s"] = common.median(ts)
        row["cpu_median_s"] = common.median(cpu[name])
        row["system_median_s"] = common.median(system[name])
        row["page_faults"] = round(common.median(faults[name]))
        row["rounds"] = len(ts)
        if base_times and len(base_times) == len(ts):
            row["time_ratio"] = common.median([t / b for t, b in zip(ts, base_times)])
            row["time_ratio_of_medians"] = row["time_median_s"] / common.median(base_times)
            row["cpu_ratio"] = common.median([t / b for t, b in zip(cpu[name], base_cpu)])
    for name, method in methods.items():
        if rows[name]["status"] != "ok":
            continue
        try:
            rows[name].update(instrument(method))
        except Exception as err:  # noqa: BLE001
            rows[name]["status"] = "counts " + long_context.first_line(err)
    methods.clear()
    gc.collect()
    load_after = long_context.load_average()
    base = rows.get(BASELINE, {})
    for row in rows.values():
        row["load_before"], row["load_after"] = load_before, load_after
        for col, ratio in (("flops", "flops_ratio"), ("aten_ops", "aten_ops_ratio")):
            if row.get(col) and base.get(col):
                row[ratio] = row[col] / base[col]
        log(
            f"[{checkpointing} T={T} B={B} {row['method']}] {row['status']} "
            f"t={row.get('time_median_s')} ratio={row.get('time_ratio')} "
            f"flops={row.get('flops_ratio')} ops={row.get('aten_ops')} "
            f"calls={row.get('package_calls')}"
        )
    return list(rows.values())


# ----------------------------------------------------------------------------------------------
# Attribution of the rc-only time (torch.profiler)
# ----------------------------------------------------------------------------------------------


PYTHON = "python (interpreter, self time of Python functions)"


_AUTOGRAD_NODE = "autograd::engine::evaluate_function"
_PASS_THROUGH = ("torch/", "<built-in", "contextlib.py", "functools.py", "typing.py")


def _site(evt: Any, cache: dict[int, str]) -> str:
    """Who issued ``evt``: the innermost Python function among ``evt`` and its ancestors that is
    not inside ``torch`` (nor a builtin); its profiler name (``"opacus_rc/path.py(first line):
    name"``) if it is an ``opacus_rc`` function (or an ``opacus`` one, which the package calls),
    else ``""`` (the model's code, transformers,
    autograd's kernels). So an op of the model's forward run under the wrapper's ``forward``
    belongs to the model, and an op that a hook issues through ``torch.nn`` to the hook. An op
    inside an autograd node's evaluation (``autograd::engine::evaluate_function``) with no
    Python function in between is autograd's backward kernel: ``""``, although the backward
    was started from an ``opacus_rc`` function."""
    chain = []
    node = evt
    site = ""
    while node is not None:
        key = id(node)
        if key in cache:
            site = cache[key]
            break
        chain.append(key)
        if not node.is_python_function and node.name.startswith(_AUTOGRAD_NODE):
            break  # a kernel of autograd's backward (the model's), whoever called backward()
        if node.is_python_function and not node.name.startswith(_PASS_THROUGH):
            site = node.name if node.name.startswith(("opacus_rc/", "opacus/")) else ""
            break
        node = node.cpu_parent
    for key in chain:
        cache[key] = site
    return site


def profile_method(method: long_context.LMMethod, steps: int) -> tuple[dict, float]:
    """Self CPU time (us) and calls per ``(event, opacus_rc function)`` summed over ``steps``
    profiled steps, and the profiled wall time (s) of those steps.

    Ops and ``record_function`` ranges keep their names; the self time of Python functions is
    pooled as :data:`PYTHON`, so that every row is either kernel or interpreter time.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            method.step()
        wall = time.perf_counter() - t0
    groups: dict[tuple[str, str], list[float]] = {}
    cache: dict[int, str] = {}
    events = prof.events()
    for evt in events:
        name = PYTHON if evt.is_python_function else evt.name
        acc = groups.setdefault((name, _site(evt, cache)), [0.0, 0])
        acc[0] += evt.self_cpu_time_total
        acc[1] += 0 if evt.is_python_function else 1
    return groups, wall


def attribute(
    cfg: dict[str, Any], checkpointing: str, T: int, B: int, log: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """rc minus non-private self CPU time per (event, site), ms per step (module docstring).

    Returns:
        Rows of :data:`ATTRIBUTION_COLUMNS`, largest ``delta_ms`` first, the last one
        ``untracked`` (wall time minus the events' self time).
    """
    common.quiet_warnings()
    device = torch.device("cpu")
    steps = int(cfg["profile_steps"])
    result = {}
    for name in (BASELINE, "rc_bookkeeping"):
        model, ids = long_context.build_base(cfg, T, B, device)
        method = long_context.LMMethod(name, model, ids, cfg, checkpointing)
        for _ in range(max(cfg["warmup"], 1)):
            method.step()
        result[name] = profile_method(method, steps)
        del method, model
        gc.collect()
    (rc, rc_wall), (np_, np_wall) = result["rc_bookkeeping"], result[BASELINE]
    np_by_name: dict[str, list[float]] = {}
    for (name, _), (us, n) in np_.items():
        acc = np_by_name.setdefault(name, [0.0, 0])
        acc[0] += us
        acc[1] += n
    rows = []
    seen_np = set()
    for (name, site), (us, n) in rc.items():
        base_us, base_n = (0.0, 0) if site else np_by_name.get(name, (0.0, 0))
        if not site:
            seen_np.add(name)
        rows.append(
            {
                "name": name,
                "site": site or "(model / autograd; against non-private's)",
                "rc_ms": us / 1e3 / steps,
                "np_ms": base_us / 1e3 / steps,
                "rc_calls": n / steps,
                "np_calls": base_n / steps,
            }
        )
    for name, (us, n) in np_by_name.items():
        if name not in seen_np:
            rows.append(
                {
                    "name": name,
                    "site": "(non-private only)",
                    "rc_ms": 0.0,
                    "np_ms": us / 1e3 / steps,
                    "rc_calls": 0,
                    "np_calls": n / steps,
                }
            )
    for row in rows:
        row["delta_ms"] = row["rc_ms"] - row["np_ms"]
    rows.sort(key=lambda r: -r["delta_ms"])
    tracked_rc = sum(us for us, _ in rc.values()) / 1e3 / steps
    tracked_np = sum(us for us, _ in np_.values()) / 1e3 / steps
    untracked = {
        "name": "untracked",
        "site": "profiled wall time minus the events' self time (Python, dispatch)",
        "rc_ms": rc_wall * 1e3 / steps - tracked_rc,
        "np_ms": np_wall * 1e3 / steps - tracked_np,
        "rc_calls": None,
        "np_calls": None,
    }
    untracked["delta_ms"] = untracked["rc_ms"] - untracked["np_ms"]
    total = {
        "name": "total (profiled wall)",
        "site": "",
        "rc_ms": rc_wall * 1e3 / steps,
        "np_ms": np_wall * 1e3 / steps,
        "delta_ms": (rc_wall - np_wall) * 1e3 / steps,
    }
    for row in [*rows, untracked, total]:
        row.update(checkpointing=checkpointing, T=T, B=B)
    log(
        f"[attribution {checkpointing} T={T} B={B}] rc {total['rc_ms']:.1f} ms, np "
        f"{total['np_ms']:.1f} ms per profiled step"
    )
    return [*rows, untracked, total]


# ----------------------------------------------------------------------------------------------
# Micro-benchmarks of item 2: the max-abs pass and the norm layers' exact norms
# ----------------------------------------------------------------------------------------------


def _time_us(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(2):
        fn()
    return 1e6 * common.median([common.time_one(fn, torch.device("cpu")) for _ in range(repeats)])


def _absmax_row(shape: list[int], repeats: int) -> dict[str, Any]:
    from opacus_rc.sketching import sample_absmax

    t = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    dims = tuple(range(1, t.dim()))
    ways = {
        "vector_norm(ord=inf) (before)": lambda: torch.linalg.vector_norm(
            t, ord=math.inf, dim=dims
        ),
        "max(amax, -amin) (sample_absmax)": lambda: sample_absmax(t),
        "abs().amax()": lambda: t.abs().amax(dim=dims),
    }
    row: dict[str, Any] = {"shape": "x".join(map(str, shape))}
    for way, fn in ways.items():
        row[way] = _time_us(fn, repeats)
    return row


def absmax_timing(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Microseconds per per-sample max-abs pass, three ways, at ``cfg["absmax_shapes"]``."""
    return [_absmax_row(shape, cfg["micro_repeats"]) for shape in cfg["absmax_shapes"]]


def _norm_row(B: int, T: int, d: int, repeats: int) -> dict[str, Any]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from opacus_rc.grad_sample.functorch import FunctorchGradSampler
    from opacus_rc.grad_sample.norm_layers import compute_norm_layer_norm_sample

    layer = LlamaRMSNorm(d, eps=1e-5)
    g = torch.Generator().manual_seed(0)
    x, G = torch.randn(B, T, d, generator=g), torch.randn(B, T, d, generator=g)
    replay = FunctorchGradSampler(layer)

    def functorch() -> dict:
        grads = replay(layer, [x], G)
        return {p: v.reshape(B, -1).norm(dim=1) for p, v in grads.items()}

    def closed() -> dict:
        return compute_norm_layer_norm_sample(
            layer, [x], G, estimator=None, sketch_dim=1, generator=None
        )

    torch.testing.assert_close(
        functorch()[layer.weight], closed()[layer.weight], rtol=1e-4, atol=1e-6
    )
    row = {
        "shape": f"B={B}, T={T}, d={d}",
        "functorch_ms": _time_us(functorch, repeats) / 1e3,
        "closed_form_ms": _time_us(closed, repeats) / 1e3,
    }
    row["speedup"] = row["functorch_ms"] / row["closed_form_ms"]
    return row


def norm_layer_timing(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Milliseconds per exact per-sample norm of a ``LlamaRMSNorm(d)`` over ``(B, T, d)``:
    the ``torch.func`` replay against the closed form (which give the same norms)."""
    return [_norm_row(B, T, d, cfg["micro_repeats"]) for B, T, d in cfg["norm_shapes"]]


# ----------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------


def _x(v: Any) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{float(v):.3f}x"


def _n(v: Any) -> str:
    return "" if v is None else f"{int(v):,}"


def summary_markdown(
    rows: list[dict],
    attribution: list[dict],
    absmax: list[dict],
    norms: list[dict],
    cfg: dict,
    info: dict,
) -> str:
    arch = (
        "SmolLM2-135M's architecture"
        if cfg["model"] == "smollm2"
        else f"the `{cfg['model']}` architecture (quick profile)"
    )
    parts = [
        "# The step at its FLOPs: per-step overhead of randomized clipping (issue 34)",
        "",
        f"`LlamaForCausalLM` with {arch}, {cfg['layers']} decoder blocks, random init, every "
        "block and the final norm trainable (tied embedding / LM head frozen), next-token loss "
        f"over the full logits, SGD, sigma = 1, C = 1, Hutchinson k = {cfg['k']}. Methods "
        "interleaved in one process per cell, "
        f"{cfg['warmup']} warm-up step(s) each, then {cfg['rounds']} rounds; `time` is the "
        "median step, `ratio` the median over rounds of the step's time over the same round's "
        "non-private step (`ratio of medians` next to it in the CSV); `CPU time` the same with "
        "the process's CPU time (`time.process_time`; one thread, so it leaves out the time "
        "the step waited for a core on a loaded machine); page faults: the median of the "
        "process's minor page faults per step, with the system (kernel) CPU time they cost, "
        "`resource.getrusage` (a CPU allocator that returns freed blocks to the system faults "
        "them in again every step). FLOPs: `FlopCounterMode`; "
        "aten ops and copies (`copy_`, `_to_copy`): a `TorchDispatchMode` counter; calls: Python "
        "calls into the method's package (`opacus_rc` or `opacus`) and into `torch`, by "
        "`sys.setprofile`; each on one further step. `benchmarks/step_overhead.py` docstring.",
        "",
        common.machine_markdown(info),
        "",
    ]
    if cfg.get("grid_note"):
        parts += [cfg["grid_note"], ""]
    parts += ["## Step time, FLOPs and per-step counts against non-private", ""]
    table = []
    for r in rows:
        line = {
            "cell": f"{r['checkpointing']}, T={r['T']}, B={r['B']}",
            "method": r["method"],
        }
        if r.get("status") != "ok":
            line["time"] = str(r.get("status", ""))
        else:
            line.update(
                time=common.fmt_seconds(r.get("time_median_s")),
                ratio=_x(r.get("time_ratio")),
                cpu=f"{common.fmt_seconds(r.get('cpu_median_s'))} ({_x(r.get('cpu_ratio'))})",
                faults=""
                if r.get("page_faults") in (None, "")
                else f"{_n(r['page_faults'])} ({common.fmt_seconds(r.get('system_median_s'))})",
                flops=_x(r.get("flops_ratio")),
                ops=_n(r.get("aten_ops")),
                copies=_n(r.get("copies")),
                calls=_n(r.get("package_calls")),
                torch=_n(r.get("torch_calls")),
                load=f"{r.get('load_before', '')} -> {r.get('load_after', '')}",
            )
        table.append(line)
    cols = [
        "cell",
        "method",
        "time",
        "ratio",
        "cpu",
        "faults",
        "flops",
        "ops",
        "copies",
        "calls",
        "torch",
        "load",
    ]
    heads = [
        "cell",
        "method",
        "time / step",
        "time / non-private",
        "CPU time / step (/ non-private)",
        "page faults / step (system time)",
        "FLOPs / non-private",
        "aten ops / step",
        "copies / step",
        "package calls / step",
        "torch calls / step",
        "load (1, 5, 15 min) before -> after",
    ]
    parts += [common.markdown_table(table, cols, heads), ""]
    baseline = cfg.get("baseline")
    if baseline:
        parts += [
            f"## Against {baseline['label']}",
            "",
            "The same cells measured by this script on the other code (its own non-private "
            "step as the reference, in its own process).",
            "",
            "| cell | method | wall ratio before | wall ratio now | CPU ratio before | "
            "CPU ratio now | aten ops before | now | package calls before | now |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        old_rows = {
            (b["checkpointing"], int(b["T"]), int(b["B"]), b["method"]): b for b in baseline["rows"]
        }
        for r in rows:
            b = old_rows.get((r["checkpointing"], r["T"], r["B"], r["method"]))
            if b is None or r["method"] == BASELINE:
                continue

            def num(v: Any) -> float | None:
                return float(v) if v not in (None, "") else None

            parts.append(
                f"| {r['checkpointing']}, T={r['T']}, B={r['B']} | {r['method']} | "
                f"{_x(num(b.get('time_ratio')))} | {_x(r.get('time_ratio'))} | "
                f"{_x(num(b.get('cpu_ratio')))} | {_x(r.get('cpu_ratio'))} | "
                f"{_n(num(b.get('aten_ops')))} | {_n(r.get('aten_ops'))} | "
                f"{_n(num(b.get('package_calls')))} | {_n(r.get('package_calls'))} |"
            )
        parts.append("")
    floors = cfg.get("floors", [])
    if floors:
        parts += ["## The issue's floors (rc_bookkeeping time / non-private)", ""]
        parts += [
            "Wall-time ratio (the issue's measure, for a quiet machine) and CPU-time ratio "
            "(`time.process_time`, one thread: robust to other processes sharing the cores).",
            "",
            "| cell | bound | wall ratio | result | CPU ratio | result |",
            "|---|---|---|---|---|---|",
        ]
        for f in floors:
            r = next(
                (
                    x
                    for x in rows
                    if (x["checkpointing"], x["T"], x["B"], x["method"])
                    == (f["checkpointing"], f["T"], f["B"], "rc_bookkeeping")
                ),
                None,
            )
            value = r.get("time_ratio") if r else None
            cpu_value = r.get("cpu_ratio") if r else None
            verdict = "not measured" if value is None else ("PASS" if value <= f["max"] else "FAIL")
            cpu_verdict = "" if cpu_value is None else ("PASS" if cpu_value <= f["max"] else "FAIL")
            parts.append(
                f"| {f['checkpointing']}, T={f['T']}, B={f['B']} | <= {f['max']} | "
                f"{_x(value)} | {verdict} | {_x(cpu_value)} | {cpu_verdict} |"
            )
        parts.append("")
    if attribution:
        parts += [
            "## Attribution of the rc-only time (torch.profiler, ms per step)",
            "",
            "Self CPU time per event name and the innermost `opacus_rc` line that issued it; "
            "events without an `opacus_rc` frame are compared with the non-private step's events "
            "of the same name. Rows with |delta| >= "
            f"{cfg['attribution_min_ms']} ms (the CSV has all of them); the profiler's own "
            "overhead inflates both steps.",
            "",
        ]
        cells = sorted({(r["checkpointing"], r["T"], r["B"]) for r in attribution})
        for cell in cells:
            sub = [r for r in attribution if (r["checkpointing"], r["T"], r["B"]) == cell]
            shown = [
                {
                    **r,
                    "rc_calls": "" if r.get("rc_calls") is None else f"{r['rc_calls']:g}",
                    "np_calls": "" if r.get("np_calls") is None else f"{r['np_calls']:g}",
                }
                for r in sub
                if abs(r["delta_ms"]) >= cfg["attribution_min_ms"]
                or r["name"].startswith(("untracked", "total"))
            ]
            by_site: dict[str, float] = {}
            for r in sub:
                if r["name"].startswith(("untracked", "total")):
                    continue
                site = str(r.get("site", ""))
                key = site if site.startswith(("opacus_rc/", "opacus/")) else "(model / autograd)"
                by_site[key] = by_site.get(key, 0.0) + float(r["delta_ms"])
            grouped = [
                {"site": k, "delta_ms": v}
                for k, v in sorted(by_site.items(), key=lambda kv: -kv[1])
                if abs(v) >= cfg["attribution_min_ms"]
            ]
            parts += [f"### {cell[0]}, T={cell[1]}, B={cell[2]}", ""]
            parts += [
                "By function (every event it issued, kernels and interpreter; the model's "
                "and autograd's events net of the non-private step's):",
                "",
                common.markdown_table(
                    grouped,
                    ["site", "delta_ms"],
                    ["function", "rc - non-private (ms per step)"],
                    formats={"delta_ms": lambda v: f"{v:.1f}"},
                ),
                "",
                "By event and function:",
                "",
            ]
            parts += [
                common.markdown_table(
                    shown,
                    ["name", "site", "rc_ms", "np_ms", "delta_ms", "rc_calls", "np_calls"],
                    ["event", "opacus_rc site", "rc", "non-private", "delta", "rc n", "np n"],
                    formats={k: (lambda v: f"{v:.1f}") for k in ("rc_ms", "np_ms", "delta_ms")},
                ),
                "",
            ]
    if absmax:
        ways = [k for k in absmax[0] if k != "shape"]
        parts += [
            "## The max-abs pass before each sketch (microseconds per call, one thread)",
            "",
            common.markdown_table(
                absmax, ["shape", *ways], formats={w: (lambda v: f"{v:.0f}") for w in ways}
            ),
            "",
        ]
    if norms:
        parts += [
            "## Exact per-sample norm of LlamaRMSNorm: closed form against the torch.func replay",
            "",
            common.markdown_table(
                norms,
                ["shape", "functorch_ms", "closed_form_ms", "speedup"],
                ["shape", "functorch (ms)", "closed form (ms)", "speed-up"],
                formats={
                    "functorch_ms": lambda v: f"{v:.2f}",
                    "closed_form_ms": lambda v: f"{v:.2f}",
                    "speedup": lambda v: f"{v:.1f}x",
                },
            ),
            "",
        ]
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--T", type=int, nargs="*", default=None, help="override the T list")
    parser.add_argument("--B", type=int, nargs="*", default=None, help="override the B list")
    parser.add_argument(
        "--checkpointing", nargs="*", default=None, choices=CHECKPOINTING, help="override"
    )
    parser.add_argument("--methods", nargs="*", default=None, choices=METHODS, help="override")
    parser.add_argument(
        "--cells",
        nargs="*",
        default=None,
        help="measure only these cells, as checkpointing:T:B items (instead of the grid)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="override the rounds")
    parser.add_argument(
        "--baseline-csv",
        type=Path,
        default=None,
        help="a step_overhead.csv of other code (e.g. before a change): its ratios are shown "
        "next to this run's",
    )
    parser.add_argument("--baseline-label", default="baseline", help="what --baseline-csv is")
    parser.add_argument("--note", default="", help="a sentence added to the report (grid, load)")
    parser.add_argument(
        "--from-csv",
        type=Path,
        default=None,
        help="time no step: re-render the report from the step_overhead.csv (and the "
        "_attribution.csv beside it) in this folder; the micro-benchmarks run unless "
        "--no-micro",
    )
    parser.add_argument(
        "--attribution-cells",
        nargs="*",
        default=None,
        help="override, as checkpointing:T:B items (e.g. off:1024:1)",
    )
    parser.add_argument("--no-attribution", action="store_true", help="skip the profiler table")
    parser.add_argument("--no-micro", action="store_true", help="skip the micro-benchmarks")
    args = parser.parse_args(argv)
    cfg, out, device = common.resolve(args, NAME)
    if device.type != "cpu":
        raise SystemExit("step_overhead times CPU steps; use --device cpu")
    for key in ("T", "B", "checkpointing", "methods"):
        if getattr(args, key):
            cfg[key] = getattr(args, key)
    if args.rounds:
        cfg["rounds"] = args.rounds
    if args.note:
        cfg["grid_note"] = (args.note + " " + cfg.get("grid_note", "")).strip()
    if args.baseline_csv:
        cfg["baseline"] = {"label": args.baseline_label, "rows": common.read_csv(args.baseline_csv)}
    if args.attribution_cells is not None:
        cells = [c.split(":") for c in args.attribution_cells]
        cfg["attribution_cells"] = [[c, int(T), int(B)] for c, T, B in cells]
    if BASELINE not in cfg["methods"]:
        cfg["methods"] = [BASELINE, *cfg["methods"]]
    if args.no_attribution:
        cfg["attribution_cells"] = []
    info = common.machine_info(device)
    info["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "")
    info["uptime_load_average_at_start"] = long_context.load_average()
    started = time.perf_counter()
    stem = common.result_stem(NAME, cfg, device)
    rows: list[dict] = []
    attribution: list[dict] = []
    absmax: list[dict] = []
    norms: list[dict] = []

    def write() -> None:
        if not args.from_csv:
            info["run_minutes"] = round((time.perf_counter() - started) / 60, 1)
            info["uptime_load_average_now"] = long_context.load_average()
        common.write_csv(out / f"{stem}.csv", rows, COLUMNS)
        common.write_csv(out / f"{stem}_attribution.csv", attribution, ATTRIBUTION_COLUMNS)
        text = summary_markdown(rows, attribution, absmax, norms, cfg, info)
        common.write_text(out / f"{stem}.md", text)

    if args.from_csv:
        rows = read_rows(args.from_csv / f"{stem}.csv")
        attribution = read_rows(args.from_csv / f"{stem}_attribution.csv")
        old_md = args.from_csv / f"{stem}.md"
        machine = (
            next((x for x in old_md.read_text().splitlines() if x.startswith("Machine: ")), "")
            if old_md.exists()
            else ""
        )
        info = {"measured": machine.removeprefix("Machine: ") or "not recorded"}
        cfg["attribution_cells"] = []
    if not args.no_micro:
        absmax = absmax_timing(cfg)
        norms = norm_layer_timing(cfg)
        write()
    grid = [(c, T, B) for c in cfg["checkpointing"] for B in cfg["B"] for T in cfg["T"]]
    if args.from_csv:
        grid = []
    if args.cells:
        grid = [(c, int(T), int(B)) for c, T, B in (x.split(":") for x in args.cells)]
        cfg["grid_note"] = (
            cfg.get("grid_note", "") + f" Cells measured: {', '.join(args.cells)}."
        ).strip()
    for ckpt, T, B in grid:
        rows.extend(measure_cell(cfg, ckpt, T, B))
        write()  # after every cell: an interrupted run keeps what it measured
    for ckpt, T, B in cfg["attribution_cells"]:
        attribution.extend(attribute(cfg, ckpt, T, B))
        write()
    write()
    print(f"wrote {out / stem}.csv, .md and _attribution.csv")
    return 0


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a results CSV, numbers as numbers (``T``, ``B`` and counts as int), empty cells
    left out."""
    rows = []
    for raw in common.read_csv(path):
        row: dict[str, Any] = {}
        for key, value in raw.items():
            if value == "":
                continue
            try:
                number = float(value)
            except ValueError:
                row[key] = value
                continue
            row[key] = int(number) if number.is_integer() and "ratio" not in key else number
        rows.append(row)
    return rows


def ratio_summary(rows: list[dict]) -> dict[tuple, float]:
    """``{(checkpointing, T, B, method): time_ratio}`` of the measured rows."""
    return {
        (r["checkpointing"], r["T"], r["B"], r["method"]): r["time_ratio"]
        for r in rows
        if r.get("time_ratio") is not None
    }


__all__ = [
    "OpCounter",
    "attribute",
    "count_python_calls",
    "instrument",
    "main",
    "measure_cell",
    "ratio_summary",
]

if __name__ == "__main__":
    sys.exit(main())
