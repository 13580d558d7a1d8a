"""Opacus internals ``opacus_rc`` relies on (see :mod:`opacus_rc._compat` for the rule).

Checked against Opacus 1.6.0 (``setup.cfg`` pins ``opacus>=1.6,<1.7``: private names may
change in any minor release); the contract tests are in
``tests/compat/test_opacus_contract.py``. Every function names the internal it reads.
"""

from __future__ import annotations

from typing import Any

import opacus
import torch
from opacus.accountants import registry as _accountant_registry
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp import (
    GradSampleHooksFastGradientClippingFSDP,
)

# ``SequenceBias`` is public in Opacus but only importable from the layer's own module.
from opacus.layers.dp_multihead_attention import SequenceBias
from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed
from torch import nn
from torch.distributed.tensor import DTensor

from opacus_rc._compat.torch import registered_submodule

__all__ = [
    "PrivacyEngineSeams",
    "SequenceBias",
    "WRAPPED_MODULE_ATTR",
    "adjusted_noise_multiplier",
    "check_processed_flag",
    "count_down_use",
    "drop_current_grad_sample",
    "forward_count",
    "fsdp_base_type",
    "generate_noise",
    "last_step_skipped",
    "make_empty_batch",
    "mark_as_processed",
    "next_step_skipped",
    "registered_accountant",
    "reset_forward_counter",
    "wrapped_module",
    "wrapped_module_if_built",
]

# ---------------------------------------------------------------------------------------------
# Noise and the processed flags (opacus/optimizers/optimizer.py)
# ---------------------------------------------------------------------------------------------


def generate_noise(
    *,
    std: float,
    reference: torch.Tensor,
    generator: torch.Generator | None,
    secure_mode: bool,
) -> torch.Tensor:
    """``N(0, std^2)`` of ``reference``'s shape, dtype and device: Opacus' own noise draw.

    Relies on ``opacus.optimizers.optimizer._generate_noise(std, reference, generator,
    secure_mode)``: zeros for ``std == 0``; a DTensor ``reference`` gives noise of its
    global shape; ``secure_mode`` uses Opacus' defence against floating-point attacks
    (Holohan and Braghin 2021, arXiv:2107.10138, Section 5.1, ``n = 2``). Test:
    ``test_opacus_contract.py::test_generate_noise_distribution``.
    """
    if std == 0 or secure_mode or isinstance(reference, DTensor):
        return _generate_noise(
            std=std, reference=reference, generator=generator, secure_mode=secure_mode
        )
    # Opacus' own draw for this case (its last branch), without the zeros tensor it allocates
    # and fills first and only uses for std == 0 and secure mode: the same call, so the same
    # values from the same generator state.
    return torch.normal(
        mean=0,
        std=std,
        size=reference.shape,
        device=reference.device,
        generator=generator,
        dtype=reference.dtype,
    )


def check_processed_flag(obj: torch.Tensor | list[torch.Tensor]) -> None:
    """Raise Opacus' ``ValueError`` if ``obj`` was already used by an optimizer step.

    Relies on ``opacus.optimizers.optimizer._check_processed_flag``. Test:
    ``test_opacus_contract.py::test_processed_flag_round_trip``.
    """
    _check_processed_flag(obj)


def mark_as_processed(obj: torch.Tensor | list[torch.Tensor]) -> None:
    """Mark ``obj`` as used by an optimizer step (:func:`check_processed_flag` then raises).

    Relies on ``opacus.optimizers.optimizer._mark_as_processed``. Test:
    ``test_opacus_contract.py::test_processed_flag_round_trip``.
    """
    _mark_as_processed(obj)


# ---------------------------------------------------------------------------------------------
# Optimizer state (opacus/optimizers/optimizer.py, optimizer_fast_gradient_clipping.py)
# ---------------------------------------------------------------------------------------------


