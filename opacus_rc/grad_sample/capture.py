"""The hooks that record one step: forward inputs and per-sample norms
(docs/architecture.md#architecture-step, steps 1 and 3).

:class:`CaptureHooksMixin` holds the three hooks of the randomized-clipping grad-sample
classes, on top of Opacus' ghost-clipping hooks:

* the **forward hook** (:meth:`CaptureHooksMixin.capture_activations_hook`) stores a hooked
  module's inputs (bound by :class:`~opacus_rc.grad_sample.forward_inputs.ForwardInputBinder`),
  starts the step in the :class:`~opacus_rc.grad_sample.step.StepState`, remembers where the
  book-keeping first pass must reach, and refuses a second use of a norm-sampled module;
* the **backward hook** (:meth:`CaptureHooksMixin.capture_backprops_hook`) computes the module's
  per-sample norms along its route (:class:`~opacus_rc.grad_sample.norms.ModuleNorms`), per unit
  with ``units=``, and answers an empty batch directly;
* the **post-accumulate-grad hook** records which parameters received a gradient, so that the
  clip factors are refused if one of them has no norm.

Under activation checkpointing the inputs are stored by the recomputation inside the backward,
not by the original forward (:mod:`~opacus_rc.grad_sample.checkpointing`).
"""

from __future__ import annotations

from typing import Any

import torch
from opacus.grad_sample.grad_sample_module import GradSampleHooks
from opacus.utils.module_utils import trainable_parameters
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from opacus_rc._compat.opacus import SequenceBias, count_down_use, forward_count
from opacus_rc.grad_sample.checkpointing import in_backward, in_checkpointed_forward
from opacus_rc.grad_sample.forward_inputs import check_single_output, contiguous_index_inputs
from opacus_rc.grad_sample.routing import NormPath
from opacus_rc.grad_sample.step import StepPhase
from opacus_rc.units.layout import pack_for_units

__all__ = ["NORM_SAMPLED_PATHS", "CaptureHooksMixin"]

#: Paths whose norm comes from a per-module norm sampler (no tied weights, one use per step).
NORM_SAMPLED_PATHS = (NormPath.SKETCHED, NormPath.EXACT, NormPath.GHOST)

#: Exact module type -> whether a module's own tensors are batch first, where that is its own
#: attribute rather than the model's ``batch_first``: inside Opacus' ``DPMultiheadAttention``
#: the ``SequenceBias`` layers (``add_bias_kv=True``) always see ``(L, B, E)`` keys and values,
#: whatever the model's layout (with the model's ``batch_first=True`` the batch was read from the
#: sequence axis, and the backward hook failed with a shape error for every step).
_OWN_LAYOUT: dict[type[nn.Module], Any] = {SequenceBias: lambda m: bool(m.batch_first)}


