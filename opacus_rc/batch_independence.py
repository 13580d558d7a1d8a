"""A record's computation must not depend on the other records of its batch.

The privacy analysis bounds each record's influence on a step by its own clipped gradient: the
gradient of a loss that is a function of that record alone. A batch in which one record's loss
also reads its neighbours (left padding with learned positions ``0..T-1``, so a record's
positions depend on the longest record; a batch statistic such as batch normalisation; NEFTune,
whose noise scales with the padded length; in-batch negatives; a collator that mixes rows)
makes the gradient of record ``i`` move with the presence of record ``j``, and removing one
record can then move the release by more than ``C``. Nothing in the clipping sees that.

* :func:`position_ids_from_attention_mask`: each record's positions from its own mask (``0`` at
  its first real token, whatever the padding side), as Hugging Face's generation builds them;
  ``DPTrainer`` passes them, and a hand-written loop can.
* :class:`BatchIndependenceCheck`: the check ``make_private`` attaches by default
  (``check_batch_independence=True``): at the model's first training-mode forward, a few
  records' outputs computed alone (each record's row cut to its real tokens) must equal the
  same records' outputs inside the batch; a mismatch raises :class:`BatchIndependenceError`
  before anything is noised or accounted.

The check's forwards run under ``torch.no_grad()``, with the grad-sample hooks disabled (nothing
is recorded for the step), every dropout's probability set to 0 (train mode kept, so that a
batch statistic still shows), buffers and random-number-generator states restored afterwards
(a batch normalisation's running statistics and the training's random draws are unchanged).

**Tolerance** (:func:`allclose_rounding`). A batched and a single-record computation of the same
function differ by rounding only: the same products summed in another order or blocking, each
sum's error at most ``n u`` relative for ``n`` terms and unit roundoff ``u = eps / 2``
(``eps = 2**-23`` for float32). A record's values inside the batch ``a`` and alone ``b`` are
taken as equal when ``max |a - b| <= sqrt(eps) * max(1, max |b|)``, ``sqrt(eps) = 3.5e-4`` for
float32: about 2,900 units in the last place of the largest value, above the rounding of the
depths and widths met (measured on CPU: ``< 1e-7`` relative for the tiny GPT-2 and Llama of
the tests, left and right padding), and far
below what a dependence on other records moves (positions shifted, a batch mean subtracted:
``O(1)`` of the values' scale). bfloat16 and float16 outputs get their own, larger ``eps``.
The check's float32 matrix products run at full precision (TF32 off for its forwards, restored
afterwards), so that TF32's ``2**-10`` rounding does not enter a float32 comparison, and without
autocast, also where the model's forward enters one itself (accelerate wraps the forward in a
bfloat16 autocast under ``TrainingArguments(bf16=True)``, TRL's default): a float32 model is
checked in float32 against the float32 tolerance, whatever mixed precision trains it.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "BatchIndependenceCheck",
    "BatchIndependenceError",
    "LIKELY_CAUSES",
    "allclose_rounding",
    "batch_independence_error",
    "check_rows",
    "first_tensor",
    "independence_forward",
    "per_record_inputs",
    "position_ids_from_attention_mask",
]

#: The likely causes a mismatch names, and the fix of the first.
LIKELY_CAUSES = (
    "left padding with learned absolute positions (GPT-2, BERT, OPT) and position_ids 0..T-1 "
    "for every row: each record's positions then depend on the longest record of its batch; "
    "pass position_ids=opacus_rc.position_ids_from_attention_mask(attention_mask) (DPTrainer "
    "does), or pad on the right; NEFTune (neftune_noise_alpha: its noise scales with the "
    "padded length); batch normalisation or any other batch statistic in training mode (use "
    "GroupNorm or LayerNorm); in-batch negatives (a contrastive loss that compares a record with "
    "the others of its batch); a data collator that mixes rows (copies, shuffles or merges "
    "records)"
)


class BatchIndependenceError(ValueError):
    """A record's computation depends on the other records of its batch (see the module
    docstring); raised before anything is noised or accounted."""


def position_ids_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each record's position ids from its own attention mask.

    ``(mask.long().cumsum(-1) - 1).clamp(min=0)``: the first real token of a row is at
    position 0 and each further real token one more, whatever the padding side, so a record's
    positions (and so its output and its gradient) do not depend on the lengths of the other
    records of its batch. Padding before the first real token gets 0; padding after the last
    gets the last position (both are masked out of attention and of the loss). This is what
    Hugging Face's generation does for left-padded batches; ``DPTrainer`` passes them for every
    model whose ``forward`` takes ``position_ids``. Use it in a hand-written training loop with
    a left-padded batch and a model with learned absolute positions (GPT-2, OPT, BERT)::

        out = model(input_ids=ids, attention_mask=mask,
                    position_ids=opacus_rc.position_ids_from_attention_mask(mask))

    Args:
        attention_mask: ``(B, T)`` mask, nonzero (or True) at real tokens.

    Returns:
        ``(B, T)`` long tensor of position ids, on the mask's device.

    Raises:
        ValueError: If ``attention_mask`` is not two-dimensional.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = getattr(attention_mask, "shape", None)
        raise ValueError(
            "position_ids_from_attention_mask takes a (B, T) attention mask, got "
            f"{type(attention_mask).__name__} of shape {None if shape is None else tuple(shape)}"
        )
    mask = (attention_mask != 0).long()
    return (mask.cumsum(-1) - 1).clamp(min=0)


def allclose_rounding(batch: torch.Tensor, alone: torch.Tensor) -> tuple[bool, float, float]:
    """Whether ``batch`` and ``alone`` are equal up to rounding (module docstring).

    Args:
        batch: A record's values computed inside its batch.
        alone: The same values computed with the record alone (same shape).

    Returns:
        ``(equal, max |batch - alone|, tolerance)``; integer values must be equal exactly.
    """
    if batch.shape != alone.shape:
        return False, math.inf, 0.0
    if not (batch.is_floating_point() or batch.is_complex()):
        diff = float((batch != alone).sum())
        return diff == 0, diff, 0.0
    dtype = batch.dtype if batch.element_size() <= alone.element_size() else alone.dtype
    eps = torch.finfo(dtype).eps
    a, b = batch.detach().double(), alone.detach().double()
    finite = torch.isfinite(b)
    same_special = (a[~finite] == b[~finite]) | (a[~finite].isnan() & b[~finite].isnan())
    if not bool((torch.isfinite(a) == finite).all()) or not bool(same_special.all()):
        return False, math.inf, 0.0
    diff = float((a - b)[finite].abs().max()) if bool(finite.any()) else 0.0
    scale = float(b[finite].abs().max()) if bool(finite.any()) else 0.0
    tol = math.sqrt(eps) * max(1.0, scale)
    return diff <= tol, diff, tol


# ----------------------------------------------------------------------------------------------
# Running a forward that nothing records and nothing randomises
# ----------------------------------------------------------------------------------------------

#: Float attributes some modules read as a dropout probability in their forward (attention
#: dropout passed to ``scaled_dot_product_attention``, e.g. Llama's ``attention_dropout``).
_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout", "dropout_p", "dropout_prob")


#: torch's dropout modules (each with its probability ``p``).
_DROPOUTS = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)

#: Dropout probabilities a model may read from its (Hugging Face) config in its forward.
_CONFIG_DROPOUTS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


class _AutocastOff(TorchFunctionMode):
    """Every torch function called inside runs with autocast off on ``device_types``.

    An enclosing autocast is switched off by :func:`independence_forward` itself; this mode
    also covers an autocast entered *inside* the model's forward, out of reach from outside:
    accelerate's ``Accelerator.prepare_model`` replaces ``model.forward`` by
    ``convert_outputs_to_fp32(autocast(forward))`` under ``bf16=True`` / ``fp16=True``, so
    every ``Trainer`` (and TRL's ``SFTTrainer``, whose ``bf16`` defaults to True) runs its
    model in a bfloat16 autocast that starts after the check's forward is called. Its
    rounding (``2**-8`` relative) against the float32 tolerance refused correct models at
    their first batch (``max |difference| 0.000977, rounding tolerance 0.000345``).

    Why a function mode, and not forward pre-hooks that switch autocast off in the
    submodules, nor a tolerance from the autocast dtype seen inside: the mode sees every torch
    function call wherever the autocast was entered (the model's own forward before its first
    submodule, a leaf module's forward, a wrapper's forward), changes no module, and leaves
    the autocast's own state (enabled, dtype, nesting) untouched: each call's
    ``torch.autocast(enabled=False)`` restores it on exit, also on an exception. Keeping the
    float32 computation keeps the float32 tolerance, so the check refuses a dependence on
    other records as strictly as without mixed precision (a bfloat16 tolerance,
    ``sqrt(2**-7) = 9%`` of the outputs' scale, would let small dependences through). A
    dependence on other records is a property of the function, which float32 shows as well
    as bfloat16. Not covered: a forward that casts to bfloat16 itself (``x.to(torch.bfloat16)``,
    or after reading ``torch.is_autocast_enabled()``, which still says True inside, as
    transformers' flash-attention path does to pick its dtype); its rounding then enters the
    outputs as before.
    """

    def __init__(self, device_types: Sequence[str]) -> None:
        super().__init__()
        self.device_types = tuple(device_types)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        on = [t for t in self.device_types if torch.is_autocast_enabled(t)]
        if not on:
            return func(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for t in on:
                stack.enter_context(torch.autocast(device_type=t, enabled=False))
            return func(*args, **kwargs)


@contextlib.contextmanager
def independence_forward(model: nn.Module, hooks: Any = None) -> Iterator[None]:
    """The context of the check's forwards (module docstring).

    Inside: ``torch.no_grad()``; ``hooks.disable_hooks()`` if the hooks object is enabled
    (re-enabled on exit); every ``nn.Dropout``-family module's ``p``, every float dropout
    attribute of a module (:data:`_DROPOUT_ATTRIBUTES`) and the attention dropout of a module's
    ``config`` (:data:`_CONFIG_DROPOUTS`) set to 0, modes unchanged; on exit the model's
    buffers, the dropouts and the CPU (and the model's CUDA devices') random states restored,
    and the autocast cache cleared (its casts from here carry no gradient). float32 matrix
    products run at ``"highest"`` precision inside (TF32 off), restored on exit, and autocast
    is off (a bfloat16 autocast's rounding is not what the check is about), also an autocast
    entered inside the model's forward (accelerate's under ``bf16=True``; ``_AutocastOff``).

    Args:
        model: The model whose forwards run inside.
        hooks: The grad-sample module or hooks object (``hooks_enabled``), or None.
    """
    saved_p: list[tuple[Any, str, float]] = []
    for module in model.modules():
        if isinstance(module, _DROPOUTS):
            saved_p.append((module, "p", module.p))
            module.p = 0.0
        for name in _DROPOUT_ATTRIBUTES:
            value = module.__dict__.get(name)
            if isinstance(value, float) and not isinstance(value, bool):
                saved_p.append((module, name, value))
                setattr(module, name, 0.0)
    configs = {id(c): c for m in model.modules() if (c := m.__dict__.get("config")) is not None}
    for config in configs.values():  # attention dropout a model reads from its config
        for name in _CONFIG_DROPOUTS:
            value = getattr(config, name, None)
            if isinstance(value, float) and value > 0:
                saved_p.append((config, name, value))
                setattr(config, name, 0.0)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    disabled = hooks is not None and bool(getattr(hooks, "hooks_enabled", False))
    # float32 products at full precision (no TF32): the tolerance is float32's rounding.
    precision = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    # Autocast off on the model's devices: the check is about structure (which tokens a
    # record's outputs depend on), and a bfloat16 autocast's rounding against the float32
    # tolerance would refuse a correct model (TRL's default bf16=True).
    device_types = tuple(
        t
        for t in sorted({p.device.type for p in model.parameters()} | {"cpu"})
        if torch.amp.is_autocast_available(t)
    )
    autocast_off = [
        torch.autocast(device_type=t, enabled=False)
        for t in device_types
        if torch.is_autocast_enabled(t)
    ]
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), contextlib.ExitStack() as st:
            for context in autocast_off:
                st.enter_context(context)
            # ... and also under an autocast the model's forward enters itself (accelerate's).
            st.enter_context(_AutocastOff(device_types))
            if disabled:
                hooks.disable_hooks()
            yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
        # Under torch.autocast the casts of the weights made here (without gradient) would be
        # reused by the training forward of the same autocast region, cut from the weights.
        torch.clear_autocast_cache()
        if disabled:
            hooks.enable_hooks()
        for module, name, value in saved_p:
            setattr(module, name, value)
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)


@contextlib.contextmanager
def per_record_inputs(model: nn.Module) -> Iterator[None]:
    """Refuse a trainable module whose input has no per-record axis, in a forward of one record.

    Inside, a forward of a *single* record must give every module with trainable parameters
    of its own a first tensor input with an axis of size 1 (the record's: the batch axis in the
    model's layout, another axis in a module that works in ``(T, B, ...)``). A module whose
    input has none is shared by the batch (Opacus #841: T5's ``relative_attention_bias`` takes
    ``(T, T)`` bucket ids) and has no per-sample gradient; when its leading size happens to
    equal the batch (``T = B``) its rows would pass for records and be clipped as such.

    Args:
        model: The model whose one-record forwards run inside.

    Raises:
        BatchIndependenceError: On exit, naming the first module whose input has no axis of
            size 1 (with the input's shape and the module's type).
    """
    found: list[str] = []

    def hook(name: str, module: nn.Module) -> Any:
        def pre(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            first = next(
                (v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None
            )
            # No axis of size 1 at all: no axis can be the record's. (An input laid out
            # (T, B, ...) inside a batch-first model, as attention internals are, has B = 1
            # on another axis and is not refused.)
            if first is not None and first.dim() > 0 and 1 not in tuple(first.shape):
                found.append(f"{name} ({type(module).__name__}, input {tuple(first.shape)})")

        return pre

    handles = [
        m.register_forward_pre_hook(hook(name, m), with_kwargs=True)
        for name, m in model.named_modules()
        if any(p.requires_grad for p in m.parameters(recurse=False))
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    if found:
        raise batch_independence_error(
            f"the trainable module {found[0]} received, for a single record, an input with no "
            f"batch axis of size 1: its input is shared by the batch (a bias over positions, "
            "position ids broadcast as [1, T]; Opacus #841), so it has no per-record gradient "
            "to clip. Freeze it (requires_grad=False), or give it a per-record input "
            "(e.g. position_ids.expand(B, -1))"
        )


# ----------------------------------------------------------------------------------------------
# The engine's check: at the model's first training-mode forward
# ----------------------------------------------------------------------------------------------


def check_rows(batch_size: int, mask: torch.Tensor | None, *, limit: int = 3) -> list[int]:
    """The rows the check computes alone: the shortest (most padded) record, the first and the
    last, at most ``limit`` of them.

    Args:
        batch_size: ``B``.
        mask: ``(B, T)`` attention mask, or None.
        limit: The most rows.

    Returns:
        Distinct row indices in ``[0, B)``.
    """
    rows: list[int] = []
    if mask is not None and batch_size > 0:
        rows.append(int((mask != 0).sum(-1).argmin()))
    for i in (0, batch_size - 1, batch_size // 2):
        if 0 <= i < batch_size and i not in rows:
            rows.append(i)
    return rows[:limit]


def first_tensor(
    outputs: Any, *, batch_size: int | None = None, batch_dim: int = 0
) -> torch.Tensor | None:
    """The output the checks compare: a tensor, a mapping's ``logits`` (else its first tensor),
    or a sequence's first tensor; with ``batch_size``, the first of them with that size along
    ``batch_dim`` (a scalar loss beside the logits is passed over)."""

    def fits(t: torch.Tensor) -> bool:
        return batch_size is None or (t.dim() > batch_dim and t.shape[batch_dim] == batch_size)

    if isinstance(outputs, torch.Tensor):
        return outputs if fits(outputs) else None
    if isinstance(outputs, Mapping):
        logits = outputs.get("logits")
        if isinstance(logits, torch.Tensor) and fits(logits):
            return logits
        values: Sequence[Any] = list(outputs.values())
    elif isinstance(outputs, (tuple, list)):
        values = outputs
    else:
        return None
    for v in values:
        found = first_tensor(v, batch_size=batch_size, batch_dim=batch_dim)
        if found is not None:
            return found
    return None


def batch_independence_error(what: str) -> BatchIndependenceError:
    """The error of a failed check: ``what`` failed, why it matters, the likely causes
    (:data:`LIKELY_CAUSES`) and the switch that turns the check off."""
    return BatchIndependenceError(
        f"{what}. A record's loss must depend on that record alone: otherwise removing one record "
        "moves the other records' gradients, and the released update by more than the clipping "
        f"bound C the privacy accounting assumes. Likely causes: {LIKELY_CAUSES}. Nothing was "
        "noised or accounted. If the dependence is intended and you have accounted for it, turn "
        "this check off with make_private(..., check_batch_independence=False) "
        "(PrivacyArguments(check_batch_independence=False) for DPTrainer)"
    )


class BatchIndependenceCheck:
    """The engine's check of batch independence, a forward pre-hook on the model.

    At a forward in training mode with gradients enabled, the grad-sample hooks enabled and
    a non-empty batch, the hook runs the forward of the whole batch and of each of a few
    records alone (:func:`check_rows`), inside :func:`independence_forward`, then lets the
    training forward proceed. It checks the first such batch of at least two records (batch
    statistics, a record's outputs alone), and, until it has checked one, the first batch with
    padding (``attention_mask`` zeros in a checked row), then removes itself: a first batch
    without padding (records of equal length, or one record) does not end the check, since
    a later physical batch of the same run may be padded (a vacuous first check let left
    padding with learned positions through a second physical batch at 1.38 C). While it
    waits for a padded batch, each training forward costs one reduction of the mask. "Alone" is the
    record's row of every batch-shaped tensor input (``(B, ...)`` with ``batch_first``, else
    ``(T, B, ...)``); with an ``attention_mask`` ``(B, T)`` among the keyword inputs (and
    ``batch_first``), every ``(B, T, ...)`` input is further cut to the row's real tokens
    (``mask != 0``), and the outputs are compared at those positions. The compared output is
    the model's first tensor output (a Hugging Face output's ``logits``).

    Under FSDP (sharded modules gather their parameters with collectives, which ranks with
    different batches would not reach alike) the check does not run and says so in a
    ``UserWarning``; on the meta device (no values, nothing released) it does not run.

    Args:
        model: The model the user calls (pre-hook target).
        hooks: The grad-sample module or hooks object (disabled during the check).
        batch_first: The model's layout.

    Raises:
        BatchIndependenceError: From the training forward, if a record's output alone differs
            from its output in the batch beyond rounding.
    """

    def __init__(self, model: nn.Module, *, hooks: Any, batch_first: bool) -> None:
        self.model = model
        self.hooks = hooks
        self.batch_first = bool(batch_first)
        self.checked_rows: list[int] | None = None
        #: A batch of at least two records was checked; a batch with padding was checked.
        self.checked_batch = False
        self.checked_padding = False
        #: The first checked batch's ``attention_mask`` ``(B, T)``, until the DP criterion's
        #: first call checks its targets against it (:meth:`check_padding_targets`).
        self.pending_mask: torch.Tensor | None = None
        self.handle = model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    def remove(self) -> None:
        """Detach the pre-hook (the check will not run)."""
        self.handle.remove()

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if self.hooks is not None and not getattr(self.hooks, "hooks_enabled", True):
            return
        batch_dim = 0 if self.batch_first else 1
        size = _batch_size([*args, *kwargs.values()], batch_dim)
        if not size:
            return  # no batch-shaped input, or an empty batch: check the next forward
        inner = _unwrap_data_parallel(module)
        values = (*args, *kwargs.values())
        if any(isinstance(v, torch.Tensor) and v.is_meta for v in values):
            self.remove()  # the meta device (FLOPs and memory counted): no values, no release
            return
        if _is_fsdp(inner):
            # See the class docstring: said, not skipped silently.
            self.remove()
            warnings.warn(
                "the batch-independence check does not run under FSDP (its extra forwards "
                "would gather sharded parameters on some ranks only): make sure each record's "
                "loss depends on that record alone (position ids from the attention mask, no "
                "target predicted from padding, no batch statistic), and pass "
                "check_batch_independence=False to silence this",
                UserWarning,
                stacklevel=2,
            )
            return
        mask = _padding_mask(kwargs, size, self.batch_first)
        padded = mask is not None and size > 1 and bool((mask == 0).any())
        if self.checked_batch and not padded:
            return  # waiting for a padded batch
        self.run(inner, args, kwargs, batch_size=size, batch_dim=batch_dim)
        self.checked_batch = self.checked_batch or size > 1
        self.checked_padding = self.checked_padding or padded
        if self.checked_batch and (self.checked_padding or mask is None):
            self.remove()

    def run(
        self,
        model: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        batch_size: int,
        batch_dim: int,
    ) -> None:
        """Compare a few records alone with the batch (see the class docstring)."""
        mask = _padding_mask(kwargs, batch_size, self.batch_first)
        values = (*args, *kwargs.values())
        uncut = sorted({type(v).__name__ for v in values if not _cuttable(v)})
        sizes = {
            int(v.shape[batch_dim])
            for v in values
            if isinstance(v, torch.Tensor) and v.dim() > batch_dim and v.shape[batch_dim] != 1
        }
        if uncut or len(sizes) > 1:
            what = (
                f"inputs of type {', '.join(uncut)}"
                if uncut
                else f"tensor inputs of different lengths along the batch axis {sorted(sizes)} "
                "(flat inputs with offsets)"
            )
            warnings.warn(
                f"the batch-independence check cannot cut one record out of {what}, so it did "
                "not run: make sure each record's loss depends on that record alone, and pass "
                "check_batch_independence=False to silence this",
                UserWarning,
                stacklevel=2,
            )
            return
        rows = check_rows(batch_size, mask)
        self.checked_rows = rows
        self.pending_mask = None if mask is None else mask.detach() != 0
        with independence_forward(model, self.hooks):
            full = first_tensor(model(*args, **kwargs), batch_size=batch_size, batch_dim=batch_dim)
            if full is None:
                raise batch_independence_error(
                    "the batch-independence check found no output with one row per record "
                    f"(the batch has {batch_size} records) to compare records with"
                )
            for i in rows:
                keep = None if mask is None else mask[i] != 0
                one_args = tuple(_one_record(a, i, batch_size, batch_dim, keep) for a in args)
                one_kwargs = {
                    k: _one_record(v, i, batch_size, batch_dim, keep) for k, v in kwargs.items()
                }
                with per_record_inputs(model):
                    out = model(*one_args, **one_kwargs)
                alone = first_tensor(out, batch_size=1, batch_dim=batch_dim)
                inside = full.select(batch_dim, i)
                if keep is not None and inside.dim() >= 1 and inside.shape[0] == keep.shape[0]:
                    inside = inside[keep]
                alone_row = None if alone is None else alone.select(batch_dim, 0)
                equal, diff, tol = (
                    (False, math.inf, 0.0)
                    if alone_row is None
                    else allclose_rounding(inside, alone_row)
                )
                if not equal:
                    raise batch_independence_error(
                        f"record {i} of the first training batch gives other outputs alone than "
                        f"inside its batch of {batch_size} (max |difference| {diff:.3g}, "
                        f"rounding tolerance {tol:.3g}"
                        + (
                            "; compared at its real tokens, attention_mask != 0"
                            if keep is not None
                            else ""
                        )
                        + ")"
                    )

    def check_padding_targets(self, targets: Any, *, shape: Any, ignore_index: Any) -> None:
        """Refuse a per-token loss with a target predicted from a padding position (once).

        The outputs compared by :meth:`run` are a record's outputs at its real tokens; a
        causal LM's output at a *padding* position also enters the loss when that position's
        target is not ignored. Under left padding the last padding position predicts the
        record's first token, and its output depends on how much padding the batch has, that
        is on the other records (a released update moved by 1.04 C in the neighbouring-dataset
        harness). Output position ``t`` of a per-token loss over ``T' = T`` or ``T - 1``
        positions (targets already shifted, or logits ``[:, :-1]`` against labels ``[:, 1:]``)
        is computed at input position ``t``, so a target that is not ``ignore_index`` where
        ``attention_mask[:, t] == 0`` is such a prediction.

        Args:
            targets: The criterion's targets: ``(B, T')`` or flattened ``(B T',)`` with
                ``shape = (B, T', ...)``; anything else is not a per-token loss and passes.
            shape: The criterion's ``shape=`` (None without).
            ignore_index: The criterion's ``ignore_index`` (None: no target is ignored).

        Raises:
            BatchIndependenceError: If a target at a padding position is not ignored.
        """
        mask, self.pending_mask = self.pending_mask, None
        if mask is None or not isinstance(targets, torch.Tensor):
            return
        b, t = mask.shape
        if shape is not None and len(shape) >= 2 and int(shape[0]) == b:
            if targets.numel() != int(shape[0]) * int(shape[1]):
                return
            targets = targets.reshape(int(shape[0]), int(shape[1]))
        if targets.dim() != 2 or targets.shape[0] != b or targets.shape[1] not in (t, t - 1):
            return
        padding = ~mask[:, : targets.shape[1]].to(targets.device)
        counted = torch.ones_like(padding) if ignore_index is None else targets != ignore_index
        bad = padding & counted
        if bool(bad.any()):
            row, position = (int(v) for v in bad.nonzero()[0])
            raise batch_independence_error(
                f"{int(bad.sum())} target(s) of the first training batch are predicted from "
                f"padding positions (attention_mask == 0; the first: record {row}, position "
                f"{position}): under left padding the last padding position predicts the "
                "record's first token, and its output depends on how much padding the batch "
                "has. Set the labels predicted from padding to the criterion's ignore_index "
                "(labels[:, 1:][attention_mask[:, :-1] == 0] = -100 for labels shifted in the "
                "loss; DPTrainer does it), or pad on the right"
            )


def _padding_mask(kwargs: dict[str, Any], batch_size: int, batch_first: bool) -> Any:
    """The ``attention_mask`` ``(B, T)`` among the keyword inputs, or None."""
    mask = kwargs.get("attention_mask")
    if (
        batch_first
        and isinstance(mask, torch.Tensor)
        and mask.dim() == 2
        and mask.shape[0] == batch_size
    ):
        return mask
    return None


def _cuttable(value: Any) -> bool:
    """Whether one record of ``value`` can be cut (a tensor) or it holds no record (a plain
    scalar, a string, None)."""
    return value is None or isinstance(value, (torch.Tensor, bool, int, float, str))


def _batch_size(values: Sequence[Any], batch_dim: int) -> int | None:
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() > batch_dim:
            return int(v.shape[batch_dim])
    return None


def _one_record(
    value: Any, i: int, batch_size: int, batch_dim: int, keep: torch.Tensor | None
) -> Any:
    """Record ``i`` of one input: its row of a batch-shaped tensor, cut to ``keep`` along the
    sequence axis of ``(B, T, ...)`` tensors; any other value unchanged."""
    if not isinstance(value, torch.Tensor) or value.dim() <= batch_dim:
        return value
    if value.shape[batch_dim] == batch_size:
        value = value.narrow(batch_dim, i, 1)
    elif value.shape[batch_dim] != 1:
        return value
    if keep is not None and value.dim() >= 2 and value.shape[1] == keep.shape[0]:
        value = value[:, keep]
    return value


def _unwrap_data_parallel(module: nn.Module) -> nn.Module:
    """The module inside DDP / DPDDP wrappers (whose forward would issue collectives)."""
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    wrappers = (DistributedDataParallel, DifferentiallyPrivateDistributedDataParallel)
    while isinstance(module, wrappers):
        module = module.module
    return module


def _is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())
