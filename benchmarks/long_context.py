"""Issue 13, item 6: whole-model DP full fine-tuning of the SmolLM2 architecture on long sequences.

The model is ``LlamaForCausalLM`` with SmolLM2-135M's shapes (30 blocks, hidden 576, 9 heads, 3
KV heads, MLP 1536, vocabulary 49,152, tied input embedding and LM head), randomly initialised
from the config. Every block and the final norm train; the tied embedding / LM head is frozen so
that every method trains the same parameters (Opacus' ghost clipping refuses tied parameters;
randomized clipping supports them, :mod:`opacus_rc.grad_sample.tied`). The loss is
next-token cross-entropy over the full ``B x T x V`` logits, one privacy unit per sequence.
Methods (SGD, ``noise_multiplier = 1``, ``max_grad_norm = 1``):

* ``non_private``: forward, ``loss.backward()``, ``optimizer.step()``;
* ``opacus_hooks``: Opacus per-sample gradients (``grad_sample_mode="hooks"``);
* ``opacus_ghost``: Opacus ghost clipping (two backward passes);
* ``mixed_ghost``: the per-layer rule of fastDP / private-transformers, ghost norm for an
  ``nn.Linear`` where ``2 T^2 <= p d``, its per-sample gradient elsewhere, inside Opacus' ghost
  machinery (:class:`MixedGhostClippingModule`; two backward passes, fastDP's ``MixGhostClip``;
  fastDP itself is not on PyPI, and its default ``MixOpt`` is the same rule with one backward);
* ``rc_two_pass`` / ``rc_bookkeeping``: ``opacus_rc.PrivacyEngine(clipping="randomized")``,
  Hutchinson ``k``, ``bookkeeping=False`` / ``True`` (under checkpointing, ``True`` keeps one
  backward pass and each layer stashes the smaller of its per-sample gradients and its input
  and output gradient, :mod:`opacus_rc.grad_sample.norms`).

Each runs with activation checkpointing ``off``, ``non-reentrant`` (HF
``gradient_checkpointing_enable()``'s default) and ``reentrant`` (``use_reentrant=True``).

Measurements, per (checkpointing, T, B, method):

* **FLOPs and peak memory on the meta device** (shapes only, so T = 65536 and B = 8 are
  measured): ``FlopCounterMode`` and the live-tensor-bytes tracker of :mod:`benchmarks.common`,
  in two separate steps of the same method (memory first): ``FlopCounterMode``'s
  ``ModuleTracker`` registers a multi-grad hook on the inputs and outputs of every module
  forward it sees and keeps the handles, hence the autograd graphs, until it exits; under
  activation checkpointing that includes the forwards recomputed inside the backward, so a
  memory peak measured under it counts recomputed activations that training frees (at T = 8192,
  30 blocks, B = 1, non-reentrant, the step's extra bytes: 5.07 GiB for both non-private and
  randomized book-keeping measured alone, 5.76 and 9.88 GiB measured under ``FlopCounterMode``).
  Attention uses the CPU flash kernel on CPU and on meta (:func:`register_flash_attention`; on
  meta, ``scaled_dot_product_attention`` would fall back to the ``T x T`` math path). The few
  data-dependent scalar reads of a step (HF's packed-sequence check; the libraries' overflow and
  finiteness checks) are answered by :class:`BenignScalarReads` with the branch every healthy
  step takes; a read it cannot answer fails the cell, with its call site. On meta the sketch
  probes come from a CPU generator (``torch.Generator`` has no meta device); their bytes are
  counted twice (CPU and meta copy), ``B p k`` floats per layer.
* **Wall time on CPU** for the cells listed in ``time_cells`` (small T): every method of one
  (checkpointing, T, B) in one process, median of ``repeats`` steps after ``warmup``, the load
  average (``uptime``) recorded next to them.

A method that raises gets status ``failed: <first line of the error>``; nothing is dropped, and
re-running the script after a library fix fills the cell. Results: ``long_context.{csv,md,png}``.

Examples::

    python -m benchmarks.long_context --quick      # tiny Llama, seconds
    python -m benchmarks.long_context              # the full grid (meta) + CPU wall times
    python -m benchmarks.long_context --no-time    # meta only
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.weak import WeakIdKeyDictionary

from benchmarks import common, models

NAME = "long_context"
METHODS = (
    "non_private",
    "opacus_hooks",
    "opacus_ghost",
    "mixed_ghost",
    "rc_two_pass",
    "rc_bookkeeping",
)
BASELINE = "non_private"
CHECKPOINTING = ("off", "non-reentrant", "reentrant")
COLUMNS = [
    "checkpointing",
    "T",
    "B",
    "method",
    "status",
    "step_flops",
    "flops_ratio",
    "peak_bytes",
    "step_extra_bytes",
    "persistent_bytes",
    "memory_ratio",
    "logits_bytes",
    "ghost_layers",
    "scalar_reads",
    "time_median_s",
    "time_ratio",
    "repeats",
    "load_average",
    "time_status",
    "trainable_params",
    "k",
]
aten = torch.ops.aten
ATTENTION = "cpu_kernel_attention"


# ----------------------------------------------------------------------------------------------
# Attention that runs the same kernel on CPU and on meta
# ----------------------------------------------------------------------------------------------


def _flash_cpu_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention with ``aten._scaled_dot_product_flash_attention_for_cpu`` (native GQA).

    The kernel HF's ``sdpa`` runs on CPU for float32 inputs without a mask; it has a meta
    kernel, so meta runs count its ``O(T)`` memory instead of the math path's ``T x T`` scores.

    Args:
        query: ``(B, H, T, D)``; key and value: ``(B, H_kv, T, D)``.

    Returns:
        ``((B, T, H, D), None)`` as HF attention functions return.

    Raises:
        ValueError: If a padding mask is passed (this benchmark uses full, unpadded sequences).
    """
    if attention_mask is not None:
        raise ValueError("cpu_kernel_attention takes no attention mask (use unpadded sequences)")
    out = aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout, is_causal=True, scale=scaling
    )[0]
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*_: Any, attention_mask: torch.Tensor | None = None, **__: Any) -> None:
    """The mask function of :func:`_flash_cpu_attention`: none (the kernel is causal).

    Raises:
        ValueError: If the model was given a padding mask.
    """
    if attention_mask is not None:
        raise ValueError("cpu_kernel_attention takes no attention mask (use unpadded sequences)")
    return None


