"""One randomized-clipping step, owned by one object (docs/architecture.md#architecture-step).

:class:`PrivateStep` owns everything about one step of a randomized-clipping grad-sample
module, which holds it as ``module.private_step`` (composition: the module's Opacus hook
methods are one-line delegations to it). It owns the step's phase, the recorded norms and
gradients seen, the book-keeping stashes, the inputs of the book-keeping first pass, the tied
sketches (:class:`~opacus_rc.grad_sample.tied.TiedSketches`), the parameter-use and
trainable-set checks (:mod:`~opacus_rc.grad_sample.checks`), the keyword arguments of hooked
calls (:class:`~opacus_rc.grad_sample.forward_inputs.ForwardInputBinder`), the step's units
layout and the open unit of a unit cut across physical batches (:mod:`opacus_rc.units.split`).
:meth:`PrivateStep.reset` drops all of them.

:meth:`PrivateStep.backward` is the one private backward: the DP loss
(:class:`~opacus_rc.optimizers.DPLossRandomizedClipping`) calls it once per batch and hands the
frozen :class:`ClipResult` it returns to the optimizer, which holds no reference to the module.
In order:

1. the losses are one per sample (or unit), every trainable parameter reaches the loss through
   its module's forward, and the step's backward is planned (checkpointed? the smaller stash?);
2. **first pass**: ``reduced_loss`` is backpropagated, with book-keeping only as far as the
   hooked modules' inputs (the graph is then freed); the backward hooks record the per-sample
   norms (:meth:`PrivateStep.backward_hook`); the first pass's gradients are dropped;
3. **clip factors**: :meth:`PrivateStep.issue_clip_factors`, one per per-sample loss, made by
   :func:`~opacus_rc.grad_sample.clip.clip_factors`;
4. **rank agreement**: in a distributed model every rank learns whether any failed (one
   all-reduce of a flag), so that all raise together;
5. **clipped sum**: with book-keeping ``sum_i c_i g_i`` is written from the first pass's
   tensors (:func:`~opacus_rc.grad_sample.bookkeeping.write_clipped_sums`, or the cut-unit
   and FSDP2 variants; :meth:`PrivateStep.apply_clipped_sum` does the same for a caller that
   issued the clip factors itself); otherwise the second backward pass of ``sum_i c_i loss_i``
   runs with the hooks off.

Anything that raises on the way leaves no gradient behind and drops every stored tensor
(:meth:`PrivateStep.abort`); the DP loss then tells the optimizer, whose ``step()`` refuses
until ``zero_grad()``.

Book-keeping policy (``RandomizedClippingConfig.bookkeeping``): ``True`` (default) runs one
backward pass per step wherever every route supports it and the model is not distributed, with
activation checkpointing too (HF ``gradient_checkpointing_enable()``, either ``use_reentrant``,
or ``torch.utils.checkpoint``): each ``nn.Linear`` keeps whichever is smaller for its clipped
sum, its per-sample gradients (``p d + p`` floats per sample; a
sketched norm is then the same sketch computed from them) or its input and output gradient
(``T (p + d)``), so the stored tensors do not undo checkpointing's memory saving and the sketch
costs the fewer FLOPs (:mod:`~opacus_rc.grad_sample.norms`); embeddings and a tied weight's
embedding side keep their ids and output gradient. ``"always"`` keeps every layer's input and output
gradient, checkpointed or not; ``False`` runs two backward passes.
"""

from __future__ import annotations

import enum
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from opacus.grad_sample.grad_sample_module import GradSampleHooks
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
)
from opacus.utils.module_utils import trainable_parameters
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from opacus_rc._compat.opacus import (
    SequenceBias,
    count_down_use,
    drop_current_grad_sample,
    forward_count,
    reset_forward_counter,
)
from opacus_rc.errors import StepProtocolError
from opacus_rc.grad_sample.bookkeeping import (
    BookkeepingStash,
    compute_clipped_sums,
    write_clipped_sums,
)
from opacus_rc.grad_sample.checkpointing import in_backward, in_checkpointed_forward
from opacus_rc.grad_sample.clip import apply_clip_factors, clip_factors
from opacus_rc.grad_sample.forward_inputs import check_single_output, contiguous_index_inputs
from opacus_rc.grad_sample.routing import NormPath
from opacus_rc.sketching import SketchSpec
from opacus_rc.units.layout import pack_for_units

__all__ = [
    "NORM_SAMPLED_PATHS",
    "ClipResult",
    "PrivateStep",
    "StepPhase",
    "StepProtocolError",
    "capture_activations_hook",
    "capture_backprops_hook",
    "empty_clip_result",
]

#: The grad-sample module's log channel (one name for every line it logs, which users filter on).
logger = logging.getLogger("opacus_rc.grad_sample.grad_sample_module")

#: Paths whose norm comes from a per-module norm sampler (no tied weights, one use per step).
NORM_SAMPLED_PATHS = (NormPath.SKETCHED, NormPath.EXACT, NormPath.GHOST)

#: Exact module type -> whether a module's own tensors are batch first, where that is its own
#: attribute rather than the model's ``batch_first``: inside Opacus' ``DPMultiheadAttention``
#: the ``SequenceBias`` layers (``add_bias_kv=True``) always see ``(L, B, E)`` keys and values,
#: whatever the model's layout.
_OWN_LAYOUT: dict[type[nn.Module], Any] = {SequenceBias: lambda m: bool(m.batch_first)}


class StepPhase(str, enum.Enum):
    """Where a :class:`PrivateStep` is in its step.

    ``IDLE --forward--> RECORDED --backward hooks--> NORMED --issue_clip_factors-->
    FACTORS_ISSUED --clipped sum or second pass--> APPLIED``; the next step's first hooked
    forward starts over, an error anywhere drops everything (:meth:`PrivateStep.abort`) and
    returns to ``IDLE``.
    """

    IDLE = "idle"
    RECORDED = "recorded"
    NORMED = "normed"
    FACTORS_ISSUED = "factors_issued"
    APPLIED = "applied"


