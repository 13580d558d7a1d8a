"""Registry of sketched per-sample norm samplers, separate from Opacus' own registries.

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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

__all__ = ["SKETCHED_NORM_SAMPLERS", "SketchedNormSampler", "register_sketched_norm_sampler"]


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
SKETCHED_NORM_SAMPLERS: dict[type[nn.Module], SketchedNormSampler] = {}


def register_sketched_norm_sampler(
    *module_types: type[nn.Module], force: bool = False
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

    Returns:
        The decorator; it returns the sampler unchanged.

    Raises:
        TypeError: If no module type is given or one is not an ``nn.Module`` subclass.
        ValueError: If a type already has a sampler and ``force`` is ``False``.
    """
    if not module_types:
        raise TypeError("register_sketched_norm_sampler needs at least one module type")
    for module_type in module_types:
        if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
            raise TypeError(f"expected an nn.Module subclass, got {module_type!r}")

    def decorator(sampler: SketchedNormSampler) -> SketchedNormSampler:
        if not force:
            taken = [t for t in module_types if t in SKETCHED_NORM_SAMPLERS]
            if taken:
                names = ", ".join(f"{t.__module__}.{t.__qualname__}" for t in taken)
                raise ValueError(
                    f"duplicate registration of a sketched norm sampler for {names}; "
                    "pass force=True to replace it"
                )
        for module_type in module_types:
            SKETCHED_NORM_SAMPLERS[module_type] = sampler
        return sampler

    return decorator