def register_flash_attention() -> str:
    """Register :func:`_flash_cpu_attention` with transformers (idempotent); return its name.

    Called when a benchmark model is built, not at import.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _flash_cpu_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)
    return ATTENTION


@contextlib.contextmanager
def meta_autocast() -> Iterator[None]:
    """While active, ``torch.autocast(device_type="meta", ...)`` is a no-op context.

    ``opacus_rc``'s sketch samplers disable autocast around their products with
    ``torch.autocast(device_type=G.device.type, enabled=False)``, and torch has no autocast
    for the meta device (``torch.get_autocast_dtype("meta")`` raises "unsupported
    scalarType"). Meta tensors never autocast, so the no-op is what that line means there.
    Only the meta measurement enters this (``torch.autocast`` is restored on exit); other
    device types get torch's own class. It becomes unnecessary once the library skips
    autocast where ``torch.amp.is_autocast_available(device_type)`` is false.
    """
    original = torch.autocast

    def autocast(device_type: str, *args: Any, **kwargs: Any) -> Any:
        if device_type == "meta":
            return contextlib.nullcontext()
        return original(device_type, *args, **kwargs)

    torch.autocast = autocast  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.autocast = original  # type: ignore[misc]


# ----------------------------------------------------------------------------------------------
# Data-dependent scalar reads on meta tensors
# ----------------------------------------------------------------------------------------------


class MetaScalarReadError(RuntimeError):
    """A step read a scalar from a meta tensor whose value :class:`BenignScalarReads` can't
    infer."""


class BenignScalarReads(TorchDispatchMode):
    """Answers ``.item()`` / ``bool()`` on meta tensors with the branch a healthy step takes.

    Boolean meta tensors get an assumed value where the op determines it: ``isfinite`` is true,
    ``isnan`` / ``isinf`` false, ``any(x)`` is ``x``'s value if known else false (nothing is
    flagged), ``all(x)`` is ``x``'s value if known else true (every element passes); ``not``,
    ``and`` and ``or`` propagate known values. So ``bool(isfinite(t).all())`` is true and
    ``bool((fro > c).any())`` false: no overflow, no non-finite value, nothing unclipped. Any other
    scalar read of a meta tensor raises :class:`MetaScalarReadError` with its call site. Real
    tensors pass through unchanged. Enter it innermost (last), inside the measuring modes.

    Small integer tensors are known exactly: a meta tensor copied from a real one (e.g. the
    ``units=`` tensor of unit-level clipping, moved to the losses' device) keeps a CPU
    *shadow*, and every op whose meta inputs all have shadows and whose meta outputs are
    integer or boolean with at most :attr:`SHADOW_MAX_NUMEL` elements is run on the shadows
    too (integer factories such as ``arange(device="meta")`` on the CPU); reads, ``equal`` and
    copies back to the CPU of a shadowed tensor return the shadow's values. A mutating op that
    cannot be shadowed drops the shadows of its meta arguments. Float tensors are never
    shadowed (no real arithmetic on activations).

    Attributes:
        answered: Count of answered reads per call site.
    """

    SHADOW_MAX_NUMEL = 1 << 20

    _ASSUMED = {aten.isfinite: True, aten.isnan: False, aten.isinf: False}
    _NOT = (aten.logical_not, aten.bitwise_not)
    _AND = (aten.logical_and, aten.bitwise_and, aten.__and__)
    _OR = (aten.logical_or, aten.bitwise_or, aten.__or__)
    _VIEWS = (aten.view, aten.select, aten.slice, aten.squeeze, aten.unsqueeze, aten.expand)

    def __init__(self) -> None:
        super().__init__()
        self._value: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._shadow: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.answered: Counter[str] = Counter()

    def _shadow_of(self, x: Any) -> torch.Tensor | None:
        if isinstance(x, torch.Tensor) and x.device.type == "meta":
            return self._shadow.get(x)
        return None

    def _swap(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device.type == "meta":
            return self._shadow[x]
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    def _from_shadows(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any] | None:
        """``(out,)`` computed on the shadows, for a non-mutating op whose meta inputs all have
        shadows (or an integer factory on meta), so that ops without a meta kernel
        (``bincount``) and data-dependent shapes work; None where that does not apply."""
        if func._schema.is_mutable:
            return None
        leaves = tree_leaves((args, kwargs))
        metas = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_meta]
        factory = not metas and any(
            isinstance(x, torch.device) and x.type == "meta" for x in leaves
        )
        if not (factory or (metas and all(self._shadow_of(t) is not None for t in metas))):
            return None
        if any(t.dtype.is_floating_point or t.dtype.is_complex for t in metas):
            return None
        try:
            s_args, s_kwargs = tree_map(self._swap, (args, kwargs))
            s_out = func(*s_args, **s_kwargs)
        except Exception:  # noqa: BLE001 - fall back to the meta kernel
            return None
        s_leaves = [t for t in tree_leaves(s_out) if isinstance(t, torch.Tensor)]
        if not s_leaves or any(
            t.dtype.is_floating_point or t.dtype.is_complex or t.numel() > self.SHADOW_MAX_NUMEL
            for t in s_leaves
        ):
            return None
        out = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, s_out)
        for o, so in zip(tree_leaves(out), tree_leaves(s_out)):
            if isinstance(o, torch.Tensor):
                self._shadow[o] = so
        return (out,)

    def _shadow_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Run ``func`` on the shadows of its meta inputs and record those of its outputs."""
        metas = [
            t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_meta
        ]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_meta]
        shadowable = (
            outs
            and all(self._shadow_of(t) is not None for t in metas)
            and not any(
                t.dtype.is_floating_point or t.dtype.is_complex or t.numel() > self.SHADOW_MAX_NUMEL
                for t in outs + metas
            )
        )
        if shadowable:
            try:
                s_args, s_kwargs = tree_map(self._swap, (args, kwargs))
                s_out = func(*s_args, **s_kwargs)
            except Exception:  # noqa: BLE001 - no shadow: the value stays unknown
                shadowable = False
        if not shadowable:
            if func._schema.is_mutable:
                for t in metas:
                    self._shadow.pop(t, None)
            return
        for o, so in zip(tree_leaves(out), tree_leaves(s_out)):
            if isinstance(o, torch.Tensor) and o.is_meta and isinstance(so, torch.Tensor):
                self._shadow[o] = so

    def _known(self, x: Any) -> bool | None:
        return self._value.get(x) if isinstance(x, torch.Tensor) else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        packet = func.overloadpacket
        shadows = [self._shadow_of(a) for a in args[:2]]
        if packet is aten._local_scalar_dense and shadows[0] is not None:
            self.answered[common.call_site()] += 1
            return shadows[0].item()
        if packet is aten.equal and len(shadows) == 2 and None not in shadows:
            self.answered[common.call_site()] += 1
            return torch.equal(*shadows)
        if (
            packet is aten._to_copy
            and shadows[0] is not None
            and torch.device(kwargs.get("device") or "meta").type != "meta"
        ):
            return func(shadows[0], **kwargs)
        if packet in (aten._local_scalar_dense, aten.equal) and any(
            isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args
        ):
            value = self._known(args[0]) if packet is aten._local_scalar_dense else None
            if value is None:
                raise MetaScalarReadError(
                    f"{packet.__name__} of a meta tensor whose value cannot be inferred, at "
                    f"{common.call_site()}"
                )
            self.answered[common.call_site()] += 1
            return value
        early = self._from_shadows(func, args, kwargs)
        if early is not None:
            return early[0]
        out = func(*args, **kwargs)
        self._shadow_op(func, args, kwargs, out)
        if not (
            isinstance(out, torch.Tensor) and out.device.type == "meta" and out.dtype == torch.bool
        ):
            return out
        first = args[0] if args else None
        value: bool | None = None
        if packet in self._ASSUMED:
            value = self._ASSUMED[packet]
        elif packet is aten.any:
            known = self._known(first)
            value = False if known is None else known
        elif packet is aten.all:
            known = self._known(first)
            value = True if known is None else known
        elif packet in self._NOT and self._known(first) is not None:
            value = not self._known(first)
        elif packet in self._AND + self._OR and len(args) >= 2:
            a, b = self._known(args[0]), self._known(args[1])
            if a is not None and b is not None:
                value = (a and b) if packet in self._AND else (a or b)
        elif packet in self._VIEWS:
            value = self._known(first)
        if value is not None:
            self._value[out] = value
        return out


