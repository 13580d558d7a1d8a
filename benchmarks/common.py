"""Shared helpers of the benchmark scripts: configuration, measurement and result files.

Measurements (see ``benchmarks/README.md``):

* FLOPs: :class:`torch.utils.flop_counter.FlopCounterMode`, which counts the matrix-product
  family (``mm``, ``bmm``, ``addmm``, ``baddbmm``, convolutions, attention) at 2 FLOPs per
  multiply-add. It is deterministic and machine independent; element-wise ops, reductions and
  factorizations (QR) are not counted.
* Peak extra memory on CPU: :class:`LiveTensorBytes`, a ``TorchDispatchMode`` that adds the bytes
  of every tensor storage an op creates inside the measured call and subtracts them when the
  storage is freed; the peak of that running sum is the peak extra memory. Storages that existed
  before the call (inputs, parameters) are not counted, nor are temporaries a kernel allocates
  internally without dispatching an op. On CUDA: ``torch.cuda.max_memory_allocated`` minus the
  memory allocated before the call (everything the caching allocator hands out).
* Wall time: median of repeats after warm-up calls; ``time.perf_counter`` on CPU, CUDA events on
  CUDA.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.weak import WeakIdKeyDictionary

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO_ROOT / "benchmarks"
CONFIG_PATH = BENCH_DIR / "config.json"
RESULTS_DIR = BENCH_DIR / "results"
QUICK_RESULTS_DIR = Path(tempfile.gettempdir()) / "opacus_rc_benchmarks_quick"
PROFILES = ("full", "quick", "gpu")

GiB = 2**30
MiB = 2**20


# ----------------------------------------------------------------------------------------------
# Configuration and command line
# ----------------------------------------------------------------------------------------------


def load_profile(section: str, profile: str, path: Path = CONFIG_PATH) -> dict[str, Any]:
    """One benchmark's settings: ``config[section]["full"]`` updated by the profile's overrides.

    Args:
        section: Benchmark name, a top-level key of the config file.
        profile: ``"full"`` (CPU, committed results), ``"quick"`` (CI) or ``"gpu"``.
        path: The JSON config file.

    Returns:
        The merged settings, with ``"profile"`` added.

    Raises:
        KeyError: If the section or profile is missing, naming what exists.
    """
    config = json.loads(Path(path).read_text())
    if section not in config:
        raise KeyError(f"no section {section!r} in {path}; sections: {sorted(config)}")
    sec = config[section]
    if profile not in sec:
        raise KeyError(f"section {section!r} of {path} has no profile {profile!r}: {sorted(sec)}")
    merged = dict(sec["full"])
    if profile != "full":
        merged.update(sec[profile])
    merged["profile"] = profile
    return merged


def arg_parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark script shares (config, profile, device, output folder)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", type=Path, default=CONFIG_PATH, help="JSON config (default: %(default)s)"
    )
    parser.add_argument(
        "--profile",
        choices=PROFILES,
        default=None,
        help="settings profile: full (CPU, committed results), quick (CI, seconds) or gpu "
        "(default: full, or gpu with --device cuda)",
    )
    parser.add_argument("--quick", action="store_true", help="same as --profile quick")
    parser.add_argument(
        "--device", default=None, help="cpu or cuda (default: the profile's device, else cpu)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output folder (default: {RESULTS_DIR.relative_to(REPO_ROOT)} for full and gpu "
        f"(gpu results get a _gpu suffix), {QUICK_RESULTS_DIR} for quick)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    return parser


def resolve(args: argparse.Namespace, section: str) -> tuple[dict[str, Any], Path, torch.device]:
    """Settings, output folder and device from parsed arguments; creates the output folder."""
    if args.quick and args.profile not in (None, "quick"):
        raise SystemExit("--quick conflicts with --profile " + args.profile)
    profile = "quick" if args.quick else args.profile
    if profile is None:
        profile = "gpu" if (args.device or "").startswith("cuda") else "full"
    cfg = load_profile(section, profile, args.config)
    device = torch.device(args.device or cfg.get("device", "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but torch.cuda.is_available() is False")
    out = args.out or (QUICK_RESULTS_DIR if profile == "quick" else RESULTS_DIR)
    out.mkdir(parents=True, exist_ok=True)
    threads = args.threads or cfg.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    return cfg, out, device


def quiet_warnings() -> None:
    """Silence the warnings every Opacus DP step repeats (they say nothing about the results)."""
    import warnings

    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="Secure RNG turned off")
    warnings.filterwarnings("ignore", message="Optimal order is")
    warnings.filterwarnings("ignore", category=UserWarning, module="opacus")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - transformers is a tutorials extra
        pass


def result_stem(name: str, cfg: Mapping[str, Any], device: torch.device) -> str:
    """File stem for a benchmark's results: ``name``, plus ``_gpu`` for CUDA runs."""
    return f"{name}_gpu" if device.type == "cuda" else name


