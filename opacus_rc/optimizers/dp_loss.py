"""The DP loss of randomized clipping (one or two backward passes), failure modes made explicit.

Opacus' ``DPLossFastGradientClipping`` wraps the criterion so that ``loss.backward()`` runs
both passes of ghost clipping (norms, then ``sum_i c_i loss_i``). :class:`DPLossRandomizedClipping`
is that loss with a single-backward mode and four guarantees added
(``tests/reliability/CATALOGUE.md``).

The loss is thin: its ``backward()`` reduces the per-sample losses, checks its own arguments,
calls the grad-sample module's one private backward
(:meth:`~opacus_rc.grad_sample.private_step.PrivateStep.backward`, which runs
the first pass, the clip factors, the rank agreement and the clipped sum or second pass) and
hands the :class:`~opacus_rc.grad_sample.private_step.ClipResult` it returns to the optimizer
(:meth:`~opacus_rc.optimizers.RandomizedClipOptimizer.accept_clip_result`).

**Book-keeping** (when the module's ``bookkeeping`` property is true; Bu, Wang, Zha and
Karypis, "Differentially Private Optimization on Large Model at Small Cost", ICML 2023): the
first pass runs without ``retain_graph`` (the graph is freed), the module keeps each layer's
input and output gradient (or its per-sample gradients), the first-pass gradients are zeroed,
the clip factors ``c`` are computed and checked as in the two-pass mode, and
``module.apply_clipped_sum(c)`` writes ``p.grad = sum_i c_i grad_p loss_i``: the gradient the
second pass would give, without running it. The probes are drawn in the first pass only, in
both modes, so the sketch randomness and the privacy analysis are the same. Otherwise (an
module without a clipped sum is trainable, or ``bookkeeping=False``) the second backward
pass of ``sum_i c_i loss_i`` runs. Under DDP/DPDDP each rank forms its own clipped sum and the
distributed optimizer all-reduces it once (torch DDP's reducer is off,
:mod:`~opacus_rc.grad_sample.distributed`).

1. **A failed backward never becomes a step.** If anything raises between the first pass and
   the end of the second (or of the clipped sum: a NaN/inf norm estimate, a module in eval
   mode, a broadcast input), the gradients are cleared (``p.grad = None``; ``p.summed_grad`` of
   earlier virtual steps is kept), the stored activations and book-keeping tensors are dropped,
   and the optimizer refuses to step until ``optimizer.zero_grad()``: no unclipped gradient is
   released and nothing is accounted.
2. **One clip factor per sample.** The number of clip factors must equal the number of
   per-sample losses. Opacus multiplies them with broadcasting, so a model whose trainable
   modules only see a batch-broadcast input (``position_ids`` of shape ``[1, T]``, Opacus
   issue 841) or a per-token loss without ``shape=`` would be clipped with one factor for the
   whole batch.
3. **No silent gradient accumulation.** A second ``backward()`` before ``optimizer.step()`` or
   ``zero_grad()`` would discard the first one's clipped gradients (Opacus issue 683: the
   two-pass loss zeroes gradients between its passes; so does book-keeping). It raises
   instead; use Opacus' ``BatchMemoryManager`` (virtual steps) to split a logical batch.
4. Hooks are re-enabled even if the second pass raises.
5. **No batch-level term in a per-sample loss.** Opacus' arithmetic (``loss + other``)
   broadcasts a plain tensor into every sample's loss; one that requires grad and is not one
   value per sample (a batch-mean loss, a weight penalty) raises a ``TypeError``
   (:func:`_check_operand`). Targets passed as ``target=`` are bound to their position, so
   that ``ignore_index`` positions leave each sample's mean (Opacus reads ``args[1]`` only).

In both modes a parameter that received a gradient without a per-sample norm raises (in the
module's ``get_clipping_coef``), and book-keeping tensors never outlive their step.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from opacus.utils.fast_gradient_clipping_utils import (
    DPLossFastGradientClipping,
    DPTensorFastGradientClipping,
)

from opacus_rc._compat.opacus import next_step_skipped
from opacus_rc.grad_sample.private_step import StepProtocolError
from opacus_rc.packed_loss import record_losses_for_loss
from opacus_rc.units.criterion import unit_layout_for_loss

__all__ = ["LOSS_SCALING_REFUSED", "DPLossRandomizedClipping", "DPTensorRandomizedClipping"]

#: Why fp16 loss scaling (``torch.amp.GradScaler``, ``torch.cuda.amp.GradScaler``) is refused,
#: at ``scaler.scale(loss)`` and at ``scaler.step(optimizer)``.
LOSS_SCALING_REFUSED = (
    "fp16 loss scaling (torch.amp.GradScaler) is not supported with randomized clipping. "
    "scaler.scale(loss) multiplies every per-sample gradient by the loss scale S before the "
    "clip factors are computed (after unscaling, each sample would be clipped at C / S "
    "instead of max_grad_norm C), and "
    "scaler.step(optimizer) skips the step whenever a gradient overflows: whether one sample's "
    "gradient overflows is a function of the private data, released without noise, so no "
    "epsilon covers the skipped steps, accounted or not. Use bf16 autocast, which has float32's "
    "exponent range and needs no scaler: `with torch.autocast(device_type, "
    "dtype=torch.bfloat16): loss = criterion(model(x), y)`, then loss.backward() and "
    "optimizer.step() (remove the GradScaler, or construct it with enabled=False)"
)

_ARITHMETIC = (
    "__truediv__",
    "__mul__",
    "__rmul__",
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__neg__",
)


class DPTensorRandomizedClipping(DPTensorFastGradientClipping):
    """Per-sample losses whose ``backward()`` runs the randomized-clipping passes safely.

    One backward pass and the module's clipped sum if ``module.bookkeeping`` is true, else two
    backward passes.

    Arithmetic (``loss / 2``, ``loss + other``) keeps this class. See the module docstring.
    """

    def backward(
        self,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Any = None,
    ) -> None:
        """Run the private backward (see the module docstring); ``torch.Tensor.backward``'s
        signature, so that training loops written for a plain loss keep working.

        Args:
            gradient: Must be ``None`` (the loss is a scalar); scale the loss instead
                (``(loss * w).backward()``), which keeps the clipping.
            retain_graph: ``None`` or False (the graph is freed, as PyTorch's default).
                True is refused: a later backward through the kept graph would add an
                unclipped gradient to the clipped one (the hooked modules see it only after
                their parameters' gradients have grown).
            create_graph: Must be False: higher-order gradients of the clipped loss are not
                supported.
            inputs: Must be ``None``: the private backward reaches every trainable parameter
                (freeze the ones that should not train).

        Raises:
            TypeError: On a ``gradient``, ``retain_graph=True``, ``create_graph=True`` or
                ``inputs``; the step is then refused (``step()`` raises until ``zero_grad()``),
                as for any failed backward.
            ValueError: If ``loss_reduction`` is neither ``"mean"`` nor ``"sum"``.
            Exception: What the private backward raises
                (:meth:`~opacus_rc.grad_sample.private_step.PrivateStep.backward`).
        """
        if self.loss_reduction == "mean":
            reduced_loss = torch.mean(self.loss_per_sample, dim=0)
        elif self.loss_reduction == "sum":
            reduced_loss = torch.sum(self.loss_per_sample, dim=0)
        else:
            raise ValueError(
                f"loss_reduction = {self.loss_reduction}. Only 'sum' and 'mean' losses are "
                "supported"
            )
        optimizer, step = self.optimizer, self.module.private_step
        if not optimizer.backward_allowed:  # two backwards, or one after a failure
            step.reset()  # this forward's records; the earlier clipped gradients are kept
            optimizer.check_backward_allowed()  # raises, saying which
            raise StepProtocolError("a private backward is not allowed now")
        # An argument error is raised by the private backward, where it fails the step and
        # every rank raises with it (as for any other error of the backward). Inside a
        # logical step split by BatchMemoryManager the ranks' batches do not line up: no
        # agreement there.
        try:
            result = step.backward(
                self.loss_per_sample,
                reduced_loss=reduced_loss,
                max_grad_norm=optimizer.max_grad_norm,
                agree_ranks=not next_step_skipped(optimizer),
                refused=None
                if gradient is None and not retain_graph and not create_graph and inputs is None
                else backward_arguments_error(gradient, retain_graph, create_graph, inputs),
            )
        except BaseException:
            optimizer.backward_failed()
            raise
        optimizer.accept_clip_result(result)

    def __iter__(self) -> Iterator[Any]:
        """Refuse iteration: the DP loss is one scalar, and the caller is almost always
        ``torch.amp.GradScaler.scale`` (fp16 loss scaling), which iterates what is not a
        ``torch.Tensor``. See :data:`LOSS_SCALING_REFUSED` for why scaling is refused.

        Raises:
            TypeError: Always, naming bf16 autocast as the supported way.
        """
        raise TypeError(LOSS_SCALING_REFUSED)


def backward_arguments_error(
    gradient: Any, retain_graph: bool | None, create_graph: bool, inputs: Any
) -> TypeError | None:
    """The error for a ``Tensor.backward`` argument that the private backward cannot honour
    (checked in this order), or None if every argument is accepted."""
    if retain_graph:
        return TypeError(
            "the DP loss's backward() does not support retain_graph=True: a later backward "
            "through the kept graph would add an unclipped gradient to the clipped one. Add "
            "every loss before the private backward ((loss + other).backward(), where other "
            "also comes from the criterion returned by make_private), or run a new forward; "
            "retain_graph=False (the default) is accepted"
        )
    if gradient is not None:
        return TypeError(
            "the DP loss's backward() takes no gradient argument (the loss is a scalar); to "
            "weight it, scale the loss instead: (loss * w).backward()"
        )
    if create_graph:
        return TypeError(
            "the DP loss's backward() does not support create_graph=True: higher-order "
            "gradients of the clipped loss are not computed"
        )
    if inputs is not None:
        return TypeError(
            "the DP loss's backward() takes no inputs argument: it reaches every trainable "
            "parameter; freeze (requires_grad_(False)) the ones that should not train"
        )
    return None


def _check_operand(loss: DPTensorFastGradientClipping, name: str, other: Any) -> None:
    """Refuse an operand that would put a batch-level, parameter-dependent term into every
    sample's loss.

    Opacus' arithmetic broadcasts a plain tensor over ``loss_per_sample``. A tensor that
    requires grad and is not one value per sample (a batch-mean loss, a penalty of the
    weights) then appears in every sample's loss: its gradient mixes all samples and is not
    clipped per sample. Measured with two backward passes: the released gradient was
    ``sum_i c_i g_i + mean(c) sum_j g'_j``, one sample's ``g'`` scaled by the mean clip
    factor instead of its own (meta-pytorch/opacus PR 668 gave the DP loss its arithmetic).

    Raises:
        TypeError: For a tensor operand that requires grad, except a per-sample tensor of
            ``loss_per_sample``'s shape added or subtracted.
    """
    if not isinstance(other, torch.Tensor) or not other.requires_grad:
        return
    per_sample = tuple(loss.loss_per_sample.shape)
    additive = name in ("__add__", "__radd__", "__sub__", "__rsub__")
    if additive and tuple(other.shape) == per_sample:
        return
    raise TypeError(
        f"DP loss {name}: the other operand is a tensor of shape {tuple(other.shape)} that "
        f"requires grad, so it would enter every sample's loss (the per-sample losses have "
        f"shape {per_sample}): its gradient mixes all samples and no per-sample clip factor "
        "bounds it. Make every term per sample: add losses of the DP criterion "
        "(criterion(out, y) + criterion(out2, y2)), or add a tensor of shape "
        f"{per_sample} whose entry i depends on sample i only; multiply or divide only by "
        "constants (tensors that do not require grad). A penalty on the weights (L2 "
        "regularization) belongs in the optimizer's weight_decay."
    )


def _keep_class(name: str) -> Any:
    base = getattr(DPTensorFastGradientClipping, name)

    def method(self: DPTensorRandomizedClipping, *args: Any) -> DPTensorRandomizedClipping:
        try:
            for other in args:
                _check_operand(self, name, other)
        except TypeError:
            # Raised between a forward and its backward: drop the forward's records (nothing
            # reached a gradient yet), so the next forward starts the step afresh.
            self.module.private_step.reset()
            raise
        out = base(self, *args)
        return DPTensorRandomizedClipping(
            out.module, out.optimizer, out.loss_per_sample, out.loss_reduction
        )

    method.__name__ = name
    method.__doc__ = base.__doc__
    return method


for _name in _ARITHMETIC:
    setattr(DPTensorRandomizedClipping, _name, _keep_class(_name))


class DPLossRandomizedClipping(DPLossFastGradientClipping):
    """Opacus' ``DPLossFastGradientClipping`` returning :class:`DPTensorRandomizedClipping`.

    Per-token losses (``criterion(logits, targets, shape=(B, T, ...))``) are reduced per sample
    as in Opacus: the mean over the positions whose target is not ``criterion.ignore_index``
    (``nn.CrossEntropyLoss``, ``nn.NLLLoss``), or over all positions for a criterion without
    that attribute, which warns once.

    Args:
        module: The randomized-clipping grad-sample module (or hooks object).
        optimizer: Its :class:`~opacus_rc.optimizers.RandomizedClipOptimizer`.
        criterion: The loss (``reduction`` must equal ``loss_reduction``).
        loss_reduction: ``"mean"`` or ``"sum"``.
    """

    _warned_no_ignore_index = False

    def __call__(
        self,
        *args: Any,
        shape: Any = None,
        units: Any = None,
        unit_split: Any = None,
        record_ids: Any = None,
        position_ids: Any = None,
        **kwargs: Any,
    ) -> DPTensorRandomizedClipping:
        """The per-sample losses of ``criterion(*args, **kwargs)``, as a DP loss.

        Args:
            *args: The criterion's arguments (``logits, targets``).
            shape: ``logits.shape`` for a per-token loss (flattened logits and targets).
            units: Optional ``(B,)`` integer tensor, the unit (document, user) ``0..U-1`` of
                each sequence: the losses, norms and clip factors are then per unit, shape
                ``(U,)``, each unit's loss the sum of its sequences' losses
                (:mod:`opacus_rc.units`, docs/privacy/units.md).
            unit_split: With ``units``, the batch's
                :class:`~opacus_rc.units.UnitSplit` when a unit is cut across the
                physical batches of a logical one (``UnitBatchMemoryManager(split_units=True)``
                yields it), or None (whole units).
            record_ids: Optional ``(R, T)`` long tensor over the model's tokens of packed rows,
                the record ``0..N-1`` of each token, -1 at padding (docs/packing.md): the
                losses, norms and clip factors are then per record, shape ``(N,)`` (per unit,
                ``(U,)``, with ``units=`` of shape ``(N,)``, the unit of each record). Needs a
                per-token loss (``shape=(R, T')``, ``T' = T``, or ``T - 1`` for logits
                ``[:, :-1]`` against labels ``[:, 1:]``).
            position_ids: Instead of ``record_ids``, ``(R, T)`` position ids restarting at 0
                at each record (a padding-free batch).
            **kwargs: The criterion's keyword arguments.

        Returns:
            A :class:`DPTensorRandomizedClipping` of ``(B,)`` (or ``(U,)``, or ``(N,)``)
            per-sample losses.

        Raises:
            See :func:`opacus_rc.units.unit_layout_for_loss` for ``units``, and
            :func:`opacus_rc.packed_loss.record_losses_for_loss` for ``record_ids``.
        """
        if (
            shape is not None
            and self.loss_reduction == "mean"
            and getattr(self.criterion, "ignore_index", None) is None
            and not self._warned_no_ignore_index
        ):
            # Opacus averages a per-token loss over the positions whose target differs from
            # criterion.ignore_index; without that attribute, over all T positions.
            self._warned_no_ignore_index = True
            warnings.warn(
                f"{type(self.criterion).__name__} has no ignore_index attribute: with shape=, "
                "each sample's loss is the mean over all of its positions. If the criterion "
                "masks positions itself (padding), their zero losses still count in that mean; "
                "give the criterion an ignore_index (nn.CrossEntropyLoss has one) so that "
                "masked positions leave the denominator.",
                UserWarning,
                stacklevel=2,
            )
        if shape is not None and "target" in kwargs and len(args) <= 1:
            # Opacus reads the targets (for ignore_index) from args[1] only: with
            # ``criterion(logits, target=labels, shape=...)`` it averaged each sample's loss
            # over all T positions, ignored ones included (meta-pytorch/opacus#792 again).
            # Pass them by position, as nn.CrossEntropyLoss.forward(input, target) binds them.
            if not args:
                args = (kwargs.pop("input"),) if "input" in kwargs else ()
            args = (*args, kwargs.pop("target"))
        check = getattr(self.module, "batch_independence_check", None)
        if check is not None and check.pending_mask is not None and len(args) >= 2:
            # The first step's targets against the first batch's padding (the engine's
            # batch-independence check compares outputs at real tokens only).
            check.check_padding_targets(
                args[1], shape=shape, ignore_index=getattr(self.criterion, "ignore_index", None)
            )
        if record_ids is not None or position_ids is not None:
            return _per_record_losses(
                self, args, kwargs, shape, units, unit_split, record_ids, position_ids
            )
        out = super().__call__(*args, shape=shape, **kwargs)
        losses = out.loss_per_sample
        layout = unit_layout_for_loss(out.module, losses, units, split=unit_split)
        if layout is not None:
            losses = layout.sum_per_unit(losses)  # (U,): each unit's loss, summed
        return DPTensorRandomizedClipping(out.module, out.optimizer, losses, out.loss_reduction)


def _per_record_losses(
    loss: DPLossRandomizedClipping,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    shape: Any,
    units: Any,
    unit_split: Any,
    record_ids: Any,
    position_ids: Any,
) -> DPTensorRandomizedClipping:
    """The criterion's ``record_ids=`` (packed rows, :mod:`opacus_rc.packed_loss`)."""
    if unit_split is not None:
        raise ValueError(
            "unit_split= is not supported with record_ids=: a record cut across rows is "
            "clipped once inside one physical batch; keep every record's rows in one batch"
        )
    out = DPLossFastGradientClipping.__call__(loss, *args, shape=None, **kwargs)
    targets = args[1] if len(args) >= 2 else kwargs.get("target")
    try:
        losses = record_losses_for_loss(
            out.module,
            out.loss_per_sample,
            targets,
            shape=shape,
            record_ids=record_ids,
            position_ids=position_ids,
            units=units,
            ignore_index=getattr(loss.criterion, "ignore_index", None),
            reduction=loss.loss_reduction,
        )
    except BaseException:
        # Refused between a forward and its backward: drop the forward's records (nothing
        # reached a gradient yet), so that the next forward starts the step afresh.
        step = getattr(out.module, "private_step", None)
        if step is not None:
            step.reset()
        raise
    return DPTensorRandomizedClipping(out.module, out.optimizer, losses, out.loss_reduction)