# ----------------------------------------------------------------------------------------------
# The per-layer mixed rule of fastDP / private-transformers in Opacus' ghost machinery
# ----------------------------------------------------------------------------------------------


def mixed_rule_uses_ghost(T: int, p: int, d: int) -> bool:
    """fastDP's ``use_gc = 2 * T**2 <= p * d`` (``supported_layers_grad_samplers.py``,
    ``mixed_ghost_norm``): the ghost norm's ``T x T`` Grams are cheaper than ``B p d``."""
    return p * d >= 2 * T * T


class MixedGhostClippingModule(GradSampleModuleFastGradientClipping):
    """Opacus' ghost-clipping module with fastDP's per-layer choice for ``nn.Linear``.

    A Linear layer whose input has ``T`` positions gets Opacus' ghost norm if
    :func:`mixed_rule_uses_ghost` holds, else its per-sample gradient (Opacus' grad sampler)
    and that gradient's norm, as Opacus' fast gradient clipping does for every layer without a
    norm sampler. Other layers are unchanged.

    Attributes:
        ghost_layers: ``{"ghost": n, "per_sample": m}`` counts of the last backward's choices.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ghost_layers: Counter[str] = Counter()

    def capture_backprops_hook(
        self, module, _forward_input, forward_output, loss_reduction, batch_first
    ):  # noqa: ANN001, D102, E501
        use_ghost = self.use_ghost_clipping
        acts = getattr(module, "activations", None)
        if isinstance(module, nn.Linear) and self.hooks_enabled and acts:
            A = acts[-1][0]
            T = A.shape[1] if A.dim() >= 3 else 1
            use_ghost = mixed_rule_uses_ghost(T, module.out_features, module.in_features)
            self.ghost_layers["ghost" if use_ghost else "per_sample"] += 1
        previous = self.use_ghost_clipping
        self.use_ghost_clipping = use_ghost
        try:
            super().capture_backprops_hook(
                module, _forward_input, forward_output, loss_reduction, batch_first
            )
        finally:
            self.use_ghost_clipping = previous


# ----------------------------------------------------------------------------------------------
# One training-step variant
# ----------------------------------------------------------------------------------------------


def _noop(_phase: str) -> None:
    pass


class LMMethod:
    """One method's private (or not) causal-LM training step on its own copy of the model.

    Args:
        name: One of :data:`METHODS`.
        model: A fresh model, used (and wrapped) as it is.
        input_ids: ``(B, T)`` token ids; the labels are the ids shifted by one (last position
            ignored).
        cfg: Settings (``k``, ``seed``).
        checkpointing: One of :data:`CHECKPOINTING`.
        units: Optional ``(B,)`` integer tensor mapping each sequence to its privacy unit
            ``0..U-1``, passed to the private criterion as ``units=`` (unit-level DP-SGD,
            ``benchmarks/unit_cost.py``); ``None``: one unit per sequence.
        optimizer: ``"sgd"`` (no state; the default) or ``"adamw"`` (two state tensors per
            parameter, ``benchmarks/fsdp_regime.py``).

    Raises:
        ValueError: Unknown method or checkpointing mode; errors of the libraries' wrapping.
    """

    def __init__(
        self,
        name: str,
        model: nn.Module,
        input_ids: torch.Tensor,
        cfg: dict[str, Any],
        checkpointing: str = "off",
        *,
        units: torch.Tensor | None = None,
        optimizer: str = "sgd",
    ) -> None:
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; allowed: {', '.join(METHODS)}")
        if checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
        self.name = name
        self.units = units
        B, T = input_ids.shape
        device = input_ids.device
        self.input_ids = input_ids
        self.position_ids = torch.arange(T, device=device).expand(B, T)  # one row per sample
        labels = torch.full((B, T), -100, dtype=torch.long, device=device)
        if device.type != "meta":
            labels[:, :-1] = input_ids[:, 1:]
        self.labels = labels.view(B * T)
        self.shape = (B, T)
        if checkpointing != "off":
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
            )
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        if optimizer not in ("sgd", "adamw"):
            raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {optimizer!r}")
        optimizer = (torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW)(
            self.trainable, lr=1e-5
        )
        criterion = nn.CrossEntropyLoss(ignore_index=-100)
        loader = DataLoader(TensorDataset(torch.zeros(B, 1)), batch_size=B)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # Several ranks (benchmarks/fsdp_gpu.py): B records per rank, sharded.
            from torch.utils.data.distributed import DistributedSampler

            data = TensorDataset(torch.zeros(B * torch.distributed.get_world_size(), 1))
            loader = DataLoader(data, batch_size=B, sampler=DistributedSampler(data))
        dp = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "poisson_sampling": False}
        self.dp_loss = True
        self.mixed: MixedGhostClippingModule | None = None
        if name == BASELINE:
            self.model, self.optimizer, self.criterion = model, optimizer, criterion
            self.dp_loss = False
        elif name == "opacus_hooks":
            import opacus

            engine = opacus.PrivacyEngine(accountant="prv")
            self.model, self.optimizer, _ = engine.make_private(
                module=model, optimizer=optimizer, data_loader=loader, **dp
            )
            self.criterion, self.dp_loss = criterion, False
        elif name == "opacus_ghost":
            import opacus

            engine = opacus.PrivacyEngine(accountant="prv")
            self.model, self.optimizer, self.criterion, _ = engine.make_private(
                module=model,
                optimizer=optimizer,
                data_loader=loader,
                criterion=criterion,
                grad_sample_mode="ghost",
                **dp,
            )
        elif name == "mixed_ghost":
            self.mixed = MixedGhostClippingModule(model, max_grad_norm=1.0, loss_reduction="mean")
            self.model = self.mixed
            self.optimizer = DPOptimizerFastGradientClipping(
                optimizer, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=B
            )
            self.criterion = DPLossFastGradientClipping(self.mixed, self.optimizer, criterion)
        else:
            from opacus_rc import PrivacyEngine

            # torch.Generator has no meta device: on meta the probes are drawn on the CPU.
            gen = torch.Generator().manual_seed(cfg["seed"]) if device.type == "meta" else None
            engine = PrivacyEngine()
            self.model, self.optimizer, self.criterion, _ = engine.make_private(
                module=model,
                optimizer=optimizer,
                data_loader=loader,
                criterion=criterion,
                clipping="randomized",
                sketch="hutchinson",
                sketch_dim=int(cfg["k"]),
                sketch_generator=gen,
                bookkeeping=name == "rc_bookkeeping",
                # The batch-independence check runs once per run, before the first step, and
                # not on meta (no values): off, so that the CPU and meta steps measure the same.
                check_batch_independence=False,
                **dp,
            )
            if units is not None:
                # A cost measurement on fixed batches, not a unit loader: the module's record
                # is told the batch's units as a UnitDataLoader would tell it (units= with a
                # per-sequence loader is refused otherwise; opacus_rc/units/record.py).
                from opacus_rc.units.record import UnitBatchRecord

                record = UnitBatchRecord(per_unit=True)
                record.record(units)
                self.model.unit_batch_record = record

    def step(self, phase: Callable[[str], None] = _noop) -> None:
        """One training step; ``phase(name)`` is called as each of forward (with the loss),
        backward (clip factors and clipped sum included), step and zero_grad begins.

        Raises:
            RuntimeError: If a trainable parameter got no gradient in the backward.
        """
        phase("forward")
        logits = self.model(input_ids=self.input_ids, position_ids=self.position_ids).logits
        flat = logits.view(-1, logits.shape[-1])
        if self.dp_loss and self.units is not None:
            loss = self.criterion(flat, self.labels, shape=self.shape, units=self.units)
        elif self.dp_loss:
            loss = self.criterion(flat, self.labels, shape=self.shape)
        else:
            loss = self.criterion(flat, self.labels)
        del logits, flat
        phase("backward")
        loss.backward()
        missing = sum(1 for p in self.trainable if p.grad is None)
        if missing:
            raise RuntimeError(
                f"{missing} of {len(self.trainable)} trainable tensors got no gradient"
            )
        phase("step")
        self.optimizer.step()
        phase("zero_grad")
        self.optimizer.zero_grad(set_to_none=True)
        phase("done")

    def persistent_bytes(self) -> int:
        """Parameters and buffers of this copy (SGD without momentum keeps no state)."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)


