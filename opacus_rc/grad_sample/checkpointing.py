"""Activation checkpointing under randomized clipping.

``torch.utils.checkpoint`` (and Hugging Face ``gradient_checkpointing_enable()``, which calls
it) runs a region's forward twice: once in the forward pass, keeping only the region's inputs,
and again inside the backward pass to rebuild what the backward needs. A recomputed forward is
not a reuse of the module: the per-sample norms must come from exactly one recording of its
inputs per step.

* **Non-reentrant** (``use_reentrant=False``, HF's default): the original forward runs with
  gradients enabled under the checkpoint's saved-tensor hooks, and its graph is the one the
  backward walks (so the modules' backward hooks fire from it). The grad-sample module records
  nothing there (:func:`in_checkpointed_forward`): keeping the inputs would undo the memory
  that checkpointing saves. The recomputation inside the backward (:func:`in_backward`) records
  them, once, just before the backward hooks of the region need them. Recomputation normally
  stops early, at the last tensor the original forward saved, which may be before the last
  module's forward hook; :class:`NoEarlyStop` turns that off in the forward of the model and of
  every module above a hooked one (PyTorch reads the setting when a region is created, inside
  some module's forward), so every hooked module of the region is recorded, also when the user
  calls a submodule directly (``model.body(x)`` then ``model.head(h)``, Opacus issue 582).
  Except where that cannot skip a recording (:class:`RecordBeforeForward`): a hooked
  ``nn.Linear`` or norm layer whose weight is trainable saves a tensor in its forward (its
  input, or the normalised input, for the weight's gradient), and its inputs are recorded by a
  forward *pre*-hook in the recomputation; when every hooked module is such a layer, each
  one's recording comes before its first saved tensor, hence before the region's last, and the
  recomputation keeps PyTorch's early stop. It then skips what follows the last saved tensor
  (in a Llama block the MLP's down projection, 2.7% of the step's FLOPs at T = 1024,
  ``benchmarks/step_overhead.py``), as the non-private step does.
* **Reentrant** (``use_reentrant=True``): the original forward runs under ``torch.no_grad()``
  (nothing is recorded: Opacus' hooks skip it), and the recomputation runs a nested backward in
  which the region's backward hooks fire. PyTorch refuses ``backward(inputs=...)`` through such
  a region, so book-keeping's first pass then backpropagates to every leaf
  (:func:`has_reentrant_checkpoint`): the weight gradients of the first pass are computed and
  discarded, which is the cost of book-keeping under reentrant checkpointing.

Either way the probes are drawn in the backward hooks only, fresh per step, sample and layer,
so the privacy analysis is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from opacus_rc._compat.torch import in_backward as _engine_in_backward
from opacus_rc._compat.torch import non_reentrant_checkpoint_pack_hook_active
from opacus_rc.grad_sample.norm_layers import TRANSFORMERS_RMS_NORMS
from opacus_rc.grad_sample.routing import NormPath

__all__ = [
    "REENTRANT_NODE",
    "NoEarlyStop",
    "RecordBeforeForward",
    "has_reentrant_checkpoint",
    "in_backward",
    "in_checkpointed_forward",
    "modules_above",
    "records_before_forward",
]

#: The autograd node of a reentrant checkpoint region.
REENTRANT_NODE = "CheckpointFunctionBackward"


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread now."""
    return _engine_in_backward()


def in_checkpointed_forward() -> bool:
    """Whether this is the original forward of a non-reentrant checkpoint region (not its
    recomputation inside the backward)."""
    if in_backward():
        return False
    return non_reentrant_checkpoint_pack_hook_active()


def has_reentrant_checkpoint(node: Any) -> bool:
    """Whether an autograd node is a reentrant checkpoint region.

    Args:
        node: An autograd graph node (``tensor.grad_fn`` or one of its ``next_functions``).
    """
    return node is not None and node.name() == REENTRANT_NODE


