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
  module's forward hook; :class:`NoEarlyStop` turns that off for the model's forward so every
  hooked module of the region is recorded.
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

from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

__all__ = ["NoEarlyStop", "has_reentrant_checkpoint", "in_backward", "in_checkpointed_forward"]

#: The ``__qualname__`` prefix of the pack hook that non-reentrant checkpointing installs.
_CHECKPOINT_PACK_HOOK = "_checkpoint_hook."
#: The autograd node of a reentrant checkpoint region.
_REENTRANT_NODE = "CheckpointFunctionBackward"


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread now."""
    return torch._C._current_graph_task_id() != -1


def in_checkpointed_forward() -> bool:
    """Whether this is the original forward of a non-reentrant checkpoint region (not its
    recomputation inside the backward)."""
    if in_backward():
        return False
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if not hooks:
        return False
    pack = hooks[0]
    return getattr(pack, "__qualname__", "").startswith(_CHECKPOINT_PACK_HOOK)


def has_reentrant_checkpoint(node: Any) -> bool:
    """Whether an autograd node is a reentrant checkpoint region.

    Args:
        node: An autograd graph node (``tensor.grad_fn`` or one of its ``next_functions``).
    """
    return node is not None and node.name() == _REENTRANT_NODE


class NoEarlyStop:
    """Forward pre/post hooks on the root model that turn off checkpoint early stopping.

    ``torch.utils.checkpoint.set_checkpoint_early_stop(False)`` is entered before the model's
    forward and left after it (also when the forward raises), so it only affects checkpoint
    regions created inside this model's forward.

    Args:
        model: The root module.
        handles: The list the hook handles go into (removed with the other hooks).
        active: A callable telling whether the hooks are enabled.
    """

    def __init__(self, model: nn.Module, handles: list[Any], *, active: Any) -> None:
        self._active = active
        self._contexts: list[Any] = []
        handles.append(model.register_forward_pre_hook(self._enter))
        handles.append(model.register_forward_hook(self._exit, always_call=True))

    def _enter(self, _module: nn.Module, _args: Any) -> None:
        ctx = None
        if self._active() and torch.is_grad_enabled():
            ctx = torch_checkpoint.set_checkpoint_early_stop(False)
            ctx.__enter__()
        self._contexts.append(ctx)

    def _exit(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        ctx = self._contexts.pop() if self._contexts else None
        if ctx is not None:
            ctx.__exit__(None, None, None)