def build_base(
    cfg: dict[str, Any], T: int, B: int, device: torch.device
) -> tuple[nn.Module, torch.Tensor]:  # noqa: E501
    """The randomly initialised causal LM of ``cfg`` and ``(B, T)`` token ids on ``device``."""
    config = models.causal_lm_config(
        cfg["model"], num_hidden_layers=cfg["layers"], max_position_embeddings=max(T, 8192)
    )
    model = models.build_causal_lm(
        config, device=device, seed=cfg["seed"], attn=register_flash_attention()
    )
    ids = models.random_tokens(
        batch_size=B, seq_len=T, vocab_size=config.vocab_size, seed=cfg["seed"], device=device
    )
    return model, ids


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"failed: {type(err).__name__}: {text[0] if text else ''}"[:240]


# ----------------------------------------------------------------------------------------------
# Measurement: meta (FLOPs, memory) and CPU (time)
# ----------------------------------------------------------------------------------------------


def measure_step(
    method: LMMethod, device: torch.device, *, between: Callable[[], None] | None = None
) -> dict[str, Any]:
    """FLOPs and peak memory of one training step of ``method`` (on meta by default).

    Memory and FLOPs come from two separate steps: ``FlopCounterMode``'s module tracker keeps
    an autograd hook, and with it the graph, of every module forward it sees until it exits,
    including the forwards that activation checkpointing recomputes inside the backward, so
    memory measured under it would count recomputed activations that real training frees
    (module docstring). ``between()`` runs after the memory step.

    Returns:
        ``status="ok"``, ``step_flops``, ``step_extra_bytes`` (bytes), ``persistent_bytes``
        (parameters and buffers), ``peak_bytes`` (their sum) and ``scalar_reads`` (reads the
        oracle answered; ``None`` off meta).

    Raises:
        MetaScalarReadError: If the step reads a meta scalar the oracle cannot infer; any
            error of the step itself.
    """
    oracle = BenignScalarReads()

    def step() -> None:
        with meta_autocast(), oracle:
            method.step()

    extra, _ = common.peak_extra_bytes(step, device)
    reads = sum(oracle.answered.values()) if device.type == "meta" else None
    if between is not None:
        between()
    _, flops = common.count_flops(step)
    persistent = method.persistent_bytes()
    return {
        "status": "ok",
        "step_flops": flops,
        "step_extra_bytes": extra,
        "persistent_bytes": persistent,
        "peak_bytes": extra + persistent,
        "scalar_reads": reads,
    }