def modules_above(root: nn.Module, hooked: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules of ``root`` (``root`` included) with a hooked module strictly below them:
    with ``root``, where :class:`NoEarlyStop` turns early stopping off.

    Args:
        root: The model.
        hooked: Its hooked modules.

    Returns:
        The modules above a hooked one, children before parents (``root`` last).
    """
    hooked_ids = {id(h) for h in hooked}
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> bool:  # whether the subtree of ``module`` holds a hooked one
        below = False
        for child in module.children():
            below = visit(child) or below
        if below or module is root:
            out.append(module)
        return below or id(module) in hooked_ids

    visit(root)
    return out


class NoEarlyStop:
    """Forward pre/post hooks that turn off checkpoint early stopping inside given modules.

    ``torch.utils.checkpoint.set_checkpoint_early_stop(False)`` is entered before each given
    module's forward and left after it (also when the forward raises; the calls nest), so it
    only affects checkpoint regions created inside the forward of one of these modules. A region
    created outside every module's forward (``checkpoint(model.block, x)`` in the training loop)
    keeps PyTorch's early stop; the module whose forward hook it skips then raises the "inputs
    were not recorded" error of the grad-sample module, which says so.

    Args:
        modules: The modules (the root model and every module above a hooked one), or one.
        handles: The list the hook handles go into (removed with the other hooks).
        active: A callable telling whether the hooks are enabled.
    """

    def __init__(
        self, modules: nn.Module | list[nn.Module], handles: list[Any], *, active: Any
    ) -> None:
        self._active = active
        self._contexts: list[Any] = []
        for module in [modules] if isinstance(modules, nn.Module) else modules:
            handles.append(module.register_forward_pre_hook(self._enter))
            handles.append(module.register_forward_hook(self._exit, always_call=True))

    def _enter(self, module: nn.Module, _args: Any) -> None:
        ctx = None
        # Entered once, by the outermost module: the nested ones find it entered already.
        outer = any(c is not None for _, c in self._contexts)
        if not outer and self._active() and torch.is_grad_enabled():
            ctx = torch_checkpoint.set_checkpoint_early_stop(False)
            ctx.__enter__()
        self._contexts.append((module, ctx))

    def _exit(self, module: nn.Module, _args: Any, _output: Any) -> None:
        # Only this module's own entry: a forward that failed before this module's pre-hook
        # ran still calls this hook (always_call), and must not close an outer module's context.
        if not self._contexts or self._contexts[-1][0] is not module:
            return
        _, ctx = self._contexts.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)


#: Module types (exact) whose forward saves a tensor for the backward whenever their ``weight``
#: requires a gradient (``nn.Linear`` its input, the norm layers their normalised input,
#: ``nn.Embedding`` its ids, for the weight's gradient), and whose forward hook needs only their
#: inputs: see :class:`RecordBeforeForward`.
_SAVING_TYPES = (nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.Embedding)

#: Routes whose forward hook needs the module's output (the tied group's first-pass edge, the
#: functorch path's single-output check): recorded after the forward, as before.
_OUTPUT_ROUTES = (NormPath.TIED, NormPath.FUNCTORCH)


def records_before_forward(module: nn.Module, route: Any) -> bool:
    """Whether ``module``'s inputs may be recorded by a forward pre-hook in a recomputation
    (:class:`RecordBeforeForward`): an ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``,
    ``nn.RMSNorm`` or a transformers RMSNorm
    (:data:`~opacus_rc.grad_sample.norm_layers.TRANSFORMERS_RMS_NORMS`), by exact type (a
    subclass may have another forward), on a route whose forward hook needs no output (not
    tied, not functorch).

    Args:
        module: A hooked module.
        route: Its :class:`~opacus_rc.grad_sample.routing.NormRoute`, or None.

    Returns:
        True if it may be recorded before its forward.
    """
    cls = type(module)
    return (
        route is not None
        and route.path not in _OUTPUT_ROUTES
        and (cls in _SAVING_TYPES or (cls.__module__, cls.__name__) in TRANSFORMERS_RMS_NORMS)
    )


class RecordBeforeForward:
    """Forward pre-hooks that record a hooked layer's inputs in a checkpoint's recomputation,
    and the test that lets that recomputation stop early.

    Inside the backward (the recomputation of a non-reentrant checkpoint region) each module
    for which :func:`records_before_forward` holds gets its inputs recorded by
    ``record(module, args)`` before its forward runs (the grad-sample module's forward hook
    then skips it). When every hooked module is such a module and each one with a trainable
    parameter has a trainable ``weight`` (:meth:`allows_early_stop`), every hooked forward
    saves a tensor after its recording, so PyTorch's early stop (at the region's last saved
    tensor) comes after every recording, and :class:`NoEarlyStop` is not needed. Only the
    step's cost changes: the same input tensors are recorded (those the forward hook would
    see; these layers do not modify their inputs), and the same probes are drawn.

    Args:
        modules: The hooked modules.
        routes: ``{id(module): NormRoute}``.
        handles: The list the hook handles go into (removed with the other hooks).
        record: ``record(module, args)``, called by the pre-hook of an eligible module inside
            a backward.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        routes: Any,
        handles: list[Any],
        *,
        record: Any,
    ) -> None:
        self._record = record
        self._all_eligible = True
        # (weight, the module's other parameters) of each module, read at every forward.
        self._weights: list[tuple[Any, tuple[Any, ...]]] = []
        for module in modules:
            if records_before_forward(module, routes.get(id(module))):
                handles.append(module.register_forward_pre_hook(self._pre))
                weight = module.weight
                others = tuple(p for p in module.parameters(recurse=False) if p is not weight)
                self._weights.append((weight, others))
            else:
                self._all_eligible = False

    def _pre(self, module: nn.Module, args: Any) -> None:
        if in_backward():
            self._record(module, args)

    def allows_early_stop(self) -> bool:
        """Whether a recomputation may stop early: every hooked module records before its
        forward, and each with a trainable parameter has a trainable ``weight`` (a layer with
        only a trainable bias may save nothing). Read at each forward of the model, so a weight
        frozen since make_private counts."""
        if not self._all_eligible:
            return False
        for weight, others in self._weights:
            if not weight.requires_grad and any(p.requires_grad for p in others):
                return False
        return True
