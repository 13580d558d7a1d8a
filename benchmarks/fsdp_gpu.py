"""Issue 35, item 3 on real devices: tokens/s and peak memory per rank of the paper's regime.

The model of :mod:`benchmarks.fsdp_regime` (Llama 3.2 1B shapes by default, ``layers`` blocks,
tied embedding / LM head, every weight trainable, random init), one sequence of ``T`` tokens
per rank, AdamW, float32 weights (TF32 matrix products on CUDA), for each method of the
profile (``non_private``, ``rc_bookkeeping``, and the ``*_today`` variants of :data:`VARIANTS`:
untied, RMSNorms frozen, what the FSDP2 path accepted before issue 35's item 1) and
checkpointing mode:

* run as a plain process (``python -m benchmarks.fsdp_gpu``): one device, no sharding;
* run under ``torchrun --nproc-per-node N`` (``WORLD_SIZE`` set): ``N`` ranks, NCCL on CUDA
  (gloo on CPU), ``fully_shard`` on every module with trainable parameters, the tied
  embedding / LM head as one group, then the root (:func:`shard`), for **both** methods.
  (Finer units than the per-block ones :mod:`benchmarks.fsdp_regime`'s memory model assumes:
  less is gathered at a time.)

Per cell: ``warmup`` steps, then ``repeats`` timed steps (CUDA-synchronised ``perf_counter``);
tokens/s = ``W * T / median step time`` (all ranks); peak memory = the largest
``torch.cuda.max_memory_allocated`` over the ranks during the timed steps (parameters, optimizer
state and everything the step allocates; not measured on CPU). Ratios are to the variant's
non-private step with the same checkpointing. A method that raises (e.g. a configuration the
library refuses today) gets ``failed: <first line>``; every rank raises alike at ``make_private``,
so no rank waits on a collective. Results: ``fsdp_gpu_w{W}.{csv,md}``, and the table printed
on rank 0.

Examples::

    python -m benchmarks.fsdp_gpu --device cuda                      # one GPU
    torchrun --standalone --nproc-per-node 8 -m benchmarks.fsdp_gpu --device cuda
    python -m benchmarks.fsdp_gpu --quick                            # CPU, tiny, seconds
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import common, fsdp_regime
from benchmarks import long_context as lc

NAME = "fsdp_gpu"
COLUMNS = [
    "W",
    "checkpointing",
    "T",
    "method",
    "status",
    "step_median_s",
    "tokens_per_s",
    "tokens_ratio",
    "peak_bytes",
    "memory_ratio",
    "repeats",
    "device",
]


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _max_over_ranks(value: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([float(value)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 with the finest units: ``fully_shard`` on every module that owns trainable
    parameters (``opacus_rc`` also accepts a module left to an enclosing group, since issue 35's
    item 1; these finer units gather less at a time), a tied weight's
    modules (the input embedding and the LM head) in **one** group (``fully_shard`` refuses a
    parameter shared by two groups; Opacus' ``FSDP2Wrapper`` shards them separately), then the
    root. Non-private is sharded the same way, so both methods gather and reduce-scatter alike.
    """
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    owners: dict[int, list[torch.nn.Module]] = {}
    order: list[int] = []
    for module in model.modules():
        if module is model:
            continue
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        key = id(own[0])
        if key not in owners:
            owners[key] = []
            order.append(key)
        owners[key].append(module)
    for key in order:
        group = owners[key]
        fully_shard(group if len(group) > 1 else group[0])
    return fully_shard(model)


#: ``name -> (method of LMMethod, tied, norms trainable, baseline)``. The ``*_today`` variants
#: are what ``opacus_rc``'s FSDP2 path accepted before issue 35's item 1: untied embedding and
#: LM head, frozen RMSNorms (tied weights and RMSNorm were refused under FSDP2 then).
VARIANTS = {
    "non_private": ("non_private", True, True, "non_private"),
    "rc_bookkeeping": ("rc_bookkeeping", True, True, "non_private"),
    "non_private_today": ("non_private", False, False, "non_private_today"),
    "rc_bookkeeping_today": ("rc_bookkeeping", False, False, "non_private_today"),
}