def measure_meta(
    cfg: dict[str, Any],
    checkpointing: str,
    T: int,
    B: int,
    log: Any = print,
    device: str = "meta",
) -> list[dict[str, Any]]:
    """FLOPs and peak memory of one step of every method, on the meta device by default
    (``device="cpu"`` measures real tensors the same way: the tests compare the two)."""
    common.quiet_warnings()
    meta = torch.device(device)
    probe, _ = build_base(cfg, T, B, meta)
    vocab = probe.config.vocab_size
    trainable = sum(p.numel() for p in probe.parameters() if p.requires_grad)
    del probe
    rows = []
    for name in cfg["methods"]:
        row: dict[str, Any] = {
            "checkpointing": checkpointing,
            "T": T,
            "B": B,
            "method": name,
            "logits_bytes": 4 * B * T * vocab,
            "trainable_params": trainable,
            "k": cfg["k"] if name.startswith("rc_") else None,
        }
        rows.append(row)
        method = None
        try:
            model, ids = build_base(cfg, T, B, meta)
            method = LMMethod(name, model, ids, cfg, checkpointing)
            seen: list[Counter[str]] = []

            def between(method: LMMethod = method, seen: list = seen) -> None:
                if method.mixed is not None:
                    seen.append(Counter(method.mixed.ghost_layers))

            row.update(measure_step(method, meta, between=between))
            layers = seen[0] if seen else None
            if layers is not None:  # of the first step (the counts add up over steps)
                row["ghost_layers"] = "{ghost}/{total}".format(
                    ghost=layers["ghost"], total=sum(layers.values())
                )
        except Exception as err:  # noqa: BLE001 - reported in the results
            row["status"] = first_line(err)
            log(f"[{checkpointing} T={T} B={B} {name}] {row['status']}")
            log("".join(traceback.format_exception_only(err)).strip()[:400])
        method = model = None
        gc.collect()
    return rows


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages, as ``uptime`` prints them."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - non-POSIX
        return ""