@dataclass(frozen=True)
class ClipResult:
    """What one private backward hands to the optimizer (frozen): the only thing that crosses
    from :mod:`opacus_rc.grad_sample` to :mod:`opacus_rc.optimizers`.

    The clipped gradient sum itself is in ``p.grad``; this record says how it was made, so that
    the optimizer can check and account the step without reading the grad-sample module.

    Attributes:
        clip_factors: ``(R,)`` clip factors ``c_r = min(1, C / (n_hat_r + 1e-6))``, one per
            per-sample loss: ``R = B`` sequences, or ``R = U`` units with ``units=``
            (docs/privacy/units.md); float32 (float64 if a norm was float64). In a physical
            batch that cuts a unit (``unit_split=``, docs/privacy/units.md#units-split) the
            factors applied: a unit closing here has the factor of its whole summed gradient,
            a unit still open NaN (it has none yet).
        per_sample_norms: ``(R,)`` float64 whole-model norm estimates the factors were made from
            (NaN for a unit still open). Not privatized: for debugging and logging only.
        num_records: ``R``, the number of sequences (or units) clipped (0: an empty batch).
        per_unit: Whether the records are units (``units=`` was passed to the criterion).
        sketch_spec: The sketch that produced the norms
            (:class:`~opacus_rc.sketching.SketchSpec`): what the DP event accounts.
        bookkeeping: Whether the clipped sum came from the first pass's tensors (one backward
            pass, Bu et al. 2023) rather than a second backward pass.
        max_grad_norm: ``C``, the bound the factors were made for.
        clipped: ``id`` of every parameter that got a per-sample norm and a clip factor: any
            other parameter holding a gradient at ``step()`` would be released unclipped.
        open_unit: The :class:`~opacus_rc.units.split.OpenUnit` when a unit cut across physical
            batches is still open after this batch (a logical step must not end with it), else
            None.
    """

    clip_factors: torch.Tensor
    per_sample_norms: torch.Tensor
    num_records: int
    per_unit: bool
    sketch_spec: SketchSpec
    bookkeeping: bool
    max_grad_norm: float = 0.0
    clipped: frozenset[int] = frozenset()
    open_unit: Any = None


def empty_clip_result(
    *, sketch_spec: SketchSpec, max_grad_norm: float, bookkeeping: bool = False
) -> ClipResult:
    """The :class:`ClipResult` of an empty batch: no record, no clipped parameter (its clipped
    sum is zero; the step is the noise alone)."""
    empty = torch.zeros(0, dtype=torch.float64)
    return ClipResult(
        clip_factors=empty.float(),
        per_sample_norms=empty,
        num_records=0,
        per_unit=False,
        sketch_spec=sketch_spec,
        bookkeeping=bookkeeping,
        max_grad_norm=max_grad_norm,
    )


def _reuse_error(name: str, module: nn.Module) -> NotImplementedError:
    return NotImplementedError(
        f"module '{name}' ({type(module).__name__}) ran more than once "
        "before a backward pass (a module reused within one forward, or a training-mode "
        "forward that was never backpropagated). Randomized clipping needs one forward per "
        "module per step: use separate modules, or call backward after every forward in "
        "training mode (use torch.no_grad() or model.eval() for forwards you do not "
        "backpropagate)."
    )


def _no_activations_error(name: str, module: nn.Module) -> RuntimeError:
    name = f"'{name}' ({type(module).__name__})"
    if not module.training:
        return RuntimeError(
            f"module {name} is in eval mode but received a gradient in a private backward "
            "pass: its inputs were not recorded, so it has no per-sample norm and would not "
            "be clipped. Call model.train() before training steps (use eval() only for "
            "evaluation, under torch.no_grad())."
        )
    return RuntimeError(
        f"module {name} received a gradient but its forward inputs were not recorded, so "
        "no per-sample norm can be computed and the step cannot be clipped. Either its "
        "forward ran with the hooks disabled or under torch.no_grad(), or it ran in a "
        "non-reentrant torch.utils.checkpoint region created outside the forward of every "
        "module of the model (checkpoint(model.block, x) in the training loop), whose "
        "recomputation stops before this module's forward hook: create the region inside a "
        "module's forward, or enter torch.utils.checkpoint.set_checkpoint_early_stop(False)"
    )


def _one_loss_per_record_error(losses: torch.Tensor) -> ValueError:
    return ValueError(
        f"the criterion returned per-sample losses of shape {tuple(losses.shape)}; "
        "randomized clipping needs one loss per sample, shape (B,). For a per-token loss, "
        "flatten the logits and targets and pass shape=logits.shape: "
        "criterion(logits.reshape(-1, V), labels.reshape(-1), shape=logits.shape) "
        "(each sample's loss is then the mean over its positions whose label is not "
        "criterion.ignore_index); or give a criterion that returns one loss per sample "
        "(e.g. its (B, T) losses reduced over dim 1)"
    )


def _one_factor_per_loss_error(coef: torch.Tensor, losses: torch.Tensor) -> ValueError:
    # Opacus multiplies factors and losses with broadcasting, so a model whose trainable
    # modules only see a batch-broadcast input would be clipped with one factor for the batch.
    return ValueError(
        f"randomized clipping computed {coef.numel()} clip factors for per-sample "
        f"losses of shape {tuple(losses.shape)}; there must be one factor per sample. "
        "Either the trainable modules only saw a batch-broadcast input (e.g. Hugging "
        "Face position_ids of shape [1, T], Opacus issue 841: expand it to [B, T]), or "
        "the loss is per token (pass shape=logits.shape to the criterion)"
    )


#: PyTorch's warning for every hooked module whose inputs need no gradient (the lowest
#: trainable layers), where the output gradient is exactly what the per-sample norm needs.
_OUTPUT_HOOK_WARNING = (
    "Full backward hook is firing when gradients are computed with respect to module outputs"
)


