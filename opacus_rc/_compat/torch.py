"""PyTorch internals ``opacus_rc`` relies on (see :mod:`opacus_rc._compat` for the rule).

Checked against torch 2.13.0 (``setup.cfg`` pins ``torch>=2.13,<2.14``: the contract tests
have run on no other release; widen the pin only after ``tests/compat/`` passes on the release
added). The contract tests are in ``tests/compat/test_torch_contract.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "autograd_sequence_nr",
    "fsdp_unsharded_parameters",
    "in_backward",
    "non_reentrant_checkpoint_pack_hook_active",
    "registered_parameters",
    "registered_submodule",
    "tensor_version",
]

#: The ``__qualname__`` prefix of the pack hook that non-reentrant ``torch.utils.checkpoint``
#: installs: it is defined inside the private class ``torch.utils.checkpoint._checkpoint_hook``
#: (``_checkpoint_hook.__init__.<locals>.pack_hook``).
_CHECKPOINT_PACK_HOOK = "_checkpoint_hook."


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread now.

    Relies on ``torch._C._current_graph_task_id()``: ``-1`` outside a backward, the id of the
    running graph task inside one (also inside a forward recomputed by activation
    checkpointing). Test: ``test_torch_contract.py::test_in_backward``.
    """
    return torch._C._current_graph_task_id() != -1


def non_reentrant_checkpoint_pack_hook_active() -> bool:
    """Whether the innermost saved-tensor hooks now are those of a non-reentrant
    ``torch.utils.checkpoint`` region (its original forward, not the recomputation).

    Relies on ``torch._C._autograd._top_saved_tensors_default_hooks(False)`` (``None`` or the
    ``(pack, unpack)`` pair of the innermost ``saved_tensors_hooks`` context) and on the pack
    hook's ``__qualname__`` starting with ``_checkpoint_hook.``. Test:
    ``test_torch_contract.py::test_checkpoint_pack_hook_detected``.
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if not hooks:
        return False
    pack = hooks[0]
    return getattr(pack, "__qualname__", "").startswith(_CHECKPOINT_PACK_HOOK)


def autograd_sequence_nr(node: Any) -> int:
    """The sequence number of an autograd node (``grad_fn``): nodes created on a thread are
    numbered in creation order.

    Relies on ``torch.autograd.graph.Node._sequence_nr()``. Test:
    ``test_torch_contract.py::test_sequence_numbers_increase``.
    """
    return int(node._sequence_nr())


def tensor_version(t: torch.Tensor | None) -> int:
    """The version counter of a tensor (``-1`` for None): every in-place change (an autograd
    accumulation into ``p.grad`` included) increments it.

    Relies on ``torch.Tensor._version``. Test: ``test_torch_contract.py::test_tensor_version``.
    """
    return -1 if t is None else int(t._version)


def registered_parameters(module: nn.Module) -> dict[str, Any]:
    """The live dictionary of the parameters registered on ``module`` itself (not its
    children): writing an entry re-registers the parameter without ``register_parameter``'s
    checks, as FSDP2's ``unsafe_setattr_param`` does.

    Relies on ``nn.Module._parameters`` being that dictionary. Test:
    ``test_torch_contract.py::test_registered_parameters_is_live``.
    """
    return module._parameters


def registered_submodule(module: nn.Module, name: str) -> nn.Module | None:
    """The child registered on ``module`` as ``name``, or ``None``; never goes through
    ``module.__getattr__`` (safe to call from a ``__getattr__`` override).

    Relies on ``nn.Module._modules`` (in the instance ``__dict__``). Test:
    ``test_torch_contract.py::test_registered_submodule``.
    """
    modules = module.__dict__.get("_modules")
    if modules is None:
        return None
    return modules.get(name)


def fsdp_unsharded_parameters(model: nn.Module) -> dict[int, nn.Parameter]:
    """``{id(unsharded parameter): sharded parameter}`` for the FSDP2 parameters of ``model``
    that have been all-gathered at least once.

    Under ``fully_shard`` the leaves of the autograd graph are FSDP2's *unsharded* parameters
    (one ``nn.Parameter`` per sharded one, created at the first all-gather and kept, its
    storage freed and re-allocated), not the sharded DTensors registered outside forward and
    backward (the ones the optimizer holds). This maps the former to the latter.

    Relies on ``FSDPModule._get_fsdp_state()._fsdp_param_group.fsdp_params`` and each
    ``FSDPParam``'s ``_unsharded_param`` and ``sharded_param``. Test (2 processes):
    ``test_torch_contract.py::test_fsdp_unsharded_parameters``.
    """
    from torch.distributed.fsdp import FSDPModule

    out: dict[int, nn.Parameter] = {}
    for sub in model.modules():
        if not isinstance(sub, FSDPModule):
            continue
        group = sub._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            unsharded = fsdp_param.__dict__.get("_unsharded_param")
            if unsharded is not None:
                out[id(unsharded)] = fsdp_param.sharded_param
    return out