def time_cell(
    cfg: dict[str, Any], checkpointing: str, T: int, B: int, log: Any = print
) -> list[dict[str, Any]]:
    """CPU wall time of every method at one (checkpointing, T, B), in this process.

    Methods run one after the other, each on a fresh copy (one copy alive at a time):
    ``warmup`` untimed steps, then the median of ``repeats``.
    """
    common.quiet_warnings()
    device = torch.device("cpu")
    rows = []
    for name in cfg["methods"]:
        row: dict[str, Any] = {"checkpointing": checkpointing, "T": T, "B": B, "method": name}
        rows.append(row)
        load = [load_average()]
        method = None
        try:
            model, ids = build_base(cfg, T, B, device)  # same seed: the same weights and tokens
            method = LMMethod(name, model, ids, cfg, checkpointing)
            times = common.time_calls(
                method.step, repeats=cfg["repeats"], warmup=cfg["warmup"], device=device
            )
            row.update(time_status="ok", time_median_s=common.median(times), repeats=len(times))
        except Exception as err:  # noqa: BLE001 - reported in the results
            row["time_status"] = first_line(err)
        method = model = None
        gc.collect()
        load.append(load_average())
        row["load_average"] = " -> ".join(load)
        log(
            f"[time {checkpointing} T={T} B={B} {name}] {row.get('time_median_s')} "
            f"{row['time_status']}"
        )
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``flops_ratio``, ``memory_ratio`` and ``time_ratio`` to non-private at the same
    (checkpointing, T, B)."""
    index = {(r["checkpointing"], r["T"], r["B"], r["method"]): r for r in rows}
    for r in rows:
        base = index.get((r["checkpointing"], r["T"], r["B"], BASELINE))
        if base is None:
            continue
        for col, ratio in (
            ("step_flops", "flops_ratio"),
            ("peak_bytes", "memory_ratio"),
            ("time_median_s", "time_ratio"),
        ):
            if r.get(col) and base.get(col):
                r[ratio] = r[col] / base[col]


def floors(rows: list[dict[str, Any]], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's floors: at the floor cell (checkpointing on), each randomized method's peak
    memory and FLOPs against the checkpointed non-private step's. A failed cell fails."""
    out = []
    where = cfg["floor"]
    for ckpt in where["checkpointing"]:
        for method in ("rc_bookkeeping", "rc_two_pass"):
            r = next(
                (
                    x
                    for x in rows
                    if (x["checkpointing"], x["T"], x["B"], x["method"])
                    == (ckpt, where["T"], where["B"], method)
                ),
                None,
            )
            for col, bound in (("memory_ratio", where["memory"]), ("flops_ratio", where["flops"])):
                value = r.get(col) if r else None
                out.append(
                    {
                        "requirement": f"{method} {col} vs non_private, checkpointing {ckpt}, "
                        f"T={where['T']}, B={where['B']}",
                        "value": value,
                        "bound": f"<= {bound}",
                        "passed": value is not None and value <= bound,
                        "status": (r or {}).get("status", "not measured"),
                    }
                )
    return out


# ----------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------


def _failure_codes(rows: list[dict]) -> dict[str, int]:
    """A footnote number for each distinct failure status (meta or timing), in row order."""
    codes: dict[str, int] = {}
    for r in rows:
        for col in ("status", "time_status"):
            status = str(r.get(col) or "")
            if status.startswith("failed") and status not in codes:
                codes[status] = len(codes) + 1
    return codes


def _cell(
    rows: list[dict], key: tuple, col: str, fmt: Callable[[Any], str], codes: dict[str, int]
) -> str:
    r = next((x for x in rows if (x["checkpointing"], x["T"], x["B"], x["method"]) == key), None)
    if r is None:
        return ""
    if r.get(col) is None:
        status = str(r.get("time_status" if col.startswith("time") else "status") or "")
        return f"FAILED [{codes[status]}]" if status in codes else ""
    return fmt(r[col])