class PrivateStep:
    """Everything about one randomized-clipping step (see the module docstring).

    Built by the grad-sample module's constructor; users reach it as ``module.private_step``.

    Args:
        owner: The grad-sample module (or hooks object) whose Opacus hooks this step extends.
        model: The model (``owner``'s wrapped module).
        config: The validated :class:`~opacus_rc.config.RandomizedClippingConfig`.
        routes: ``{id(module): NormRoute}`` of the hooked modules.
        norms: The :class:`~opacus_rc.grad_sample.norms.ModuleNorms` that compute each
            module's norms.
        tied: The :class:`~opacus_rc.grad_sample.tied.TiedSketches` of the model.
        uses: The :class:`~opacus_rc.grad_sample.checks.ParameterUseCheck`.
        trainable: The :class:`~opacus_rc.grad_sample.checks.TrainableSetGuard`.
        inputs: The :class:`~opacus_rc.grad_sample.forward_inputs.ForwardInputBinder`.
        ddp_modules: torch DDP modules whose reducer was turned off (a reducer turned back on
            needs every parameter's gradient in the first pass).
        bookkeeping: Whether steps use book-keeping (decided by the module).
        name_of: Qualified name of a module or parameter (for messages).
        generators: The :class:`~opacus_rc.sketching.SketchGenerators` probes are drawn from.
        estimator: The module's squared-norm estimator (also a cut unit's).
        clipped_sums: Module type -> clipped-sum function (book-keeping).
        adapters: Module types whose forward inputs are adapted (only the output gradient
            tells whether their batch is empty).
        output_edges: Reach a module whose inputs carry no gradient through its output's
            graph edge in the book-keeping first pass (FSDP2).
        distributed: Whether the model is data-parallel (the ranks agree after each first pass).

    Attributes:
        phase: The current :class:`StepPhase`.
        per_sample_gradient_norms: ``(R,)`` float64 norms of the last issued clip factors,
            kept until the next hooked forward pass (read-only use), or None.
        open_unit: The :class:`~opacus_rc.units.split.OpenUnit` of a unit cut across physical
            batches, or None before the first cut.
    """

    def __init__(
        self,
        owner: Any,
        *,
        model: nn.Module,
        config: Any,
        routes: dict[int, Any],
        norms: Any,
        tied: Any,
        uses: Any,
        trainable: Any,
        inputs: Any,
        ddp_modules: list[Any],
        bookkeeping: bool,
        name_of: Any,
        generators: Any,
        estimator: Any,
        clipped_sums: Any,
        adapters: Any,
        output_edges: bool = False,
        distributed: bool = False,
    ) -> None:
        self._owner = owner
        self.model = model
        self.config = config
        self.routes = routes
        self.norms = norms
        self.tied = tied
        self.uses = uses
        self.trainable = trainable
        self.inputs = inputs
        self.ddp_modules = ddp_modules
        self.bookkeeping = bookkeeping
        self.name_of = name_of
        self.generators = generators
        self.generator_for = generators.for_device
        self.estimator = estimator
        self.clipped_sums = clipped_sums
        self.adapters = adapters
        self.output_edges = output_edges
        self.distributed = distributed
        self.params = [p for _, p in trainable_parameters(model)]
        self.open_unit: Any = None
        self.phase = StepPhase.IDLE
        self.per_sample_gradient_norms: torch.Tensor | None = None
        self.last_norm_samples: dict[nn.Parameter, torch.Tensor] = {}
        self._norms: dict[nn.Parameter, torch.Tensor] = {}
        self._grad_seen: dict[int, Any] = {}
        self._max_grad_norm = float(config.max_grad_norm)
        self._stashes: dict[int, BookkeepingStash] = {}
        self._ready: list[BookkeepingStash] | None = None
        self._clipped: frozenset[int] = frozenset()
        self._first_pass_inputs: list[Any] = []
        #: The step's :class:`~opacus_rc.units.UnitLayout` (``units=`` passed to the
        #: criterion), or None (per-sequence clipping); _units_given: the criterion was called.
        self.units: Any = None
        self._units_given = False
        self._has_tied = bool(tied.supported_parameters)
        self.checkpointed = False
        self.smaller_stash = False
        self._told_checkpointing = False
        self._recorded_before_forward: set[int] = set()

    # ------------------------------------------------------------------------------------------
    # The forward hook, the backward hook and the post-accumulate-grad hook
    # ------------------------------------------------------------------------------------------

    def forward_hook(self, module: nn.Module, forward_input: Any, forward_output: Any) -> None:
        """Forward hook: store the inputs (Opacus), start the step at its first hooked forward,
        remember where the book-keeping first pass must reach, and refuse a second use of a
        norm-sampled module. Under activation checkpointing the inputs are stored by the
        recomputation inside the backward (:mod:`~opacus_rc.grad_sample.checkpointing`).

        Raises:
            NotImplementedError: A norm-sampled module used twice in one step.
            RuntimeError: A parameter made trainable, replaced or tied since make_private.
        """
        if (
            self._recorded_before_forward
            and id(module) in self._recorded_before_forward
            and in_backward()
        ):
            self._recorded_before_forward.discard(id(module))
            return  # recorded by record_before_forward, at this call's forward pre-hook
        owner = self._owner
        kwargs = self.inputs.take_call_kwargs(module)
        recording = owner.hooks_enabled and torch.is_grad_enabled() and module.training
        route = self.routes.get(id(module))
        if recording and any(p.requires_grad for p in module.parameters(recurse=False)):
            try:
                stored_input = self.inputs.bind(module, tuple(forward_input), kwargs)
                if route is not None and route.path is NormPath.FUNCTORCH:
                    check_single_output(module, forward_output, name=self.name_of(module))
            except BaseException:
                self._drop_after_hook_error()
                raise
        else:
            stored_input = list(forward_input)
        tied = route is not None and route.path is NormPath.TIED
        if recording and not in_backward():
            self._on_forward()
            self._record_first_pass_inputs(
                module, forward_input, forward_output if tied or self.output_edges else None
            )
            if in_checkpointed_forward():
                self.checkpointed = True
                return  # the recomputation inside the backward records the inputs
        try:
            if tied:
                # Both modules of a tied group count the shared weight's _forward_counter, which
                # Opacus' ghost hook refuses at 2: record with the plain hook, and check each
                # module's own uses below.
                GradSampleHooks.capture_activations_hook(
                    owner, module, stored_input, forward_output
                )
            else:
                GradSampleHooksFastGradientClipping.capture_activations_hook(
                    owner, module, stored_input, forward_output
                )
        except NotImplementedError as err:
            self._drop_after_hook_error()
            raise _reuse_error(self.name_of(module), module) from err
        except AttributeError:
            self._drop_after_hook_error()
            self.trainable.check()  # a parameter Opacus never saw: the clear error
            raise
        if not recording or not hasattr(module, "activations"):
            return
        if (tied and len(module.activations) > 1) or (
            route is not None
            and route.path in NORM_SAMPLED_PATHS
            and any(forward_count(p) > 1 for _, p in trainable_parameters(module))
        ):
            self._drop_after_hook_error()
            raise _reuse_error(self.name_of(module), module)
        # Index inputs expanded over the batch (position_ids.expand(B, -1)) made contiguous.
        fixed = contiguous_index_inputs(module.activations[-1] if module.activations else [])
        if fixed is not None:
            module.activations[-1] = fixed

    def record_before_forward(self, module: nn.Module, forward_input: Any) -> None:
        """Forward pre-hook inside a backward (a checkpoint's recomputation) of a layer whose
        forward hook needs only its inputs
        (:class:`~opacus_rc.grad_sample.checkpointing.RecordBeforeForward`): records them now,
        as :meth:`forward_hook` would after the forward (through the owner's forward hook, e.g.
        FSDP2's on the sharded parameters), so that the recomputation may stop early inside the
        layer; the forward hook of this call then does nothing.
        """
        key = id(module)
        self._recorded_before_forward.discard(key)  # left by a recomputation that stopped
        self._owner.capture_activations_hook(module, forward_input, None)
        self._recorded_before_forward.add(key)

    def _on_forward(self) -> None:
        """A hooked forward pass records activations: a new step starts if the last ended
        (its stale norms and book-keeping tensors dropped)."""
        self._ready = None
        if self.phase is StepPhase.RECORDED:
            return
        # Once per step, at its first hooked forward: a parameter unfrozen, replaced or tied
        # since make_private raises here, before Opacus' counters trip over it.
        self.trainable.check()
        self.tied.clear()
        self._clear_records()
        self.per_sample_gradient_norms = None
        self.last_norm_samples = {}
        self._clipped = frozenset()
        self.units, self._units_given = None, False
        self.checkpointed = False
        self.smaller_stash = False
        self._recorded_before_forward.clear()
        self.phase = StepPhase.RECORDED

    def _record_first_pass_inputs(
        self, module: nn.Module, forward_input: Any, forward_output: Any = None
    ) -> None:
        """Book-keeping: remember where the first backward pass must reach for ``module``.

        For an input that requires a gradient, the graph edge just below the hook node that
        ``register_full_backward_hook`` put on it; for a module whose inputs carry none, its
        trainable parameters themselves, or, if ``forward_output`` is given (the embedding of
        a tied group; FSDP2), the edge of that output: the shared weight's first-pass gradient
        would include the head's ``G^T A``, which the clipped sum or the second pass replaces.
        """
        found = False
        for t in forward_input if isinstance(forward_input, (tuple, list)) else (forward_input,):
            fn = getattr(t, "grad_fn", None)
            if isinstance(t, torch.Tensor) and t.requires_grad and fn is not None:
                if fn.name() != "BackwardHookFunctionBackward":
                    continue
                node, output_nr = fn.next_functions[t.output_nr]
                if node is not None:
                    self._first_pass_inputs.append(GradientEdge(node, output_nr))
                    found = True
        if not found and isinstance(forward_output, torch.Tensor) and forward_output.requires_grad:
            self._first_pass_inputs.append(get_gradient_edge(forward_output))
            found = True
        if not found:
            self._first_pass_inputs.extend(p for _, p in trainable_parameters(module))

    def backward_hook(
        self,
        module: nn.Module,
        _forward_input: Any,
        forward_output: Any,
        loss_reduction: str,
        batch_first: bool,
    ) -> None:
        """Backward hook: the module's per-sample norms, by the path its route names (per unit
        with ``units=``); an empty batch is answered directly. An error fails the step
        (:meth:`abort`): inside a backward, gradients may already hold unclipped parts."""
        owner = self._owner
        if not owner.hooks_enabled:
            return
        activations = getattr(module, "activations", None)
        trainable = []
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                trainable.append(p)
        params = tuple(trainable)
        if not params and not activations:
            return  # every parameter frozen since make_private: no gradient, no norm needed
        try:
            if not activations:
                raise _no_activations_error(self.name_of(module), module)
            layout = _OWN_LAYOUT.get(type(module))
            batch_first = batch_first if layout is None else layout(module)
            backprops = forward_output[0]
            batch_dim = 0 if batch_first else 1
            empty = backprops.dim() > batch_dim and backprops.shape[batch_dim] == 0
            if not empty and type(module) not in self.adapters:
                # (an embedding bag's ids may be empty in a non-empty batch: its output tells)
                for t in activations[-1]:
                    if isinstance(t, torch.Tensor) and t.dim() > batch_dim:
                        empty = empty or t.shape[batch_dim] == 0
            if empty:
                # Empty Poisson batch: no sample, no norm. Opacus' samplers (e.g. the Embedding
                # ghost norm) fail on B = 0, so answer directly; the step is still noised.
                activations.pop()
                for p in params:
                    count_down_use(p)
                self.record_norms(
                    {p: torch.zeros(0, device=p.device, dtype=torch.float32) for p in params}
                )
                return
            units = self.units
            # Opacus' rescale to per-sample losses (x max_batch_len under "mean") would copy
            # the output gradient; the factor goes to the norms and the clip factors instead
            # (ModuleNorms.compute's backprop_scale: both are linear in G). Units rescale from
            # Opacus' scaling (pack_for_units): Opacus' call as it is.
            rescale = loss_reduction == "mean" and units is None
            acts, backprops = owner.rearrange_grad_samples(
                module=module,
                backprops=backprops.detach(),
                loss_reduction="sum" if rescale else loss_reduction,
                batch_first=batch_first,
            )
            if getattr(units, "packed_rows", False) and units.record_norms(
                self, module, self.routes[id(module)], params, acts, backprops, loss_reduction
            ):  # record_ids= (opacus_rc/packed_loss.py): an nn.Linear from the packed rows
                return
            backprop_scale = module.max_batch_len if rescale else 1
            if units is not None:  # units= (docs/privacy/units.md): per unit
                acts, backprops = pack_for_units(
                    units, module, acts, backprops, loss_reduction=loss_reduction
                )
            self.norms.compute(
                module,
                self.routes[id(module)],
                params,
                acts,
                backprops,
                step=self,
                bookkeeping=self.bookkeeping,
                # Every layer keeps the smaller stash wherever book-keeping is True: with or
                # without checkpointing, the estimate is the same from either (norms.py).
                smaller_stash=self.bookkeeping and self.config.bookkeeping is True,
                backprop_scale=backprop_scale,
            )
        except BaseException:
            self.abort()
            raise
        if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
            del module.max_batch_len

    def record_gradient(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ``param`` got a gradient in a hooked backward."""
        if self._owner.hooks_enabled:
            self._grad_seen[id(param)] = param

    def _drop_after_hook_error(self) -> None:
        """A forward hook is about to raise: inside a backward (the recomputed forward of a
        checkpointed region) gradients may already have been accumulated, so the step fails
        (:meth:`abort`); in a forward nothing reached a gradient yet (:meth:`reset`)."""
        if in_backward():
            self.abort()
        else:
            self.reset()

    # ------------------------------------------------------------------------------------------
    # What the hooks record (also called by ModuleNorms)
    # ------------------------------------------------------------------------------------------

    def record_norms(self, norms: dict[nn.Parameter, torch.Tensor]) -> None:
        """Store per-sample norms ``{param: (R,) tensor}`` computed by a backward hook.

        Each parameter gets its norm once per step: a module whose uses are summed records it
        at its last use, a tied weight at its second module. A second record means the module
        ran more than once where no forward-time check could see it (once in each of two
        activation-checkpointed segments), and the later norm would silently replace the norm
        of the summed gradient.

        Raises:
            NotImplementedError: If a parameter of ``norms`` already has a norm in this step
                (the backward hook then fails the step).
        """
        for p in norms:
            if p in self._norms:
                names = [self.name_of(q) for q in norms if q in self._norms][:5]
                raise NotImplementedError(
                    f"the per-sample norm of {names} was computed twice in one step: its module "
                    "ran more than once before the backward pass, e.g. once in each of two "
                    "activation-checkpointed segments (torch.utils.checkpoint), where the "
                    "recomputed forwards each look like a single use, so the uses cannot be "
                    "combined. Use separate modules, or put every use of a shared module in one "
                    "checkpointed segment or outside checkpointing (there a sketched module "
                    "used twice is refused at the forward pass, and an exactly normed one has "
                    "its per-sample gradients summed over its uses)."
                )
        self._norms.update(norms)
        self.phase = StepPhase.NORMED

    def stash(self, stash: BookkeepingStash) -> None:
        """Keep a module's book-keeping tensors until the clip factors exist (merged per module)."""
        old = self._stashes.get(id(stash.module))
        if old is not None and old.grad_samples is not None and stash.grad_samples is not None:
            merged = {**old.grad_samples, **stash.grad_samples}
            stash = BookkeepingStash(
                stash.module, tuple(merged), grad_samples=merged, scale=stash.scale
            )
        self._stashes[id(stash.module)] = stash

    def stashed(self, module: nn.Module) -> BookkeepingStash | None:
        """The stash of ``module`` in this step, if any."""
        return self._stashes.get(id(module))

    @property
    def has_stashes(self) -> bool:
        """Whether book-keeping tensors of this step are held (recorded or handed over)."""
        return bool(self._stashes) or self._ready is not None

    def set_units(self, layout: Any) -> None:
        """The criterion of this step was called with ``units=`` (a layout) or without (None).

        Raises:
            ValueError: If an earlier criterion call of the same step disagreed (one loss with
                ``units=``, another without or with other units): the losses could not be
                combined per unit.
        """
        old = self.units
        if self._units_given and not (
            (old is None and layout is None)
            or (old is not None and layout is not None and old.same_as(layout))
        ):
            raise ValueError(
                "the criterion was called twice in one step with different units= (or once "
                "with and once without): every loss of a step must be per unit with the same "
                "units tensor, or none of them"
            )
        self.units, self._units_given = layout, True

    @property
    def norm_samples(self) -> dict[nn.Parameter, torch.Tensor]:
        """``{parameter: (R,) norm}``: this step's so far, else those of the last clip factors."""
        return dict(self._norms) if self._norms else dict(self.last_norm_samples)

    def norm_sample(self) -> torch.Tensor:
        """Per-sample (per-unit) whole-model norm estimates (issues nothing): after a backward,
        those the step's clip factors will be made from; after the clip factors, those they
        were made from, until the next hooked forward pass. Not privatized.

        Returns:
            ``(R,)`` float64.

        Raises:
            RuntimeError: No norms were computed since the last step.
        """
        if self.phase is StepPhase.NORMED and self._norms:
            return self._combine()[0]
        if self.per_sample_gradient_norms is not None:
            return self.per_sample_gradient_norms
        raise RuntimeError(
            "no per-sample norms for this step: run a forward pass in training mode with "
            "gradients enabled, then backward"
        )

    def _combine(self) -> tuple[torch.Tensor, torch.dtype]:
        """``(n_hat, clip-factor dtype)``: the norms combined over parameters, in float64."""
        dtype, device, parts = torch.float32, None, []
        for p in self.params:  # a fixed order: the same sum on every call
            t = self._norms.get(p)
            if t is not None:
                if t.dtype == torch.float64:
                    dtype = torch.float64
                device = t.device if device is None else device
                parts.append(t.reshape(-1).to(device, torch.float64))
        return torch.stack(parts).norm(2, dim=0), dtype

    # ------------------------------------------------------------------------------------------
    # The private backward
    # ------------------------------------------------------------------------------------------

    def backward(
        self,
        losses: torch.Tensor,
        *,
        reduced_loss: torch.Tensor,
        max_grad_norm: float,
        agree_ranks: bool = True,
        refused: Exception | None = None,
    ) -> ClipResult:
        """Run the whole private backward of this step (first pass, clip factors, rank
        agreement, clipped sum or second pass) and say how its gradient was clipped.

        Args:
            losses: ``(R,)`` per-sample (or per-unit) losses of this step's forward.
            reduced_loss: Their mean or sum (the loss's ``loss_reduction``), backpropagated by
                the first pass.
            max_grad_norm: ``C`` (the optimizer's, handed over by the DP loss).
            agree_ranks: Whether the ranks of a distributed model agree on success after the
                first pass (one all-reduce of a flag). False inside a logical step split by
                ``BatchMemoryManager`` (the ranks' physical batches do not line up): a failure
                then raises on its own rank only.
            refused: An error the caller found in its own arguments (the DP loss's
                ``backward()`` arguments), raised where every other error of the backward is:
                before anything is backpropagated, so that the step fails on every rank.

        Returns:
            The step's :class:`ClipResult`; ``p.grad`` holds the clipped gradient sum.

        Raises:
            ValueError: Losses not of shape ``(R,)``, or not one clip factor per loss.
            Exception: ``refused``, or any error of the checks, hooks or clip factors; a
                ``RuntimeError`` if another rank failed. The step is then failed: no gradient
                is kept and every stored tensor is dropped (:meth:`abort`).
        """
        bookkeeping = self.bookkeeping
        try:
            error: Exception | None = None
            coef = None
            try:
                if refused is not None:
                    raise refused
                if losses.dim() != 1:
                    raise _one_loss_per_record_error(losses)
                self.trainable.check()
                full_first_pass = self.uses.check(reduced_loss)
                # Checkpointed: each layer keeps the smaller of its per-sample gradients and
                # its input and output gradient (norms.py), unless bookkeeping="always".
                self.smaller_stash = (
                    bookkeeping
                    and (self.checkpointed or full_first_pass)
                    and self.config.bookkeeping is True
                )
                if self.smaller_stash and not self._told_checkpointing:
                    self._told_checkpointing = True
                    logger.info(
                        "activation checkpointing: one backward pass; each layer keeps the "
                        "smaller of its per-sample gradients and its input and output gradient "
                        "for the clipped sum (a sketched norm is the same sketch from either); "
                        "bookkeeping='always' keeps the inputs everywhere, bookkeeping=False "
                        "takes two passes"
                    )
                # The first pass stops at the hooked modules' inputs (Bu et al. 2023, section
                # 3): no dL/dW is computed that the clipped sum or the second pass replaces.
                # Through a reentrant checkpoint region PyTorch allows no ``inputs``, and a DDP
                # reducer turned back on expects every parameter's gradient: all leaves then.
                edges, self._first_pass_inputs = self._first_pass_inputs, []
                reducer = False
                for ddp in self.ddp_modules:
                    reducer = reducer or ddp.require_backward_grad_sync
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=_OUTPUT_HOOK_WARNING)
                    torch.autograd.backward(
                        reduced_loss,
                        inputs=None if full_first_pass or reducer or not edges else edges,
                        retain_graph=not bookkeeping,
                    )
                for p in self.params:  # the first pass's (unclipped) gradients
                    p.grad = None
                coef = self.issue_clip_factors(max_grad_norm=max_grad_norm)
                if coef.shape != losses.shape:
                    raise _one_factor_per_loss_error(coef, losses)
            except Exception as err:  # noqa: BLE001 - re-raised below, after the ranks agree
                error = err
            # Distributed: every rank learns whether any rank failed, so that all raise
            # together instead of the healthy ranks waiting forever in a later all-reduce.
            if agree_ranks and self.distributed and not self._all_ranks_ok(error is None):
                error = error or RuntimeError(
                    "the randomized-clipping backward failed on another rank; no rank takes "
                    "this step"
                )
            if error is not None:
                raise error
            assert coef is not None
            if bookkeeping:  # the clipped sum from the stored tensors (consumed)
                ready, self._ready = self._ready, None
                assert ready is not None
                try:
                    self._write_clipped_sums(ready, coef)
                finally:
                    ready.clear()
                self.phase = StepPhase.APPLIED
            else:
                second_loss = torch.sum(apply_clip_factors(coef, losses))
                self._owner.disable_hooks()
                try:
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message=_OUTPUT_HOOK_WARNING)
                        second_loss.backward()
                finally:
                    self._owner.enable_hooks()
                self.phase = StepPhase.APPLIED
        except BaseException:
            # No unclipped (first-pass) or partial gradient may reach optimizer.step().
            self.abort()
            raise
        open_unit = self.open_unit
        norms = self.per_sample_gradient_norms
        assert norms is not None
        return ClipResult(
            clip_factors=coef,
            per_sample_norms=norms,
            num_records=coef.numel(),
            per_unit=self.units is not None,
            sketch_spec=self.config.sketch_spec,
            bookkeeping=bookkeeping,
            max_grad_norm=max_grad_norm,
            clipped=self._clipped,
            open_unit=open_unit if open_unit is not None and open_unit.is_open else None,
        )

    def empty_batch(
        self, *, agree_ranks: bool = True, max_grad_norm: float | None = None
    ) -> ClipResult:
        """The private step of an empty batch run without a forward pass (a model that cannot
        take ``B = 0``): no record, a zero clipped sum. Any ``.grad`` is dropped; in a
        distributed model this rank takes part in the agreement the other ranks' backward
        issues.

        Args:
            agree_ranks: As :meth:`backward`.
            max_grad_norm: ``C`` of the step (the optimizer's); None: the configured one.

        Returns:
            A :class:`ClipResult` with no record (:func:`empty_clip_result`).

        Raises:
            StepProtocolError: If a forward recorded something in this step (the batch was not
                empty, or its forward must be replaced, not run).
            RuntimeError: Another rank's backward failed.
        """
        if self.phase in (StepPhase.RECORDED, StepPhase.NORMED):
            raise StepProtocolError(
                f"an empty-batch step was requested in phase {self.phase.value!r}: it must "
                "replace the batch's forward and backward (do not run the model on the batch)"
            )
        self._drop_gradients()
        if agree_ranks and self.distributed and not self._all_ranks_ok(True):
            raise RuntimeError(
                "the randomized-clipping backward failed on another rank; no rank takes this step"
            )
        return empty_clip_result(
            sketch_spec=self.config.sketch_spec,
            max_grad_norm=self.config.max_grad_norm if max_grad_norm is None else max_grad_norm,
            bookkeeping=self.bookkeeping,
        )

    def _all_ranks_ok(self, ok: bool) -> bool:
        """Whether every rank reports ``ok``: a one-element all-reduce every rank reaches."""
        device = self.params[0].device if self.params else torch.device("cpu")
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) == 0

    def _drop_gradients(self) -> None:
        """Drop every trainable parameter's ``.grad`` (first-pass or failed gradients)."""
        for p in self.params:
            p.grad = None

    def issue_clip_factors(self, *, max_grad_norm: float) -> torch.Tensor:
        """Combine this step's norms and issue the clip factors ``min(1, C / (n_hat + 1e-6))``
        (:func:`~opacus_rc.grad_sample.clip.clip_factors`), once per step.

        ``n_hat_i = sqrt(sum_params norm_{i,param}^2)``
        (docs/privacy/estimators.md#estimators-hutchinson, several layers), in float64. One host
        synchronisation: the finiteness decision over all samples. In secure mode the sketch
        generators are reseeded afterwards.

        Args:
            max_grad_norm: ``C``.

        Returns:
            ``(R,)`` clip factors, float32 (float64 if any norm was float64).

        Raises:
            StepProtocolError: No backward ran since the last step (no norms).
            RuntimeError: A parameter received a gradient without a norm, a tied weight's
                sketch is incomplete, or (book-keeping) a normed parameter has no stored
                tensors for its clipped sum.
            ValueError: Norms of different batch sizes (a batch-broadcast input).
            FloatingPointError: A NaN or inf norm estimate.
            Every error drops what the step recorded (nothing half-done is kept).
        """
        try:
            if self.phase is not StepPhase.NORMED or not self._norms:
                raise StepProtocolError(
                    "no per-sample norms for this step: run a forward pass in training mode "
                    "with gradients enabled, then the criterion's backward(). (A step's norms "
                    "are consumed by get_clipping_coef(); read per_sample_gradient_norms "
                    "afterwards, until the next forward.)"
                )
            if self._has_tied:
                self.tied.check_complete()  # never a partial norm of a tied weight
            norms = self._norms
            unmeasured = []
            for p in self._grad_seen.values():
                if p not in norms:
                    unmeasured.append(p)
            if unmeasured:
                unmeasured = [self.name_of(p) for p in unmeasured]
                raise RuntimeError(
                    f"parameters {unmeasured[:5]} received a gradient but no per-sample norm "
                    "was computed for them (used outside their module's forward, e.g. tied "
                    "through F.linear, or their module is in eval mode); they would not be "
                    "clipped"
                )
            counts = set()
            for t in norms.values():
                counts.add(t.numel())
            if len(counts) > 1:
                sizes = {self.name_of(p): t.numel() for p, t in norms.items()}
                batch = max(sizes.values())
                odd = {n: b for n, b in sizes.items() if b != batch}
                raise ValueError(
                    f"per-sample norms disagree on the batch size: the batch has {batch} "
                    f"samples but {odd}. A module whose input is broadcast across the batch "
                    "(e.g. a position Embedding fed Hugging Face position_ids of shape [1, T], "
                    "Opacus issue 841) only sees the gradient summed over samples, so its "
                    "per-sample norms cannot be computed. Expand the input to the batch size "
                    "(position_ids.expand(B, -1)) or freeze that module."
                )
            norm, coef_dtype = self._combine()
            bad = ~torch.isfinite(norm)
            if bool(bad.any()):  # the step's one host synchronisation in the backward
                what = "per-sample" if self.units is None else "per-unit"
                raise FloatingPointError(
                    f"{int(bad.sum())} of {norm.numel()} {what} gradient norm estimates are "
                    "NaN or inf; no clip factor was produced and this step must not be taken. "
                    "Check the loss and the inputs for NaN/inf (a loss divided by zero, e.g. "
                    "by an expected batch size of 0, included), the parameters (NaN/inf after "
                    "an earlier step), or lower the learning rate."
                )
            ready = list(self._stashes.values())
            clipped = set()
            for p in norms:
                clipped.add(id(p))
            if self.bookkeeping and norm.numel() > 0:
                lacking = set(clipped)
                for s in ready:
                    for p in s.params:
                        lacking.discard(id(p))
                if lacking:
                    lacking = [self.name_of(p) for p in norms if id(p) in lacking]
                    raise RuntimeError(
                        f"book-keeping: parameters {lacking[:5]} have a per-sample norm but no "
                        "stored tensors for their clipped gradient sum; this step cannot be "
                        "clipped"
                    )
        except BaseException:
            self.reset()
            raise
        finally:
            if self.config.secure_mode:
                self.generators.reseed()
        coef = clip_factors(norm, max_grad_norm=max_grad_norm)
        self._max_grad_norm = max_grad_norm
        self.per_sample_gradient_norms = norm
        self.last_norm_samples = norms
        self._clipped = frozenset(clipped)
        self._ready = ready if self.bookkeeping else None
        self._norms, self._grad_seen, self._stashes, self._first_pass_inputs = {}, {}, {}, []
        self.phase = StepPhase.FACTORS_ISSUED
        return coef.to(coef_dtype)

    def apply_clipped_sum(self, coef: torch.Tensor) -> None:
        """Write the clipped gradient sum into ``p.grad`` (book-keeping; no second backward).

        Adds ``sum_i coef_i * grad_p loss_i`` to ``p.grad`` for every parameter reached by this
        step's backward pass: what a second backward pass of ``sum_i coef_i loss_i``
        accumulates. The stored tensors are consumed. No random number is drawn.

        Args:
            coef: The clip factors of this step, shape ``(R,)``.

        Raises:
            RuntimeError: If book-keeping is off.
            StepProtocolError: No stash was handed over by this step's clip factors, or it
                was used already.
            ValueError: If a clipped sum has the wrong shape or misses a parameter.
        """
        if not self.bookkeeping:
            raise RuntimeError(
                "apply_clipped_sum() needs book-keeping mode (module.bookkeeping is False): "
                "run the second backward pass of sum_i c_i loss_i instead"
            )
        if self.phase is not StepPhase.FACTORS_ISSUED or self._ready is None:
            raise StepProtocolError(
                "apply_clipped_sum(): no stored tensors for this step; call it once, right "
                "after the backward pass and get_clipping_coef() of the same step"
            )
        ready, self._ready = self._ready, None
        try:
            self._write_clipped_sums(ready, coef)
        finally:
            ready.clear()
        self.phase = StepPhase.APPLIED

    def _write_clipped_sums(self, ready: list[BookkeepingStash], coef: torch.Tensor) -> None:
        """``p.grad += sum_i coef_i grad_p loss_i`` from the stashes (FSDP2: reduce-scattered)."""
        layout = self.units
        if layout is not None and layout.split is not None:
            # A unit cut across physical batches (docs/privacy/units.md#units-split).
            from opacus_rc.units.split import write_split_clipped_sums

            self.per_sample_gradient_norms = write_split_clipped_sums(
                self,
                ready,
                coef,
                layout,
                max_grad_norm=self._max_grad_norm,
                compute_clipped_sums=compute_clipped_sums,
                clip_factors=clip_factors,
                apply_clip_factors=apply_clip_factors,
            )
        elif getattr(layout, "packed_rows", False):  # record_ids= (opacus_rc/packed_loss.py)
            layout.write_clipped_sums(
                ready, coef, clipped_sums=self.clipped_sums, name_of=self.name_of
            )
        else:
            write_clipped_sums(ready, coef, clipped_sums=self.clipped_sums, name_of=self.name_of)

    # ------------------------------------------------------------------------------------------
    # Dropping a step
    # ------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop everything this step recorded: Opacus' activations and forward counters, the
        norms, stashes, first-pass inputs, forward spans, tied sketches and bound keyword
        arguments (issued clip factors' norms stay readable)."""
        for sub in self.model.modules():
            if hasattr(sub, "activations"):
                sub.activations = []
            if hasattr(sub, "max_batch_len"):
                del sub.max_batch_len
        self.inputs.clear()
        for p in self.params:
            reset_forward_counter(p)
            drop_current_grad_sample(p)
            p.grad_sample = None
        self.uses.clear()
        self.tied.clear()
        self._clear_records()
        self._ready = None
        if self.phase in (StepPhase.RECORDED, StepPhase.NORMED, StepPhase.FACTORS_ISSUED):
            self.phase = StepPhase.IDLE

    def abort(self) -> None:
        """The step failed: drop every gradient, every stored tensor and an open unit (it lost
        a part)."""
        self.reset()
        self._drop_gradients()
        if self.open_unit is not None:
            self.open_unit.drop()
        self._clipped = frozenset()
        self.phase = StepPhase.IDLE

    def _clear_records(self) -> None:
        self._norms = {}
        self._grad_seen = {}
        self._stashes = {}
        self._first_pass_inputs = []


# ----------------------------------------------------------------------------------------------
# Opacus' hook methods of the grad-sample module: one-line delegations to its step
# ----------------------------------------------------------------------------------------------


def capture_activations_hook(
    owner: Any, module: nn.Module, forward_input: Any, forward_output: Any
) -> None:
    """Opacus' forward hook of a randomized-clipping module (``owner``, a method of its
    class): :meth:`PrivateStep.forward_hook` of ``owner.private_step``."""
    owner.private_step.forward_hook(module, forward_input, forward_output)


def capture_backprops_hook(
    owner: Any,
    module: nn.Module,
    forward_input: Any,
    forward_output: Any,
    loss_reduction: str,
    batch_first: bool,
) -> None:
    """Opacus' backward hook of a randomized-clipping module (``owner``, a method of its
    class): :meth:`PrivateStep.backward_hook` of ``owner.private_step``."""
    owner.private_step.backward_hook(
        module, forward_input, forward_output, loss_reduction, batch_first
    )