# ----------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------


def _storages(tree: Any) -> Iterable[torch.UntypedStorage]:
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
            try:
                yield leaf.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
                continue


class LiveTensorBytes(TorchDispatchMode):
    """Tracks the bytes of tensor storages created inside the mode that are still alive.

    Every op's outputs are inspected; a storage seen for the first time as an output (not as an
    input: views of pre-existing tensors are free) adds its size to :attr:`live`, and a weak
    reference subtracts it when the storage is freed. :attr:`peak` is the maximum of
    :attr:`live`. Works on real and on ``meta`` tensors (sizes only), so it can measure
    configurations that would not fit in memory. Temporaries that a kernel allocates without
    dispatching an op are invisible to it.

    Example::

        with LiveTensorBytes() as mem:
            out = fn(a, b)
        mem.peak  # bytes
    """

    def __init__(self) -> None:
        super().__init__()
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: set[weakref.ref] = set()
        self.live = 0
        self.peak = 0

    def _release(self, nbytes: int) -> Callable[[weakref.ref], None]:
        def callback(ref: weakref.ref) -> None:
            self.live -= nbytes
            self._refs.discard(ref)

        return callback

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        for st in _storages((args, kwargs)):
            if st not in self._seen:
                self._seen[st] = 0  # existed before: not counted
        out = func(*args, **kwargs)
        for st in _storages(out):
            if st not in self._seen:
                nbytes = st.nbytes()
                self._seen[st] = nbytes
                self.live += nbytes
                self._refs.add(weakref.ref(st, self._release(nbytes)))
                self.peak = max(self.peak, self.live)
        return out


_LIBRARY_ROOTS: tuple[str, ...] | None = None


def _library_roots() -> tuple[str, ...]:
    """Source folders of ``opacus_rc`` and ``opacus`` (for :func:`call_site`)."""
    global _LIBRARY_ROOTS  # noqa: PLW0603 - a cache of two paths, filled on first use
    if _LIBRARY_ROOTS is None:
        import opacus

        import opacus_rc

        _LIBRARY_ROOTS = tuple(
            str(Path(m.__file__).resolve().parent) + os.sep for m in (opacus_rc, opacus)
        )
    return _LIBRARY_ROOTS


def call_site(skip: int = 1, *, callers: int = 0) -> str:
    """Where the current op was called from, as ``path:line (function)``.

    The innermost Python frame outside torch and the benchmark scripts (``benchmarks/*.py``).
    Inside ``opacus_rc`` or ``opacus`` its path is relative to the package's parent folder;
    otherwise it is prefixed ``other:`` (relative to ``site-packages`` where inside it) and
    followed by ``via <frame>``, the innermost ``opacus_rc``/``opacus`` frame on the stack, if
    any (e.g. a transformers line reached through Opacus' ``forward`` wrapper). With
    ``callers = n`` a library site is followed by up to ``n`` further ``opacus_rc``/``opacus``
    frames of other functions, outwards, each as `` <- path:line (function)`` (who called a
    helper).
    """
    import sys

    roots = _library_roots()
    torch_root = str(Path(torch.__file__).resolve().parent) + os.sep
    bench_dir = str(BENCH_DIR)
    marker = f"{os.sep}site-packages{os.sep}"

    def library(path: str, where: str) -> str | None:
        for root in roots:
            if path.startswith(root):
                return where.removeprefix(str(Path(root).parent) + os.sep)
        return None

    frame = sys._getframe(skip)
    site = None
    chain: list[str] = []
    while frame is not None:
        path = frame.f_code.co_filename
        where = f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        lib = library(path, where)
        if chain:
            if len(chain) > callers:
                break
            comprehension = frame.f_code.co_name.startswith("<")  # <listcomp>, <genexpr>
            if (
                lib is not None
                and not comprehension
                and not lib.endswith(chain[-1].rsplit(" ", 1)[-1])
            ):
                chain.append(lib)
        elif site is None:
            skipped = path.startswith(torch_root) or os.path.dirname(path) == bench_dir
            if lib is not None:
                chain.append(lib)
            elif not skipped and "<" not in path:
                site = "other: " + (where.split(marker, 1)[1] if marker in where else where)
        elif lib is not None:
            return f"{site} via {lib}"
        frame = frame.f_back
    if chain:
        return " <- ".join(chain)
    return site or "other: unknown"