def summary_markdown(rows: list[dict], cfg: dict, info: dict, crit: list[dict]) -> str:
    ratio = lambda v: f"{float(v):.3f}x"  # noqa: E731
    codes = _failure_codes(rows)
    arch = (
        "the SmolLM2-135M architecture"
        if cfg["model"] == "smollm2"
        else f"the `{cfg['model']}` architecture (quick profile)"
    )
    parts = [
        "# Long-context whole-model DP fine-tuning (issue 13, item 6)",
        "",
        f"`LlamaForCausalLM` with {arch} ({cfg['layers']} blocks), random init; **all blocks "
        "and the final norm trainable; the "
        "tied input embedding / LM head frozen**, so that every method trains the same "
        "parameters (Opacus' ghost clipping refuses tied parameters; randomized clipping "
        "supports them, `opacus_rc/grad_sample/tied.py`). Next-token loss over the full B x T x V "
        f"logits, one privacy unit per sequence. SGD, sigma = 1, C = 1; Hutchinson k = "
        f"{cfg['k']}. `mixed_ghost`: fastDP's per-layer rule (ghost norm where 2T^2 <= p d, "
        "per-sample gradient elsewhere) in Opacus' two-pass ghost machinery (fastDP's "
        "MixGhostClip; fastDP is not on PyPI; its default MixOpt applies the same rule with one "
        "backward pass). `rc_two_pass` is `bookkeeping=False`; `rc_bookkeeping` is the default "
        "`bookkeeping=True`: one backward pass, and under checkpointing each layer keeps the "
        "smaller of its per-sample gradients (the same sketch from them) and its input and output "
        "gradient for the clipped sum. Checkpointing: HF `gradient_checkpointing_enable()` "
        "(`non-reentrant` is its default; `reentrant` is `use_reentrant=True`).",
        "",
        "FLOPs (`FlopCounterMode`, matrix products) and peak memory (parameters + peak bytes of "
        "live tensors created during the step) are measured on the **meta device** for every "
        "cell, in two separate steps (`FlopCounterMode` keeps the graphs of the forwards that "
        "checkpointing recomputes, which would inflate the memory; `benchmarks/long_context.py` "
        "docstring: attention runs the CPU flash kernel on "
        "meta too; data-dependent scalar reads are answered with the healthy branch; "
        "`torch.autocast` is a no-op for meta during the measurement). Wall time: CPU, "
        f"{cfg.get('threads') or 'default'} thread(s), the cells in `time_cells`, every method "
        "in one "
        "process; load average next to it. A cell whose method raises shows the error's first "
        "line: those are today's failures, not omissions; re-running the script after a fix "
        "fills them. `ok` means the step ran and every trainable tensor got a gradient; whether "
        "the per-sample norms are right under checkpointing is not checked here (issue 13's "
        "tests do that).",
        "",
        info["machine_line"] if "machine_line" in info else common.machine_markdown(info),
        "",
    ]
    if crit:
        parts += ["## Floors (issue 13)", "", "| requirement | value | bound | result | status |"]
        parts.append("|---|---|---|---|---|")
        for c in crit:
            value = "" if c["value"] is None else f"{c['value']:.3f}"
            status = f"FAILED [{codes[c['status']]}]" if c["status"] in codes else c["status"]
            parts.append(
                f"| {c['requirement']} | {value} | {c['bound']} | "
                f"{'PASS' if c['passed'] else 'FAIL'} | {status} |"
            )
        parts.append("")
    methods = cfg["methods"]
    where = cfg["floor"]
    parts += [
        f"## At T = {where['T']}, B = {where['B']}: every method and checkpointing mode",
        "",
        "Ratios to the non-private step **without** checkpointing (the floors above use the "
        "non-private step with the same checkpointing).",
        "",
    ]
    table = []
    for ckpt in cfg["checkpointing"]:
        plain = next(
            (
                x
                for x in rows
                if (x["checkpointing"], x["T"], x["B"], x["method"])
                == ("off", where["T"], where["B"], BASELINE)
            ),
            {},
        )
        for m in methods:
            r = next(
                (
                    x
                    for x in rows
                    if (x["checkpointing"], x["T"], x["B"], x["method"])
                    == (ckpt, where["T"], where["B"], m)
                ),
                None,
            )
            if r is None:
                continue
            line = {"checkpointing": ckpt, "method": m}
            if r.get("peak_bytes"):
                line["peak"] = common.fmt_bytes(r["peak_bytes"])
                line["flops"] = common.fmt_flops(r["step_flops"])
                if plain.get("peak_bytes"):
                    line["mem_off"] = ratio(r["peak_bytes"] / plain["peak_bytes"])
                    line["flops_off"] = ratio(r["step_flops"] / plain["step_flops"])
            else:
                line["peak"] = f"FAILED [{codes[r['status']]}]" if r.get("status") in codes else ""
            table.append(line)
    parts += [
        common.markdown_table(
            table,
            ["checkpointing", "method", "peak", "mem_off", "flops", "flops_off"],
            [
                "checkpointing",
                "method",
                "peak memory",
                "/ non-private (off)",
                "FLOPs",
                "/ non-private (off)",
            ],
        ),
        "",
    ]
    for title, col, fmt in (
        ("FLOPs per step / non-private (same checkpointing)", "flops_ratio", ratio),
        ("Peak memory", "peak_bytes", common.fmt_bytes),
        ("Peak memory / non-private (same checkpointing)", "memory_ratio", ratio),
        ("FLOPs per step", "step_flops", common.fmt_flops),
    ):
        parts += [f"## {title}", ""]
        table = []
        for ckpt in cfg["checkpointing"]:
            for B in cfg["B"]:
                for T in cfg["T"]:
                    line = {"checkpointing": ckpt, "B": B, "T": T}
                    for m in methods:
                        line[m] = _cell(rows, (ckpt, T, B, m), col, fmt, codes)
                    table.append(line)
        parts += [common.markdown_table(table, ["checkpointing", "B", "T", *methods]), ""]
    timed = [r for r in rows if r.get("time_status")]
    if timed:
        parts += ["## CPU wall time per step (median) and ratio to non-private", ""]
        table = []
        for ckpt, T, B in cfg["time_cells"]:
            line = {"checkpointing": ckpt, "B": B, "T": T}
            for m in methods:
                t = _cell(rows, (ckpt, T, B, m), "time_median_s", common.fmt_seconds, codes)
                q = _cell(rows, (ckpt, T, B, m), "time_ratio", ratio, codes)
                line[m] = f"{t} ({q})" if q and not t.startswith("FAILED") else t
            r = next((x for x in timed if (x["checkpointing"], x["T"], x["B"]) == (ckpt, T, B)), {})
            line["load"] = r.get("load_average", "")
            table.append(line)
        parts += [
            common.markdown_table(table, ["checkpointing", "B", "T", *methods, "load"]),
            "",
        ]
    if cfg.get("grid_note"):
        parts += ["## Grid", "", cfg["grid_note"], ""]
    if codes:
        parts += ["## Failures (first line of each distinct error, and where it happens)", ""]
        for status, n in codes.items():
            where = sorted(
                {
                    f"{r['method']} ({r['checkpointing']})"
                    for r in rows
                    if status in (r.get("status"), r.get("time_status"))
                }
            )
            parts.append(f"{n}. {status.removeprefix('failed: ')} -- {', '.join(where)}")
        parts.append("")
    return "\n".join(parts)