def adjusted_noise_multiplier(optimizer: Any) -> float | None:
    """The noise multiplier an Opacus optimizer adds noise with when it differs from
    ``noise_multiplier`` (adaptive clipping), else ``None``.

    Relies on the optional attribute ``_adjusted_noise_multiplier`` that
    ``DPOptimizerFastGradientClipping.add_noise`` reads (and so does
    ``opacus_rc.optimizers.RandomizedClipOptimizer.add_noise``). Test:
    ``test_opacus_contract.py::test_adjusted_noise_multiplier``.
    """
    return getattr(optimizer, "_adjusted_noise_multiplier", None)


def next_step_skipped(optimizer: Any) -> bool:
    """Whether the next ``optimizer.step()`` only accumulates (a physical batch inside a
    logical one, BatchMemoryManager), without consuming that decision.

    Relies on ``DPOptimizer._check_skip_next_step(pop_next=False)``. Test:
    ``test_opacus_contract.py::test_skip_queue``.
    """
    return bool(optimizer._check_skip_next_step(pop_next=False))


def last_step_skipped(optimizer: Any) -> bool:
    """Whether the last ``optimizer.step()`` only accumulated (no noise, no update).

    Relies on ``DPOptimizer._is_last_step_skipped``, set by ``pre_step``. Test:
    ``test_opacus_contract.py::test_skip_queue``.
    """
    return bool(optimizer._is_last_step_skipped)


# ---------------------------------------------------------------------------------------------
# The accountant registry (opacus/accountants/registry.py)
# ---------------------------------------------------------------------------------------------


def registered_accountant(mechanism: str) -> type | None:
    """The class Opacus' accountant registry holds for ``mechanism``, or ``None``.

    Relies on the module dictionary ``opacus.accountants.registry._ACCOUNTANTS`` (Opacus has
    no public lookup that does not build an instance). Test:
    ``test_opacus_contract.py::test_registry_holds_ours``.
    """
    return getattr(_accountant_registry, "_ACCOUNTANTS", {}).get(mechanism)


# ---------------------------------------------------------------------------------------------
# Grad-sample modules (opacus/grad_sample/gsm_base.py, grad_sample_module.py)
# ---------------------------------------------------------------------------------------------

#: The attribute (and child name) under which Opacus' ``AbstractGradSampleModule`` registers
#: the wrapped model (``self._module = m`` in ``gsm_base.py``).
WRAPPED_MODULE_ATTR = "_module"


def wrapped_module(grad_sample_module: nn.Module) -> nn.Module:
    """The model an Opacus grad-sample module (or hooks object) was built around.

    Relies on ``AbstractGradSampleModule._module``. Test:
    ``test_opacus_contract.py::test_wrapped_module``.
    """
    return grad_sample_module._module


def wrapped_module_if_built(grad_sample_module: Any) -> nn.Module | None:
    """:func:`wrapped_module`, or ``None`` for an object that has none (yet): safe inside a
    ``__getattr__`` override and on objects that are not grad-sample modules.

    Relies on ``AbstractGradSampleModule._module`` being a registered child (the wrapping
    classes) or a plain attribute (the hooks-only classes). Test:
    ``test_opacus_contract.py::test_wrapped_module``.
    """
    if isinstance(grad_sample_module, nn.Module):
        child = registered_submodule(grad_sample_module, WRAPPED_MODULE_ATTR)
        if child is not None:
            return child
    attrs = getattr(grad_sample_module, "__dict__", {})
    return attrs.get(WRAPPED_MODULE_ATTR)


def fsdp_base_type(module: nn.Module) -> type:
    """The module's own type, FSDP2's per-module subclass (``FSDPLinear``) unwrapped.

    Relies on ``GradSampleHooksFastGradientClippingFSDP._get_module_type`` (a method that does
    not use its instance). Test: ``test_opacus_contract.py::test_fsdp_base_type``.
    """
    get_type = GradSampleHooksFastGradientClippingFSDP._get_module_type
    return get_type(None, module)  # type: ignore[arg-type]


# Forward counters: Opacus' hooks set ``p._forward_counter = 0`` on every trainable parameter
# (gsm_base.py), add one per recorded forward (grad_sample_module.py, capture_activations_hook)
# and take one off per processed backward, promoting ``p._current_grad_sample`` to
# ``p.grad_sample`` when it reaches 0 (capture_backprops_hook).


