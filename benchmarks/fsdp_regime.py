"""Issue 35, item 3: the paper's regime per rank, at full size, on the meta device.

Full fine-tuning of Llama 3.2 1B's shapes (``LlamaConfig``: hidden 2048, 16 blocks, 32 heads,
8 KV heads, MLP 8192, vocabulary 128,256, ``tie_word_embeddings=True``; randomly initialised on
the ``meta`` device, **every weight trainable**: the tied embedding / LM head, every block and
every RMSNorm), one sequence of ``T`` tokens per rank (``B = 1``, as in the paper), AdamW,
float32, on ``W`` FSDP2 ranks. Methods:

* ``non_private``: forward, ``loss.backward()``, ``optimizer.step()``;
* ``rc_bookkeeping``: ``opacus_rc.PrivacyEngine(clipping="randomized")``, Hutchinson with the
  project's default ``k`` (:data:`opacus_rc.config.DEFAULT_SKETCH_DIM`), book-keeping (one
  backward pass; the tied embedding / LM head gets the joint sketch, the RMSNorms their exact
  per-sample norms);
* ``opacus_ghost``: Opacus' ghost clipping (``grad_sample_mode="ghost"``, the computation of
  its FSDP2 ``"ghost_fsdp"`` mode on one rank; two backward passes). Opacus refuses a tied
  parameter (``opacus/grad_sample/grad_sample_module_fast_gradient_clipping.py``,
  ``capture_activations_hook``: "Parameter tying is not supported with Ghost Clipping"), so it
  runs on the **untied** model (``tie_word_embeddings=False``: 1.50 B parameters), and its
  input embedding is frozen, because Opacus' embedding norm sampler calls ``aten::unique_dim``,
  which has no meta kernel (that norm needs no matrix product; its memory, ``T x d`` floats at
  most, is not counted). Its ratios are to ``non_private_untied``, the non-private step of the
  same untied model with the same trainable set. Under activation checkpointing Opacus sees
  the recomputed forward as a second use of each module and refuses it as parameter tying:
  those cells are reported as refused.

**Why one device measures one rank.** FSDP2 (``fully_shard``) shards parameters, gradients and
optimizer state; every rank runs the whole model on its own samples, all-gathering each
block's parameters for its forward and backward. A rank's matrix products are therefore those
of the unsharded model on ``B = 1``: **per-rank FLOPs** are counted on one device with
``FlopCounterMode`` (forward + backward + optimizer step).

**Per-rank peak memory** is part measured, part analytic (bytes, float32):

* measured on meta, one step after a warm-up step (so that AdamW's state exists before it),
  with :class:`ShardableBytes`: the peak, over the forward and backward, of the bytes of live
  tensors created during the step, **less the gradients FSDP2 has already reduce-scattered**:
  a block's parameter gradients count until another block's gradients appear (FSDP2
  reduce-scatters a block's gradients when its backward ends), the root's (the tied
  embedding / LM head, the final norm) until the end of the backward (``local_peak_bytes``:
  activations, logits, unsharded gradients, the methods' per-sample buffers -- the
  book-keeping stash, the unsharded clipped sums book-keeping forms at the end of the
  backward, Opacus' Gram matrices); and the peak of all live bytes created during the
  optimizer step and ``zero_grad`` (``step_phase_bytes``: the gradients, the noise, AdamW's
  temporaries), which FSDP2 holds sharded, so divided by ``W``;
* analytic per ``W``: the sharded state ``(4 P + 4 P_t + 8 P_t) / W`` (parameters, gradients,
  AdamW's two moments; ``P`` parameters, ``P_t`` trainable) and the unsharded parameters FSDP2
  gathers during the backward (``gathered_bytes``): the root unit (FSDP2 keeps the root
  unsharded from its forward to the end of the backward) plus two blocks (the current one and
  the prefetched next one), the same for every method of a model.

``peak_bytes_per_rank = max(sharded state + gathered + local_peak, (4 P + 8 P_t) / W +
step_phase_bytes / W)``. A diagnostic beside it: ``after_loss_bytes_per_rank`` is the same
backward sum with the local peak taken only from the moment the loss's gradient reaches the
logits (a hook on the LM head's output): with a vocabulary of 128,256 the float32 logits and
the cross-entropy's ``T x V`` tensors set the peak of every method, and this column shows what
the rest of the backward (activations, unsharded gradients, the book-keeping stash) needs,
i.e. the peak a step with a chunked or fused loss would approach. FSDP2's communication
buffers and the allocator's fragmentation are not counted (the same for every method).
Book-keeping writes no gradient during the backward
(its clipped sums replace autograd's weight gradients), so its unsharded sums are all in the
measured part at the end of the backward, as ``opacus_rc/grad_sample/fsdp.py`` forms them (every
parameter's sum in its global shape, then one reduce-scatter per parameter).

**Closed form** (a check, not a substitute: every cell here is measured): with checkpointing
off, randomized clipping's matrix products exceed non-private's by ``sum 2 B T k (p + d)`` over
the ``nn.Linear`` layers (the sketch ``U = G Omega``, ``V^T = U^T A``; the book-keeping clipped
sum ``2 B T p d`` replaces autograd's weight gradient) plus ``2 B T k d`` for the input
embedding's share of the tied weight's joint sketch (``Omega`` rows gathered at the token ids,
then ``G_e^T Omega[ids]``; the embedding's lookup has no matrix product). Checkpointed cells
have no closed form here: at ``B = 1`` book-keeping stashes per-sample gradients where they are
smaller (:mod:`opacus_rc.grad_sample.norms`) and takes their exact norms.

Results: ``fsdp_regime.{csv,md}``: one row per (checkpointing, T, W, method), ratios to the
non-private step of the same model, and the issue's floor (rc book-keeping <= 1.05x
non-private in FLOPs and peak memory per rank at T = 4096, every W, checkpointing on and off).

Examples::

    python -m benchmarks.fsdp_regime --quick   # tiny tied Llama, seconds
    python -m benchmarks.fsdp_regime           # Llama 3.2 1B shapes (meta), about 20 minutes
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
from typing import Any

import torch
from torch import nn

from benchmarks import common
from benchmarks import long_context as lc

NAME = "fsdp_regime"
METHODS = ("non_private", "rc_bookkeeping", "non_private_untied", "opacus_ghost")
#: Each method's model variant and baseline.
VARIANT = {
    "non_private": ("tied", "non_private"),
    "rc_bookkeeping": ("tied", "non_private"),
    "non_private_untied": ("untied", "non_private_untied"),
    "opacus_ghost": ("untied", "non_private_untied"),
}
#: The method each name runs in :class:`benchmarks.long_context.LMMethod`.
LM_METHOD = {"non_private_untied": "non_private"}

ARCHITECTURES = {
    "llama-3.2-1b": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
    },
    "tiny-llama": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}
COLUMNS = [
    "checkpointing",
    "T",
    "W",
    "method",
    "model",
    "baseline",
    "status",
    "source",
    "step_flops",
    "flops_closed_form",
    "flops_ratio",
    "local_peak_bytes",
    "after_loss_peak_bytes",
    "step_phase_bytes",
    "sharded_state_bytes",
    "gathered_bytes",
    "peak_bytes_per_rank",
    "memory_ratio",
    "after_loss_bytes_per_rank",
    "after_loss_ratio",
    "params",
    "trainable_params",
    "k",
]


def llama_config(arch: str, *, tied: bool, T: int, layers: int | None = None) -> Any:
    """The ``LlamaConfig`` of ``arch`` (:data:`ARCHITECTURES`), tied or untied, for ``T``
    (``layers``: another number of blocks).

    Raises:
        ValueError: Unknown architecture.
    """
    from transformers import LlamaConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; use one of {sorted(ARCHITECTURES)}")
    kwargs = dict(ARCHITECTURES[arch])
    if layers:
        kwargs["num_hidden_layers"] = int(layers)
    return LlamaConfig(
        **kwargs,
        tie_word_embeddings=tied,
        max_position_embeddings=max(T, 8192),
        use_cache=False,
    )


def build_model(
    arch: str,
    *,
    T: int,
    device: torch.device | str,
    tied: bool = True,
    seed: int = 0,
    layers: int | None = None,
    attn: str | None = None,
) -> nn.Module:
    """``LlamaForCausalLM`` of ``arch``, random init on ``device``, train mode, float32, every
    weight trainable; the untied variant's input embedding frozen (see the module docstring).
    Attention: ``attn``, by default :func:`benchmarks.long_context.register_flash_attention`'s
    CPU kernel (the one with a meta kernel); ``layers`` overrides the number of blocks."""
    from transformers import LlamaForCausalLM

    config = llama_config(arch, tied=tied, T=T, layers=layers)
    config._attn_implementation = attn or lc.register_flash_attention()
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    if not tied:
        model.model.embed_tokens.weight.requires_grad_(False)
    return model


def unit_sizes(model: nn.Module) -> dict[str, int]:
    """Parameter counts FSDP2 works with: ``params``, ``trainable``, the root unit's
    (``root``, ``root_trainable``: everything outside the decoder blocks) and the largest
    block's (``block``, ``block_trainable``). A tied weight is counted once."""
    blocks = list(model.model.layers)
    in_block = {id(p) for b in blocks for p in b.parameters()}
    params = list(model.parameters())  # unique

    def count(ps: Any, trainable: bool = False) -> int:
        return sum(p.numel() for p in ps if p.requires_grad or not trainable)

    root = [p for p in params if id(p) not in in_block]
    return {
        "params": count(params),
        "trainable": count(params, True),
        "root": count(root),
        "root_trainable": count(root, True),
        "block": max(count(b.parameters()) for b in blocks),
        "block_trainable": max(count(b.parameters(), True) for b in blocks),
    }