def plot(rows: list[dict], cfg: dict, path: Path) -> None:
    plt = common.pyplot()
    ckpts = cfg["checkpointing"]
    fig, axes = plt.subplots(2, len(ckpts), figsize=(5 * len(ckpts), 8), squeeze=False)
    B = cfg["B"][0]
    for j, ckpt in enumerate(ckpts):
        for i, (col, label) in enumerate(
            (("flops_ratio", "FLOPs / non-private"), ("memory_ratio", "peak memory / non-private"))
        ):
            ax = axes[i][j]
            for k, m in enumerate(cfg["methods"]):
                pts = [
                    (r["T"], r[col])
                    for r in rows
                    if (r["checkpointing"], r["B"], r["method"]) == (ckpt, B, m) and r.get(col)
                ]
                if pts:  # one colour per method in every panel, whichever methods failed
                    ax.plot(*zip(*sorted(pts)), marker="o", label=m, color=f"C{k}")
            ax.axhline(1, color="k", lw=0.5)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("T")
            ax.set_ylabel(label)
            ax.set_title(f"checkpointing {ckpt}, B={B}", fontsize=9)
            ax.grid(True, alpha=0.3)
            failed = sorted(
                {
                    r["method"]
                    for r in rows
                    if (r["checkpointing"], r["B"]) == (ckpt, B)
                    and str(r.get("status", "")).startswith("failed")
                }
            )
            if failed:
                ax.text(
                    0.02,
                    0.98,
                    "failed: " + ", ".join(failed),
                    transform=ax.transAxes,
                    va="top",
                    fontsize=7,
                    color="crimson",
                    wrap=True,
                )
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="center right")
    fig.suptitle(
        f"{cfg['model']} architecture, all {cfg['layers']} blocks trainable, B={B}; FLOPs and "
        "memory on meta, ratios to the non-private step with the same checkpointing",
        fontsize=10,
    )
    fig.tight_layout()
    common.save_figure(fig, path)


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def _merge(rows: list[dict], new: list[dict]) -> None:
    index = {(r["checkpointing"], r["T"], r["B"], r["method"]): r for r in rows}
    for r in new:
        key = (r["checkpointing"], r["T"], r["B"], r["method"])
        if key in index:
            index[key].update({k: v for k, v in r.items() if v is not None})
        else:
            rows.append(r)
            index[key] = r


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a results CSV with numbers as numbers and empty cells left out."""
    ints = {"T", "B", "step_flops", "peak_bytes", "step_extra_bytes", "persistent_bytes"}
    ints |= {"logits_bytes", "scalar_reads", "repeats", "trainable_params", "k"}
    rows = []
    for raw in common.read_csv(path):
        row: dict[str, Any] = {}
        for key, value in raw.items():
            if value == "":
                continue
            if key in ints:
                row[key] = int(float(value))
            elif key.endswith(("_ratio", "_s")):
                row[key] = float(value)
            else:
                row[key] = value
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--no-time", action="store_true", help="meta measurements only")
    parser.add_argument("--T", type=int, nargs="*", default=None, help="override the T list")
    parser.add_argument("--B", type=int, nargs="*", default=None, help="override the B list")
    parser.add_argument(
        "--from-csv",
        type=Path,
        default=None,
        help="measure nothing: rewrite the Markdown and plot from this CSV (with the profile's "
        "settings)",
    )
    args = parser.parse_args(argv)
    cfg, out, device = common.resolve(args, NAME)
    if device.type != "cpu":
        raise SystemExit("long_context measures on meta and times on CPU; use --device cpu")
    for key in ("T", "B"):
        if getattr(args, key):
            cfg[key] = getattr(args, key)
    if args.no_time:
        cfg["time_cells"] = []
    cfg["time_cells"] = [tuple(c) for c in cfg["time_cells"]]
    info = common.machine_info(device)
    info["uptime_load_average"] = load_average()
    started = time.perf_counter()
    stem = common.result_stem(NAME, cfg, device)
    rows: list[dict] = []
    if args.from_csv:
        rows = read_rows(args.from_csv)
        # The machine line of the run that measured the CSV, if its report is beside it.
        old_md = args.from_csv.with_suffix(".md")
        lines = old_md.read_text().splitlines() if old_md.exists() else []
        line = next((x for x in lines if x.startswith("Machine: ")), None)
        info = {"machine_line": line or f"Machine: not recorded (rendered from {args.from_csv})"}

    def write() -> list[dict]:
        if not args.from_csv:
            info["run_minutes"] = round((time.perf_counter() - started) / 60, 1)
        add_ratios(rows)
        crit = floors(rows, cfg)
        common.write_csv(out / f"{stem}.csv", rows, COLUMNS)
        common.write_text(out / f"{stem}.md", summary_markdown(rows, cfg, info, crit))
        return crit

    for ckpt in cfg["checkpointing"] if not args.from_csv else ():
        for B in cfg["B"]:
            for T in cfg["T"]:
                _merge(rows, measure_meta(cfg, ckpt, T, B))
                print(
                    f"meta {ckpt} B={B} T={T}: "
                    + ", ".join(
                        f"{r['method']}={'ok' if r['status'] == 'ok' else 'failed'}"
                        for r in rows
                        if (r["checkpointing"], r["T"], r["B"]) == (ckpt, T, B)
                    ),
                    flush=True,
                )
                write()  # after every cell: an interrupted run keeps what it measured
    for ckpt, T, B in cfg["time_cells"] if not args.from_csv else ():
        _merge(rows, time_cell(cfg, ckpt, T, B))
        write()
    crit = write()
    plot(rows, cfg, out / f"{stem}.png")
    for c in crit:
        value = "n/a" if c["value"] is None else f"{c['value']:.3f}"
        print(f"{'PASS' if c['passed'] else 'FAIL'} {c['requirement']}: {value} ({c['status']})")
    print(f"wrote {out / stem}.csv, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