def run_cell(
    cfg: dict[str, Any], checkpointing: str, T: int, method: str, device: torch.device
) -> dict[str, Any]:
    """Time one method on this rank (and the others, under torchrun); see the module docstring.

    Raises:
        Any error of building or stepping the method (the caller records it).
    """
    rank, world = _world()
    if method not in VARIANTS:
        raise ValueError(f"unknown method {method!r}; use one of {sorted(VARIANTS)}")
    name, tied, norms, _ = VARIANTS[method]
    attn = "sdpa" if device.type == "cuda" else None
    model = fsdp_regime.build_model(
        cfg["model"],
        T=T,
        device=device,
        tied=tied,
        seed=cfg["seed"],
        layers=cfg.get("layers"),
        attn=attn,
    )
    if not tied:  # build_model freezes the untied input embedding (a meta limit): train it
        model.model.embed_tokens.weight.requires_grad_(True)
    if not norms:
        for module in model.modules():
            if "RMSNorm" in type(module).__name__:
                module.requires_grad_(False)
    vocab = model.config.vocab_size
    if world > 1:
        shard(model)
    gen = torch.Generator(device="cpu").manual_seed(cfg["seed"] + rank)
    ids = torch.randint(1, vocab, (1, T), generator=gen).to(device)
    step = lc.LMMethod(
        name, model, ids, {"k": cfg["k"], "seed": cfg["seed"]}, checkpointing, optimizer="adamw"
    )
    for _ in range(int(cfg["warmup"])):
        step.step()
    common.synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(int(cfg["repeats"])):
        common.synchronize(device)
        start = time.perf_counter()
        step.step()
        common.synchronize(device)
        times.append(time.perf_counter() - start)
    median = _max_over_ranks(common.median(times), device)
    peak = (
        _max_over_ranks(torch.cuda.max_memory_allocated(device), device)
        if device.type == "cuda"
        else None
    )
    return {
        "step_median_s": median,
        "tokens_per_s": world * T / median,
        "peak_bytes": int(peak) if peak is not None else None,
        "repeats": len(times),
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``tokens_ratio`` and ``memory_ratio`` to the method's non-private baseline
    (:data:`VARIANTS`) at the same (W, checkpointing, T)."""
    index = {(r["W"], r["checkpointing"], r["T"], r["method"]): r for r in rows}
    for r in rows:
        baseline = VARIANTS.get(r["method"], (None, None, None, "non_private"))[3]
        base = index.get((r["W"], r["checkpointing"], r["T"], baseline), {})
        if r.get("tokens_per_s") and base.get("tokens_per_s"):
            r["tokens_ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
        if r.get("peak_bytes") and base.get("peak_bytes"):
            r["memory_ratio"] = r["peak_bytes"] / base["peak_bytes"]


def table(rows: list[dict[str, Any]]) -> str:
    """The printed / Markdown table."""
    lines = []
    for r in rows:
        lines.append(
            {
                "W": r["W"],
                "checkpointing": r["checkpointing"],
                "T": r["T"],
                "method": r["method"],
                "tokens/s": f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "",
                "/ non-private": f"{r['tokens_ratio']:.3f}x" if r.get("tokens_ratio") else "",
                "peak memory / rank": common.fmt_bytes(r["peak_bytes"])
                if r.get("peak_bytes")
                else "n/a",
                "/ non-private ": f"{r['memory_ratio']:.3f}x" if r.get("memory_ratio") else "",
                "status": r["status"][:120],
            }
        )
    return common.markdown_table(lines, list(lines[0]) if lines else [])


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    args = parser.parse_args(argv)
    if args.profile is None and not args.quick:
        args.profile = "gpu"
    cfg, out, device = common.resolve(args, "fsdp_regime")
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = _world()
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    common.quiet_warnings()
    rows: list[dict[str, Any]] = []
    for ckpt in cfg["checkpointing"]:
        for T in cfg["T"]:
            for method in cfg.get("gpu_methods", cfg["methods"]):
                row: dict[str, Any] = {
                    "W": world,
                    "checkpointing": ckpt,
                    "T": T,
                    "method": method,
                    "device": torch.cuda.get_device_name(device)
                    if device.type == "cuda"
                    else "cpu",
                }
                try:
                    row.update(run_cell(cfg, ckpt, T, method, device), status="ok")
                except Exception as err:  # noqa: BLE001 - reported in the results
                    row["status"] = lc.first_line(err)
                    if rank == 0:
                        traceback.print_exc(limit=-3)
                rows.append(row)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if rank == 0:
                    print(f"[W={world} {ckpt} T={T} {method}] {row['status']}", flush=True)
    add_ratios(rows)
    if rank == 0:
        info = common.machine_info(device)
        text = table(rows)
        common.write_csv(out / f"{NAME}_w{world}.csv", rows, COLUMNS)
        common.write_text(
            out / f"{NAME}_w{world}.md",
            "\n".join(
                [
                    f"# The paper's regime on {world} device(s) (issue 35, item 3)",
                    "",
                    f"Model `{cfg['model']}` ({cfg.get('layers') or 'all'} blocks), tied, every "
                    "weight trainable, B = 1 sequence per rank, AdamW, float32 (TF32 on CUDA); "
                    "FSDP2 (`fully_shard` per module with trainable parameters, the tied pair "
                    "as one group, then the root) when W > 1. "
                    "`benchmarks/fsdp_gpu.py`.",
                    "",
                    common.machine_markdown(info),
                    "",
                    text,
                    "",
                ]
            ),
        )
        print(text)
        print(f"wrote {out / NAME}_w{world}.csv, .md")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