class ShardableBytes(common.LiveTensorBytes):
    """:class:`benchmarks.common.LiveTensorBytes` split into what FSDP2 keeps per rank.

    Besides ``live`` and ``peak``, it tracks per phase of :meth:`LMMethod.step`:

    * :attr:`local_peak`: the peak over ``forward`` and ``backward`` of the live bytes minus the
      gradients (``p.grad``, ``p.summed_grad``) of the blocks' parameters that FSDP2 would have
      reduce-scattered already: those of every block but the one whose gradients appeared
      last (FSDP2 reduce-scatters a block's gradients when its backward ends, as the next
      block's begins). Gradients of the root's parameters (``root``) stay counted: FSDP2
      reduce-scatters them at the end of the backward;
    * :attr:`after_loss_peak`: the same as :attr:`local_peak`, from :meth:`mark_loss_done` on
      (the loss's gradient has reached the logits: the cross-entropy's ``T x V`` tensors are
      freed or about to be);
    * :attr:`step_peak`: the peak of all live bytes during ``step`` and ``zero_grad``.

    Args:
        blocks: The trainable parameters of each block, in any order.
    """

    GRAD_ATTRS = ("grad", "summed_grad")

    def __init__(self, blocks: list[list[nn.Parameter]]) -> None:
        super().__init__()
        self.params = [(p, i) for i, block in enumerate(blocks) for p in block]
        self._last: dict[int, int] = {}  # id(param) -> id of its last gradient storage
        self.current_block: int | None = None
        self.phase = "forward"
        self.local_peak = 0
        self.after_loss_peak = 0
        self.loss_done = False
        self.step_peak = 0

    def set_phase(self, name: str) -> None:
        """The phase callback of :meth:`benchmarks.long_context.LMMethod.step`."""
        self.phase = name
        self._update()

    def mark_loss_done(self) -> None:
        """Called when the loss's gradient reaches the logits (a hook on the LM head's output)."""
        self.loss_done = True

    def _sharded_gradients(self) -> int:
        """Bytes of the gradients created in the step that FSDP2 holds sharded by now."""
        held: list[tuple[int, torch.UntypedStorage]] = []
        for p, block in self.params:
            for attr in self.GRAD_ATTRS:
                g = getattr(p, attr, None)
                if not isinstance(g, torch.Tensor):
                    continue
                st = g.untyped_storage()
                if not self._seen.get(st, 0):
                    continue  # not created in the step
                if attr == "grad" and self._last.get(id(p)) != id(st):
                    self._last[id(p)] = id(st)
                    self.current_block = block
                held.append((block, st))
        seen: set[int] = set()
        total = 0
        for block, st in held:
            if block != self.current_block and id(st) not in seen:
                seen.add(id(st))
                total += st.nbytes()
        return total

    def _update(self) -> None:
        if self.phase in ("forward", "backward"):
            local = self.live - self._sharded_gradients()
            self.local_peak = max(self.local_peak, local)
            if self.loss_done:
                self.after_loss_peak = max(self.after_loss_peak, local)
        elif self.phase in ("step", "zero_grad"):
            self.step_peak = max(self.step_peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._update()
        return out


def measure_cell(
    cfg: dict[str, Any], checkpointing: str, T: int, method: str, device: str = "meta"
) -> dict[str, Any]:
    """One rank's step of ``method`` at ``T`` (``B = 1``): FLOPs and the measured memory parts.

    Three steps on one model: a warm-up (AdamW's state), one under :class:`ShardableBytes`, one
    under ``FlopCounterMode`` (separate: see :func:`benchmarks.long_context.measure_step`).

    Returns:
        ``step_flops``, ``local_peak_bytes``, ``after_loss_peak_bytes``, ``step_phase_bytes``
        and the unit sizes of :func:`unit_sizes`.

    Raises:
        Any error of the step (the caller records it).
    """
    tied = VARIANT[method][0] == "tied"
    dev = torch.device(device)
    model = build_model(cfg["model"], T=T, device=dev, tied=tied, seed=cfg["seed"])
    sizes = unit_sizes(model)
    ids = torch.empty(1, T, dtype=torch.long, device=dev)
    if dev.type != "meta":
        ids = torch.randint(1, model.config.vocab_size, (1, T), device=dev)
    step = lc.LMMethod(
        LM_METHOD.get(method, method),
        model,
        ids,
        {"k": cfg["k"], "seed": cfg["seed"]},
        checkpointing,
        optimizer="adamw",
    )
    oracle = lc.BenignScalarReads()

    def run(phase: Any = lc._noop) -> None:
        with lc.meta_autocast(), oracle:
            step.step(phase)

    run()  # warm-up: AdamW's moments exist before the measured step
    tracker = ShardableBytes(
        [[p for p in block.parameters() if p.requires_grad] for block in model.model.layers]
    )

    def on_logits(_module: nn.Module, _inputs: Any, logits: torch.Tensor) -> None:
        if logits.requires_grad:
            logits.register_hook(lambda _grad: tracker.mark_loss_done())

    handle = model.lm_head.register_forward_hook(on_logits)
    try:
        with tracker:
            run(tracker.set_phase)
    finally:
        handle.remove()
    _, flops = common.count_flops(run)
    return {
        "step_flops": flops,
        "local_peak_bytes": tracker.local_peak,
        "after_loss_peak_bytes": tracker.after_loss_peak,
        "step_phase_bytes": tracker.step_peak,
        **sizes,
    }


def linear_shapes(arch: str, *, tied: bool) -> list[tuple[int, int]]:
    """``(d, p)`` (in, out features) of every ``nn.Linear`` of ``arch``, the LM head included."""
    a = ARCHITECTURES[arch]
    h, m, v = a["hidden_size"], a["intermediate_size"], a["vocab_size"]
    kv = h // a["num_attention_heads"] * a["num_key_value_heads"]
    block = [(h, h), (h, kv), (h, kv), (h, h), (h, m), (h, m), (m, h)]
    return block * a["num_hidden_layers"] + [(h, v)]


def closed_form_extra_flops(arch: str, *, T: int, k: int, B: int = 1) -> int:
    """Randomized clipping's matrix-product FLOPs over non-private's, checkpointing off
    (module docstring). Each block ``nn.Linear`` (``d -> p``, no bias) keeps the smaller
    book-keeping stash (``opacus_rc/grad_sample/norms.py``): its per-sample gradients where
    ``p d <= T (p + d)``, sketched from them (``2Bpdk``; for ``B > 1`` the clipped sum contracts
    the ``(B,)`` clip factors with them, ``2Bpd``; their computation replaces autograd's weight
    gradient), else its input and output gradient, sketched from them (``2BTk(p + d)``). The tied
    LM head's norm is the joint sketch from its factors, ``2BTk(V + d)`` + ``2BTkd`` (tied
    embedding), plus ``2BVd`` for ``B > 1`` where it keeps its per-sample gradients; ``2Bd`` per
    RMSNorm for ``B > 1`` (``2L + 1`` of them: the clipped sum of its closed form contracts the
    clip factors with the ``(B, d)`` per-sample gradients it stashed; for ``B = 1`` it scales the
    one row in place, no product)."""
    d = ARCHITECTURES[arch]["hidden_size"]
    norms = 2 * ARCHITECTURES[arch]["num_hidden_layers"] + 1
    *blocks, (_, v) = linear_shapes(arch, tied=True)
    contraction = 2 * B if B > 1 else 0
    linears = 0
    for din, p in blocks:
        if p * din <= T * (p + din):
            linears += 2 * B * p * din * k + contraction * p * din
        else:
            linears += 2 * B * T * k * (p + din)
    head = 2 * B * T * k * (v + d) + (contraction * v * d if v * d <= T * (v + d) else 0)
    return linears + head + 2 * B * T * k * d + norms * contraction * d


def per_rank(measured: dict[str, Any], W: int) -> dict[str, int]:
    """The analytic FSDP2 parts for ``W`` ranks and the per-rank peak (module docstring)."""
    P, Pt = measured["params"], measured["trainable"]
    sharded = (4 * P + 4 * Pt + 8 * Pt) // W
    gathered = 4 * (measured["root"] + 2 * measured["block"])
    backward = sharded + gathered + measured["local_peak_bytes"]
    step = (4 * P + 8 * Pt) // W + measured["step_phase_bytes"] // W
    return {
        "sharded_state_bytes": sharded,
        "gathered_bytes": gathered,
        "peak_bytes_per_rank": max(backward, step),
        "after_loss_bytes_per_rank": sharded + gathered + measured["after_loss_peak_bytes"],
    }


def rows_for(cfg: dict[str, Any], checkpointing: str, T: int, log: Any = print) -> list[dict]:
    """Every method at one (checkpointing, T), expanded over ``cfg["W"]``."""
    common.quiet_warnings()
    out = []
    for method in cfg["methods"]:
        base = {
            "checkpointing": checkpointing,
            "T": T,
            "method": method,
            "model": VARIANT[method][0],
            "baseline": VARIANT[method][1],
            "k": cfg["k"] if method.startswith("rc_") else None,
        }
        measured: dict[str, Any] | None = None
        started = time.perf_counter()
        try:
            measured = measure_cell(cfg, checkpointing, T, method)
            status = "ok"
        except Exception as err:  # noqa: BLE001 - reported in the results
            status = lc.first_line(err)
            log("".join(traceback.format_exception_only(err)).strip()[:400])
        log(
            f"[{checkpointing} T={T} {method}] {status} ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        gc.collect()
        for W in cfg["W"]:
            row = dict(base, W=W, status=status, source="measured (meta)")
            if measured is not None:
                row.update(
                    step_flops=measured["step_flops"],
                    local_peak_bytes=measured["local_peak_bytes"],
                    after_loss_peak_bytes=measured["after_loss_peak_bytes"],
                    step_phase_bytes=measured["step_phase_bytes"],
                    params=measured["params"],
                    trainable_params=measured["trainable"],
                    **per_rank(measured, W),
                )
            out.append(row)
    add_closed_forms(out, cfg)
    return out


def add_closed_forms(rows: list[dict[str, Any]], cfg: dict[str, Any]) -> None:
    """``flops_closed_form`` for rc rows without checkpointing: the non-private row's count plus
    :func:`closed_form_extra_flops`."""
    index = {(r["checkpointing"], r["T"], r["W"], r["method"]): r for r in rows}
    for r in rows:
        if r["method"] != "rc_bookkeeping" or r["checkpointing"] != "off":
            continue
        base = index.get((r["checkpointing"], r["T"], r["W"], "non_private"), {})
        if base.get("step_flops"):
            r["flops_closed_form"] = base["step_flops"] + closed_form_extra_flops(
                cfg["model"], T=r["T"], k=cfg["k"]
            )


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``flops_ratio`` and ``memory_ratio`` to each row's baseline at the same cell."""
    index = {(r["checkpointing"], r["T"], r["W"], r["method"]): r for r in rows}
    for r in rows:
        base = index.get((r["checkpointing"], r["T"], r["W"], r["baseline"]), {})
        for col, ratio in (
            ("step_flops", "flops_ratio"),
            ("peak_bytes_per_rank", "memory_ratio"),
            ("after_loss_bytes_per_rank", "after_loss_ratio"),
        ):
            if r.get(col) and base.get(col):
                r[ratio] = r[col] / base[col]


def floors(rows: list[dict[str, Any]], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's floor: ``rc_bookkeeping`` at ``floor.T``, every W and checkpointing mode,
    FLOPs and peak memory per rank <= ``floor.flops`` / ``floor.memory`` x non-private."""
    where = cfg["floor"]
    out = []
    for ckpt in cfg["checkpointing"]:
        for W in cfg["W"]:
            r = next(
                (
                    x
                    for x in rows
                    if (x["checkpointing"], x["T"], x["W"], x["method"])
                    == (ckpt, where["T"], W, "rc_bookkeeping")
                ),
                {},
            )
            for col, bound in (("flops_ratio", where["flops"]), ("memory_ratio", where["memory"])):
                value = r.get(col)
                out.append(
                    {
                        "requirement": f"rc_bookkeeping {col}, checkpointing {ckpt}, "
                        f"T={where['T']}, W={W}",
                        "value": value,
                        "bound": bound,
                        "met": value is not None and value <= bound,
                    }
                )
    return out


def summary_markdown(
    rows: list[dict[str, Any]], cfg: dict[str, Any], info: dict, crit: list[dict]
) -> str:
    ratio = lambda v: "" if v in (None, "") else f"{float(v):.3f}x"  # noqa: E731
    doc = (__doc__ or "").split("Results:")[0].strip()
    parts = [
        "# The paper's regime per rank: Llama 3.2 1B shapes under FSDP2 (issue 35, item 3)",
        "",
        f"Profile: model `{cfg['model']}`, T in {cfg['T']}, W in {cfg['W']}, checkpointing "
        f"{cfg['checkpointing']}, Hutchinson k = {cfg['k']}, B = 1 sequence per rank, AdamW, "
        "float32. Everything below is **measured on the meta device** (FLOPs counted, memory "
        "tracked) plus the analytic sharded state per W; `flops_closed_form` is an independent "
        "check of the rc rows without checkpointing.",
        "",
        common.machine_markdown(info),
        "",
        "## Floor (issue 35): rc book-keeping <= "
        f"{cfg['floor']['flops']}x FLOPs and <= {cfg['floor']['memory']}x peak memory per rank "
        f"at T = {cfg['floor']['T']}",
        "",
        "| requirement | value | bound | result |",
        "|---|---|---|---|",
    ]
    for c in crit:
        value = "n/a" if c["value"] is None else f"{c['value']:.4f}"
        parts.append(
            f"| {c['requirement']} | {value} | <= {c['bound']} | "
            f"{'met' if c['met'] else 'NOT MET'} |"
        )
    parts += ["", "## Per rank, every cell", ""]
    table = []
    for r in rows:
        status = r["status"]
        table.append(
            {
                "checkpointing": r["checkpointing"],
                "T": r["T"],
                "W": r["W"],
                "method": r["method"],
                "model": r["model"],
                "flops": common.fmt_flops(r.get("step_flops")) if r.get("step_flops") else "",
                "flops_ratio": ratio(r.get("flops_ratio")),
                "closed": common.fmt_flops(r["flops_closed_form"])
                if r.get("flops_closed_form")
                else "",
                "local": common.fmt_bytes(r.get("local_peak_bytes"))
                if r.get("local_peak_bytes")
                else "",
                "peak": common.fmt_bytes(r.get("peak_bytes_per_rank"))
                if r.get("peak_bytes_per_rank")
                else "",
                "memory_ratio": ratio(r.get("memory_ratio")),
                "after": common.fmt_bytes(r.get("after_loss_bytes_per_rank"))
                if r.get("after_loss_bytes_per_rank")
                else "",
                "after_ratio": ratio(r.get("after_loss_ratio")),
                "status": "ok" if status == "ok" else status.replace("|", "/")[:160],
            }
        )
    parts += [
        common.markdown_table(
            table,
            [
                "checkpointing",
                "T",
                "W",
                "method",
                "model",
                "flops",
                "flops_ratio",
                "closed",
                "local",
                "peak",
                "memory_ratio",
                "after",
                "after_ratio",
                "status",
            ],
            [
                "checkpointing",
                "T",
                "W",
                "method",
                "model",
                "FLOPs / rank",
                "/ baseline",
                "closed form",
                "unsharded peak (measured)",
                "peak memory / rank",
                "/ baseline",
                "after the loss's backward",
                "/ baseline ",
                "status",
            ],
        ),
        "",
        "## How it is measured",
        "",
        doc,
        "",
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--T", type=int, nargs="*", default=None, help="override the T list")
    args = parser.parse_args(argv)
    cfg, out, device = common.resolve(args, NAME)
    if device.type != "cpu":
        raise SystemExit(
            "fsdp_regime measures on meta; use --device cpu (GPU runs: benchmarks/fsdp_gpu.py)"
        )
    if args.T:
        cfg["T"] = args.T
    info = common.machine_info(device)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []

    def write() -> list[dict[str, Any]]:
        info["run_minutes"] = round((time.perf_counter() - started) / 60, 1)
        add_ratios(rows)
        crit = floors(rows, cfg)
        common.write_csv(out / f"{NAME}.csv", rows, COLUMNS)
        common.write_text(out / f"{NAME}.md", summary_markdown(rows, cfg, info, crit))
        return crit

    for ckpt in cfg["checkpointing"]:
        for T in cfg["T"]:
            rows += rows_for(cfg, ckpt, T)
            write()  # after every cell: an interrupted run keeps what it measured
    crit = write()
    for c in crit:
        value = "n/a" if c["value"] is None else f"{c['value']:.4f}"
        print(f"{'met' if c['met'] else 'NOT MET'} {c['requirement']}: {value} <= {c['bound']}")
    print(f"wrote {out / NAME}.csv, .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
