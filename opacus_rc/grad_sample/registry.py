"""Registries of sketched per-sample norm samplers and clipped sums (separate from Opacus').

Opacus keeps its exact samplers in the class attributes ``GradSampleHooks.GRAD_SAMPLERS`` and
``GradSampleHooksFastGradientClipping.NORM_SAMPLERS``, which are global to the process. This
module never writes into them: randomized clipping looks up :data:`SKETCHED_NORM_SAMPLERS`
first and falls back to Opacus' exact samplers for every other layer type.

A sampler has the signature::

    sampler(layer, activations, backprops, *, estimator, sketch_dim, generator)
        -> dict[nn.Parameter, Tensor]

where ``activations`` is the list of the layer's forward inputs (batch first), ``backprops`` is
the gradient of the layer's output, already rescaled to per-sample losses (batch first), and
each returned tensor has shape ``(B,)``: the per-sample gradient **norm** (not squared) of one
trainable parameter. Opacus combines them with ``torch.stack(...).norm(2, dim=0)``.

A sampler registered with ``exact=True`` computes the norm exactly and ignores ``estimator``,
``sketch_dim`` and ``generator`` (it draws no probe); its types are listed in
:data:`EXACT_NORM_TYPES`. An exact layer inside a sketched step needs no change to the
accountant (docs/privacy/envelope.md#envelope-definition, Lemma D: deterministic parts never worsen
the envelope).

:data:`CLIPPED_SUM_FUNCTIONS` (:func:`register_clipped_sum`) holds, for the same module types,
the clipped gradient sum used by the single-backward book-keeping path (Bu et al., ICML 2023).

:data:`MODULE_CHECKS` (:func:`register_module_check`) holds configuration checks that the
randomized-clipping module runs on every submodule before attaching hooks
(:func:`check_modules`), e.g. to refuse ``nn.Embedding(max_norm=...)``.

:data:`FORWARD_INPUT_ADAPTERS` (:func:`register_forward_input_adapter`) holds, for module types
whose forward takes optional or non-tensor inputs (``nn.EmbeddingBag(input, offsets,
per_sample_weights)``), the function that turns one call's inputs into the list of tensors that
is stored for the backward hook (and read by that type's sampler).

Each table is an :class:`~opacus_rc.registry.TypeRegistry` (the package's one registry helper,
a ``dict`` from exact module type to function): ``table[nn.Linear]``, ``type in table`` and
``table.get(type)`` (``None`` when unregistered) behave as on a ``dict``, and every
``register_*`` function is that registry's :meth:`~opacus_rc.registry.TypeRegistry.register_types`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from opacus_rc.registry import TypeRegistry

__all__ = [
    "CLIPPED_SUM_FUNCTIONS",
    "EXACT_NORM_TYPES",
    "FORWARD_INPUT_ADAPTERS",
    "MODULE_CHECKS",
    "SKETCHED_NORM_SAMPLERS",
    "ClippedSumFunction",
    "ForwardInputAdapter",
    "ModuleCheck",
    "SketchedNormSampler",
    "check_modules",
    "register_clipped_sum",
    "register_forward_input_adapter",
    "register_module_check",
    "register_sketched_norm_sampler",
]


class SketchedNormSampler(Protocol):
    """Signature of a sketched per-sample norm sampler (see the module docstring)."""

    def __call__(
        self,
        layer: nn.Module,
        activations: list[torch.Tensor],
        backprops: torch.Tensor,
        *,
        estimator: Callable[..., torch.Tensor],
        sketch_dim: int,
        generator: torch.Generator | None,
    ) -> dict[nn.Parameter, torch.Tensor]: ...


#: Exact module type -> sketched norm sampler. Lookup is by ``type(module)``, as in Opacus, so
#: subclasses of a registered type are not matched (they fall back to exact norms).
SKETCHED_NORM_SAMPLERS: TypeRegistry[SketchedNormSampler] = TypeRegistry(
    "sketched norm sampler", base=nn.Module, base_name="nn.Module"
)


#: The types of :data:`SKETCHED_NORM_SAMPLERS` whose sampler is exact (registered with
#: ``exact=True``): no probe is drawn, and the module logs their norm path as exact.
EXACT_NORM_TYPES: set[type[nn.Module]] = set()


def register_sketched_norm_sampler(
    *module_types: type[nn.Module], force: bool = False, exact: bool = False
) -> Callable[[SketchedNormSampler], SketchedNormSampler]:
    """Decorator registering a sketched norm sampler for one or more module types.

    Example::

        @register_sketched_norm_sampler(MyLinear)
        def compute_my_linear_sketched_norm_sample(
            layer, activations, backprops, *, estimator, sketch_dim, generator
        ):
            ...

    Args:
        *module_types: The exact ``nn.Module`` subclasses the sampler handles.
        force: Replace an existing registration instead of raising.
        exact: The sampler computes exact norms and ignores ``estimator``, ``sketch_dim`` and
            ``generator`` (e.g. ``nn.Embedding``); the types are then in
            :data:`EXACT_NORM_TYPES` (removed from it when re-registered with ``False``).

    Returns:
        The decorator; it returns the sampler unchanged.

    Raises:
        TypeError: If no module type is given, one is not an ``nn.Module`` subclass, or
            ``exact`` is not a bool.
        ValueError: If a type already has a sampler and ``force`` is ``False``.
    """
    if not isinstance(exact, bool):
        raise TypeError(f"exact must be a bool, got {type(exact).__name__}")
    register = SKETCHED_NORM_SAMPLERS.register_types(*module_types, force=force)

    def decorator(fn: SketchedNormSampler) -> SketchedNormSampler:
        register(fn)
        for module_type in module_types:
            if exact:
                EXACT_NORM_TYPES.add(module_type)
            else:
                EXACT_NORM_TYPES.discard(module_type)
        return fn

    return decorator


# ----------------------------------------------------------------------------------------------
# Clipped-sum functions (book-keeping, single backward)
# ----------------------------------------------------------------------------------------------


class ClippedSumFunction(Protocol):
    """Signature of a clipped-sum function (book-keeping; see :func:`register_clipped_sum`)."""

    def __call__(
        self,
        layer: nn.Module,
        activations: list[torch.Tensor],
        backprops: torch.Tensor,
        coef: torch.Tensor,
    ) -> dict[nn.Parameter, torch.Tensor]: ...


#: Exact module type -> clipped-sum function. Used for module types whose norms come from
#: :data:`SKETCHED_NORM_SAMPLERS`: a sketched type without an entry here makes the randomized-
#: clipping module fall back to two backward passes.
CLIPPED_SUM_FUNCTIONS: TypeRegistry[ClippedSumFunction] = TypeRegistry(
    "clipped-sum function", base=nn.Module, base_name="nn.Module"
)


def register_clipped_sum(
    *module_types: type[nn.Module], force: bool = False
) -> Callable[[ClippedSumFunction], ClippedSumFunction]:
    """Decorator registering the clipped gradient sum of one or more module types.

    Book-keeping (BK; Bu, Wang, Zha and Karypis, "Differentially Private Optimization on Large
    Model at Small Cost", ICML 2023) replaces the second backward pass of ghost/randomized
    clipping: the first pass keeps each layer's input and output gradient, and once the clip
    factors ``c`` are known the clipped gradient sum ``sum_i c_i grad_theta loss_i`` of the
    layer's parameters is computed from them directly. A function has the signature::

        fn(layer, activations, backprops, coef) -> dict[nn.Parameter, Tensor]

    with ``activations`` and ``backprops`` exactly as a sketched norm sampler receives them
    (batch first, ``backprops`` already rescaled so that sample ``i``'s slice is the gradient
    of ``loss_i``), ``coef`` of shape ``(B,)`` and, for every **trainable** parameter of
    ``layer``, a tensor of the parameter's shape: ``sum_i coef_i * grad_param loss_i``. It must
    not draw random numbers. Example::

        @register_clipped_sum(MyLinear)
        def compute_my_linear_clipped_sum(layer, activations, backprops, coef):
            ...

    A type registered with :func:`register_sketched_norm_sampler` but not here is still
    supported: the module then runs the two-pass path.

    Args:
        *module_types: The exact ``nn.Module`` subclasses the function handles.
        force: Replace an existing registration instead of raising.

    Returns:
        The decorator; it returns the function unchanged.

    Raises:
        TypeError: If no module type is given or one is not an ``nn.Module`` subclass.
        ValueError: If a type already has a function and ``force`` is ``False``.
    """
    return CLIPPED_SUM_FUNCTIONS.register_types(*module_types, force=force)


# ----------------------------------------------------------------------------------------------
# Construction-time checks of a module's configuration
# ----------------------------------------------------------------------------------------------


class ModuleCheck(Protocol):
    """Signature of a module check (see :func:`register_module_check`)."""

    def __call__(self, layer: nn.Module) -> None: ...


#: Exact module type -> check that raises for a configuration of that type which randomized
#: clipping cannot make private (e.g. ``nn.Embedding(max_norm=...)``).
MODULE_CHECKS: TypeRegistry[ModuleCheck] = TypeRegistry(
    "module check", base=nn.Module, base_name="nn.Module"
)


def register_module_check(
    *module_types: type[nn.Module], force: bool = False
) -> Callable[[ModuleCheck], ModuleCheck]:
    """Decorator registering a configuration check for one or more module types.

    :func:`check_modules` calls it on every submodule of a registered type (trainable or not)
    before any hook is attached, so that a configuration whose forward pass or gradient cannot be
    made private is refused before the first forward pass. A check raises (``ValueError`` with
    what to change) or returns ``None``; it must not modify the module. Example::

        @register_module_check(MyLayer)
        def check_my_layer(layer):
            if layer.some_option:
                raise ValueError("MyLayer(some_option=True) is not supported: ...")

    Args:
        *module_types: The exact ``nn.Module`` subclasses the check handles.
        force: Replace an existing registration instead of raising.

    Returns:
        The decorator; it returns the check unchanged.

    Raises:
        TypeError: If no module type is given or one is not an ``nn.Module`` subclass.
        ValueError: If a type already has a check and ``force`` is ``False``.
    """
    return MODULE_CHECKS.register_types(*module_types, force=force)


def check_modules(module: nn.Module) -> None:
    """Run the registered check (:data:`MODULE_CHECKS`) of every submodule of ``module``.

    Lookup is by exact type, as for the samplers.

    Raises:
        ValueError: From a registered check, naming the unsupported option and what to do.
    """
    for sub in module.modules():
        check = MODULE_CHECKS.get(type(sub))
        if check is not None:
            check(sub)


# ----------------------------------------------------------------------------------------------
# Forward-input adapters (what is stored of one forward call)
# ----------------------------------------------------------------------------------------------


class ForwardInputAdapter(Protocol):
    """Signature of a forward-input adapter (see :func:`register_forward_input_adapter`)."""

    def __call__(
        self, layer: nn.Module, inputs: Sequence[Any], *, batch_first: bool
    ) -> list[torch.Tensor]: ...


#: Exact module type -> forward-input adapter. Types without one store their positional tensor
#: inputs unchanged (Opacus' behaviour).
FORWARD_INPUT_ADAPTERS: TypeRegistry[ForwardInputAdapter] = TypeRegistry(
    "forward-input adapter", base=nn.Module, base_name="nn.Module"
)


def register_forward_input_adapter(
    *module_types: type[nn.Module], force: bool = False
) -> Callable[[ForwardInputAdapter], ForwardInputAdapter]:
    """Decorator registering how one forward call of a module type is stored for its backward.

    The forward hook of the randomized-clipping module binds the call's arguments to the
    positions of ``forward``'s signature (keyword arguments included) and passes them, ``None``
    for an optional input included, to the adapter, which returns the detached tensors the
    type's norm sampler and clipped-sum function read. The last tensor must have the batch
    dimension first (Opacus reads the batch size from it). Example::

        @register_forward_input_adapter(MyBagLayer)
        def my_bag_inputs(layer, inputs, *, batch_first):
            ids, offsets = inputs
            return [ids.detach(), offsets.detach()]

    Args:
        *module_types: The exact ``nn.Module`` subclasses the adapter handles.
        force: Replace an existing registration instead of raising.

    Returns:
        The decorator; it returns the adapter unchanged.

    Raises:
        TypeError: If no module type is given or one is not an ``nn.Module`` subclass.
        ValueError: If a type already has an adapter and ``force`` is ``False``.
    """
    return FORWARD_INPUT_ADAPTERS.register_types(*module_types, force=force)