def reset_forward_counter(p: nn.Parameter) -> None:
    """Set the number of recorded, unprocessed uses of ``p`` to 0.

    Relies on ``p._forward_counter``. Test: ``test_opacus_contract.py::test_forward_counter``.
    """
    p._forward_counter = 0


def forward_count(p: nn.Parameter) -> int:
    """The number of forward uses of ``p`` recorded and not yet processed by a backward hook.

    Relies on ``p._forward_counter``. Test: ``test_opacus_contract.py::test_forward_counter``.
    """
    return int(p._forward_counter)


def count_down_use(p: nn.Parameter) -> int:
    """Mark one recorded use of ``p`` processed; returns the uses left (0: the last one).

    Relies on ``p._forward_counter``. Test: ``test_opacus_contract.py::test_forward_counter``.
    """
    p._forward_counter -= 1
    return int(p._forward_counter)


def drop_current_grad_sample(p: nn.Parameter) -> None:
    """Drop the per-sample gradient Opacus is accumulating over ``p``'s uses, if any.

    Relies on ``p._current_grad_sample`` (``create_or_accumulate_grad_sample``). Test:
    ``test_opacus_contract.py::test_forward_counter``.
    """
    if getattr(p, "_current_grad_sample", None) is not None:
        del p._current_grad_sample


# ---------------------------------------------------------------------------------------------
# Data loading (opacus/data_loader.py)
# ---------------------------------------------------------------------------------------------


def make_empty_batch(collate: Any, template: Any) -> Any:
    """Opacus' random batch of size 1 shaped like ``template`` (``rand_on_empty``).

    Relies on ``CollateFnWithEmpty._make_empty_batch(template)``. Test:
    ``test_opacus_contract.py::test_make_empty_batch``.
    """
    return collate._make_empty_batch(template)


# ---------------------------------------------------------------------------------------------
# The engine's build steps (opacus/privacy_engine.py)
# ---------------------------------------------------------------------------------------------


class PrivacyEngineSeams(opacus.PrivacyEngine):
    """``opacus.PrivacyEngine`` with its private build steps exposed as public seams.

    ``make_private`` builds the private objects by calling ``self._prepare_model``,
    ``self._prepare_data_loader``, ``self._prepare_optimizer`` and ``self._prepare_criterion``
    (Opacus 1.6). Each is forwarded to a public method here (``prepare_model_seam`` ...), whose
    default is Opacus' own step; a subclass overrides the public method. Relies on those four
    names, their keyword arguments and ``make_private`` calling them. Test:
    ``test_opacus_contract.py::test_engine_seams_are_called``.
    """

    def _prepare_model(self, module: nn.Module, **kwargs: Any) -> Any:
        return self.prepare_model_seam(module, **kwargs)

    def _prepare_data_loader(self, data_loader: Any, **kwargs: Any) -> Any:
        return self.prepare_data_loader_seam(data_loader, **kwargs)

    def _prepare_optimizer(self, **kwargs: Any) -> Any:
        return self.prepare_optimizer_seam(**kwargs)

    def _prepare_criterion(self, **kwargs: Any) -> Any:
        return self.prepare_criterion_seam(**kwargs)

    def prepare_model_seam(self, module: nn.Module, **kwargs: Any) -> Any:
        """Opacus' ``_prepare_model``: the grad-sample module ``make_private`` returns."""
        return super()._prepare_model(module, **kwargs)

    def prepare_data_loader_seam(self, data_loader: Any, **kwargs: Any) -> Any:
        """Opacus' ``_prepare_data_loader``: the (Poisson) loader ``make_private`` returns."""
        return super()._prepare_data_loader(data_loader, **kwargs)

    def prepare_optimizer_seam(self, **kwargs: Any) -> Any:
        """Opacus' ``_prepare_optimizer``: the DP optimizer ``make_private`` returns."""
        return super()._prepare_optimizer(**kwargs)

    def prepare_criterion_seam(self, **kwargs: Any) -> Any:
        """Opacus' ``_prepare_criterion``: the loss ``make_private`` returns (ghost
        clipping)."""
        return super()._prepare_criterion(**kwargs)