class CaptureHooksMixin:
    """The recording hooks of the randomized-clipping grad-sample classes (see the module
    docstring); a base of their shared mixin, which provides the attributes used here, and
    placed before an Opacus ``...FastGradientClipping`` class, whose hooks it extends."""

    def _record_gradient(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ``param`` got a gradient in the private backward."""
        if self.hooks_enabled and self._step is not None:  # type: ignore[attr-defined]
            self._step.record_gradient(param)

    def _reuse_error(self, module: nn.Module) -> NotImplementedError:
        return NotImplementedError(
            f"module '{self._name_of(module)}' ({type(module).__name__}) ran more than once "
            "before a backward pass (a module reused within one forward, or a training-mode "
            "forward that was never backpropagated). Randomized clipping needs one forward per "
            "module per step: use separate modules, or call backward after every forward in "
            "training mode (use torch.no_grad() or model.eval() for forwards you do not "
            "backpropagate)."
        )

    def capture_activations_hook(
        self,
        module: nn.Module,
        forward_input: list[torch.Tensor],
        _forward_output: torch.Tensor,
    ) -> None:
        """Forward hook: store inputs (Opacus) and reject a second use of a norm-sampled module.

        Under activation checkpointing the inputs are stored by the recomputation inside the
        backward, not by the original forward (:mod:`~opacus_rc.grad_sample.checkpointing`).
        """
        binder = self._inputs
        kwargs = None if binder is None else binder.take_call_kwargs(module)
        recording = (
            self.hooks_enabled  # type: ignore[attr-defined]
            and torch.is_grad_enabled()
            and module.training
            and self._step is not None
            and binder is not None
        )
        if recording and any(p.requires_grad for p in module.parameters(recurse=False)):
            try:
                stored_input = binder.bind(module, tuple(forward_input), kwargs)
                route = self._routes.get(id(module))
                if route is not None and route.path is NormPath.FUNCTORCH:
                    check_single_output(module, _forward_output, name=self._name_of(module))
            except BaseException:
                self._drop_after_hook_error()
                raise
        else:
            stored_input = list(forward_input)
        recomputing = recording and in_backward()
        route = self._routes.get(id(module))
        tied = route is not None and route.path is NormPath.TIED
        if recording and not recomputing:
            if self._step.phase in (StepPhase.IDLE, StepPhase.NORMED):
                # Once per step, at its first hooked forward: a parameter unfrozen, replaced or
                # tied since make_private raises here, before Opacus' counters trip over it.
                self._trainable.check()
                if self._tied is not None:
                    self._tied.clear()
            self._step.on_forward()
            output_edge = tied or self._first_pass_output_edges
            self._record_first_pass_inputs(
                module, forward_input, _forward_output if output_edge else None
            )
            if in_checkpointed_forward():
                self._step.mark_checkpointed()
                return  # the recomputation inside the backward records the inputs
        try:
            if tied:
                # Both modules of a tied group count the shared weight's _forward_counter, which
                # Opacus' ghost hook refuses at 2: record with the plain hook, and check each
                # module's own uses below.
                GradSampleHooks.capture_activations_hook(
                    self, module, stored_input, _forward_output
                )
            else:
                super().capture_activations_hook(module, stored_input, _forward_output)  # type: ignore[misc]
        except NotImplementedError as err:
            self._drop_after_hook_error()
            raise self._reuse_error(module) from err
        except AttributeError:
            self._drop_after_hook_error()
            self._trainable.check()  # a parameter Opacus never saw: the clear error
            raise
        if not recording or not hasattr(module, "activations"):
            return
        if (tied and len(module.activations) > 1) or (
            route is not None
            and route.path in NORM_SAMPLED_PATHS
            and any(forward_count(p) > 1 for _, p in trainable_parameters(module))
        ):
            self._drop_after_hook_error()
            raise self._reuse_error(module)
        # Index inputs expanded over the batch (position_ids.expand(B, -1)) made contiguous.
        fixed = contiguous_index_inputs(module.activations[-1] if module.activations else [])
        if fixed is not None:
            module.activations[-1] = fixed

    def _record_first_pass_inputs(
        self, module: nn.Module, forward_input: Any, forward_output: Any = None
    ) -> None:
        """Book-keeping: remember where the first backward pass must reach for ``module``.

        For an input that requires a gradient, the graph edge just below the hook node that
        ``register_full_backward_hook`` put on it; for a module whose inputs carry none, its
        trainable parameters themselves, or, if ``forward_output`` is given (the embedding of
        a tied group), the edge of that output: the shared weight's first-pass gradient would
        include the head's ``G^T A`` (``2 B T V d`` FLOPs), which the clipped sum or the second
        pass replaces. See :meth:`take_first_pass_inputs`.
        """
        found = False
        for t in forward_input if isinstance(forward_input, (tuple, list)) else (forward_input,):
            fn = getattr(t, "grad_fn", None)
            if isinstance(t, torch.Tensor) and t.requires_grad and fn is not None:
                if fn.name() != "BackwardHookFunctionBackward":
                    continue
                node, output_nr = fn.next_functions[t.output_nr]
                if node is not None:
                    self.step_state.add_first_pass_input(GradientEdge(node, output_nr))
                    found = True
        if not found and isinstance(forward_output, torch.Tensor) and forward_output.requires_grad:
            self.step_state.add_first_pass_input(get_gradient_edge(forward_output))
            found = True
        if not found:
            for _, p in trainable_parameters(module):
                self.step_state.add_first_pass_input(p)

    def capture_backprops_hook(
        self,
        module: nn.Module,
        _forward_input: torch.Tensor,
        forward_output: torch.Tensor,
        loss_reduction: str,
        batch_first: bool,
    ) -> None:
        """Backward hook: the module's per-sample norms, by the path its route names."""
        if not self.hooks_enabled:  # type: ignore[attr-defined]
            return
        params = tuple(p for _, p in trainable_parameters(module))
        if not params and not getattr(module, "activations", None):
            return  # every parameter frozen since make_private: no gradient, no norm needed
        if not getattr(module, "activations", None):
            self.abort_step()  # in a backward: gradients may already hold unclipped parts
            raise self._no_activations_error(module)
        layout = _OWN_LAYOUT.get(type(module))
        batch_first = batch_first if layout is None else layout(module)
        if self._is_empty_batch(module, forward_output[0], batch_first):
            # Empty Poisson batch: no sample, no norm. Opacus' samplers (e.g. the Embedding
            # ghost norm) fail on B = 0, so answer directly; the step is still noised.
            module.activations.pop()
            for p in params:
                count_down_use(p)
            self.step_state.record_norms(
                {p: torch.zeros(0, device=p.device, dtype=torch.float32) for p in params}
            )
            return
        route = self._routes[id(module)]
        activations, backprops = self.rearrange_grad_samples(  # type: ignore[attr-defined]
            module=module,
            backprops=forward_output[0].detach(),
            loss_reduction=loss_reduction,
            batch_first=batch_first,
        )
        if self.step_state.units is not None:  # units= (docs/privacy/units.md): per unit
            activations, backprops = pack_for_units(
                self.step_state.units, module, activations, backprops, loss_reduction=loss_reduction
            )
        self._norms.compute(
            module,
            route,
            params,
            activations,
            backprops,
            step=self.step_state,
            bookkeeping=self._bookkeeping,
            smaller_stash=self.step_state.smaller_stash,
        )
        if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
            del module.max_batch_len

    def _no_activations_error(self, module: nn.Module) -> RuntimeError:
        name = f"'{self._name_of(module)}' ({type(module).__name__})"
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

    def _is_empty_batch(
        self, module: nn.Module, backprops: torch.Tensor, batch_first: bool
    ) -> bool:
        """Whether the current backward belongs to an empty batch (``B = 0``). For a type with a
        forward-input adapter only the output gradient tells (an embedding bag's ids may be
        empty in a non-empty batch)."""
        batch_dim = 0 if batch_first else 1
        acts = module.activations[-1] if getattr(module, "activations", None) else []
        if type(module) in self.FORWARD_INPUT_ADAPTERS:
            acts = []
        tensors = [t for t in (*acts, backprops) if isinstance(t, torch.Tensor)]
        return any(t.dim() > batch_dim and t.shape[batch_dim] == 0 for t in tensors)