def _cpu_attention_flops() -> dict[Any, Callable[..., int]]:
    """FLOP formulas for the CPU flash-attention kernels, which FlopCounterMode lacks.

    The same formulas torch uses for the CUDA kernels (full ``T x T`` scores, also when causal).
    """
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    mapping: dict[Any, Callable[..., int]] = {}
    if fwd is not None:
        mapping[fwd] = lambda q, k, v, *_, out_shape=None, **__: sdpa_flop_count(q, k, v)
    if bwd is not None:
        mapping[bwd] = lambda g, q, k, v, *_, out_shape=None, **__: sdpa_backward_flop_count(
            g, q, k, v
        )
    return mapping


def count_flops(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn()`` under ``FlopCounterMode``; return its result and the total FLOPs.

    CPU attention kernels are counted with torch's formulas for the CUDA ones.
    """
    with FlopCounterMode(display=False, custom_mapping=_cpu_attention_flops()) as counter:
        out = fn()
    return out, int(counter.get_total_flops())


def peak_extra_bytes(fn: Callable[[], Any], device: torch.device) -> tuple[int, str]:
    """Peak memory ``fn()`` allocates on top of what exists before the call.

    Returns:
        ``(bytes, source)`` with ``source`` ``"dispatch-tracker"`` (CPU or meta) or
        ``"cuda-allocator"``. The result of ``fn`` is released before returning.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
        return int(peak), "cuda-allocator"
    with LiveTensorBytes() as mem:
        out = fn()
    del out
    return int(mem.peak), "dispatch-tracker"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(
    fn: Callable[[], Any], *, repeats: int, warmup: int, device: torch.device
) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        times.append(time_one(fn, device))
    return times


def time_one(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call of ``fn`` (CUDA events on CUDA, ``perf_counter`` otherwise)."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def gemm_rate(device: torch.device, n: int | None = None) -> float:
    """Measured fp32 GEMM throughput in FLOP/s (used only to plan which configs to time)."""
    n = n or (4096 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    times = time_calls(lambda: a @ b, repeats=3, warmup=1, device=device)
    return 2 * n**3 / min(times)


def total_memory_bytes(device: torch.device) -> int:
    """Physical memory of the device (RAM for CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0


# ----------------------------------------------------------------------------------------------
# Machine description
# ----------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the results were measured on (written next to every result file)."""
    import opacus

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": round(total_memory_bytes(torch.device("cpu")) / GiB, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "opacus": opacus.__version__,
        "device": str(device),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_gib"] = round(total_memory_bytes(device) / GiB, 1)
    return info


# ----------------------------------------------------------------------------------------------
# Result files
# ----------------------------------------------------------------------------------------------


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """Write ``rows`` with exactly ``columns`` (missing values empty, other keys left out)."""
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _csv_value(row.get(c)) for c in columns})


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def markdown_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    headers: Sequence[str] | None = None,
    formats: Mapping[str, Callable[[Any], str]] | None = None,
) -> str:
    """A GitHub Markdown table of ``rows``."""
    headers = list(headers or columns)
    formats = formats or {}
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = []
        for c in columns:
            v = row.get(c)
            cells.append(formats[c](v) if c in formats else _md_value(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _md_value(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def machine_markdown(info: Mapping[str, Any]) -> str:
    return "Machine: " + ", ".join(f"{k}={v}" for k, v in info.items())


def write_text(path: Path, text: str) -> None:
    path.write_text(text.rstrip() + "\n")


def fmt_bytes(n: Any) -> str:
    """Human-readable binary size (``""`` for missing values)."""
    if n is None or n == "" or (isinstance(n, float) and math.isnan(n)):
        return ""
    n = float(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_flops(n: Any) -> str:
    if n is None or n == "" or (isinstance(n, float) and math.isnan(n)):
        return ""
    n = float(n)
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} FLOP"


def fmt_seconds(s: Any) -> str:
    if s is None or s == "" or (isinstance(s, float) and math.isnan(s)):
        return ""
    s = float(s)
    if s >= 1:
        return f"{s:.3g} s"
    return f"{s * 1e3:.3g} ms"


def fmt_ratio(r: Any) -> str:
    if r is None or r == "" or (isinstance(r, float) and math.isnan(r)):
        return ""
    r = float(r)
    if r == 0:
        return "0"
    if r < 0.01:
        return f"1/{1 / r:.0f}"
    return f"{r:.3g}"


def skipped_memory(nbytes: float) -> str:
    """The status of a configuration that does not fit (``"skipped: would need X GiB"``)."""
    return f"skipped: would need {nbytes / GiB:.1f} GiB"


def save_figure(fig: Any, path: Path) -> None:
    fig.savefig(path, dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)


def pyplot() -> Any:
    """matplotlib's pyplot with the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
