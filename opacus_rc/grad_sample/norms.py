"""One module use's per-sample gradient norms, by the path its route names (DESIGN.md 3, step 2).

:class:`ModuleNorms` is called by the grad-sample module's backward hook with the module's
stored activations and its output gradient (batch first, rescaled to per-sample losses). It
computes the norms of the module's trainable parameters by the route's
:class:`~opacus_rc.grad_sample.routing.NormPath` and records them, and with book-keeping what the
clipped sum needs, in the step's :class:`~opacus_rc.grad_sample.step.StepState`:

* sketched or exact: the project's sampler (:data:`~opacus_rc.grad_sample.registry.SKETCHED_NORM_SAMPLERS`),
  drawing fresh probes from the sketch generator of the gradient's device;
* tied: the joint sketch of a weight shared with another module (:mod:`~opacus_rc.grad_sample.tied`);
* ghost: Opacus' norm sampler;
* grad sampler or functorch: Opacus' per-sample gradients, accumulated over repeated uses (RNNs),
  the norm taken at a parameter's last use; with book-keeping the per-sample gradients are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient
from opacus.grad_sample.grad_sample_module import (
    create_or_accumulate_grad_sample,
    promote_current_grad_sample,
)
from torch import nn

from opacus_rc.grad_sample.bookkeeping import BookkeepingStash
from opacus_rc.grad_sample.routing import NormPath, NormRoute
from opacus_rc.grad_sample.step import StepState

__all__ = ["ModuleNorms"]


class ModuleNorms:
    """Computes and records the per-sample norms of one use of a hooked module.

    Args:
        sketched: The project's sampler registry (type -> sampler).
        grad_samplers: Opacus' per-sample gradient samplers (type -> sampler).
        norm_samplers: Opacus' ghost norm samplers (type -> sampler).
        estimator: The squared-norm estimator (:data:`~opacus_rc.sketching.ESTIMATORS`).
        sketch_dim: ``k``.
        generator_for: Device -> the sketch generator for tensors on it.
        tied: The tied-weight sketches (:class:`~opacus_rc.grad_sample.tied.TiedSketches`).
        name_of: Qualified name of a module or parameter (for errors).
    """

    def __init__(
        self,
        *,
        sketched: Mapping[type, Any],
        grad_samplers: Mapping[type, Any],
        norm_samplers: Mapping[type, Any],
        estimator: Callable[..., torch.Tensor],
        sketch_dim: int,
        generator_for: Callable[[torch.device], torch.Generator],
        tied: Any,
        name_of: Callable[[Any], str],
    ) -> None:
        self._sketched = sketched
        self._grad_samplers = grad_samplers
        self._norm_samplers = norm_samplers
        self._estimator = estimator
        self._sketch_dim = sketch_dim
        self._generator_for = generator_for
        self._tied = tied
        self._name_of = name_of

    def compute(
        self,
        module: nn.Module,
        route: NormRoute,
        params: tuple[nn.Parameter, ...],
        activations: list[torch.Tensor],
        backprops: torch.Tensor,
        *,
        step: StepState,
        bookkeeping: bool,
    ) -> None:
        """Record the norms (and, with book-keeping, the stash) of this use of ``module``.

        Args:
            module: The hooked module.
            route: Its resolved route.
            params: Its trainable parameters.
            activations: Its forward inputs, batch first.
            backprops: Its output gradient, ``(B, ..., p)``, rescaled to per-sample losses.
            step: The step state the norms go into.
            bookkeeping: Whether this step keeps tensors for the clipped sum.

        Raises:
            RuntimeError: If a sampler gives no norm for one of ``params``.
        """
        if route.path.per_sample_gradients:
            self._from_grad_samples(
                module, route, params, activations, backprops, step, bookkeeping
            )
        else:
            self._sampled(module, route, params, activations, backprops, step, bookkeeping)

    def _sampled(
        self,
        module: nn.Module,
        route: NormRoute,
        params: tuple[nn.Parameter, ...],
        activations: list[torch.Tensor],
        backprops: torch.Tensor,
        step: StepState,
        bookkeeping: bool,
    ) -> None:
        """Sketched, exact (project sampler), ghost (Opacus) or tied norms. A tied weight's
        norm is recorded once, by the second module of its group."""
        deferred: frozenset[int] = frozenset()
        if route.path is NormPath.TIED:
            norms, deferred = self._tied.sample(
                module,
                activations,
                backprops,
                sketch_dim=self._sketch_dim,
                generator=self._generator_for(backprops.device),
            )
        elif route.path is NormPath.GHOST:
            norms = self._norm_samplers[type(module)](module, activations, backprops)
        else:
            norms = self._sketched[type(module)](
                module,
                activations,
                backprops,
                estimator=self._estimator,
                sketch_dim=self._sketch_dim,
                generator=self._generator_for(backprops.device),
            )
        missing = [p for p in params if p not in norms and id(p) not in deferred]
        if missing:
            raise RuntimeError(
                f"the norm sampler for '{self._name_of(module)}' ({type(module).__name__}) "
                f"returned no norm for {len(missing)} trainable parameter(s); a sampler must "
                "cover every trainable parameter of its module"
            )
        for p in params:
            p._forward_counter -= 1
        step.record_norms({p: norms[p] for p in params if p in norms})
        if bookkeeping and params:
            step.stash(
                BookkeepingStash(module, params, activations=activations, backprops=backprops)
            )

    def _from_grad_samples(
        self,
        module: nn.Module,
        route: NormRoute,
        params: tuple[nn.Parameter, ...],
        activations: list[torch.Tensor],
        backprops: torch.Tensor,
        step: StepState,
        bookkeeping: bool,
    ) -> None:
        """Exact norms from Opacus' per-sample gradients (a grad sampler or functorch).

        Per-sample gradients are accumulated over repeated uses (RNNs), as in Opacus' ghost
        module, and the norm is taken once a parameter's last use is processed; with
        book-keeping the per-sample gradients ``(B, *p.shape)`` are kept for the clipped sum.
        """
        if route.path is NormPath.GRAD_SAMPLER:
            grad_sampler_fn = self._grad_samplers[type(module)]
        else:
            grad_sampler_fn = ft_compute_per_sample_gradient
        grad_samples = grad_sampler_fn(module, activations, backprops)
        for param, gs in grad_samples.items():
            create_or_accumulate_grad_sample(
                param=param, grad_sample=gs, max_batch_len=module.max_batch_len
            )
        del grad_samples
        norms: dict[nn.Parameter, torch.Tensor] = {}
        done: dict[nn.Parameter, torch.Tensor] = {}
        for p in params:
            p._forward_counter -= 1
            if p._forward_counter == 0:
                promote_current_grad_sample(p)
                gs = p.grad_sample
                norms[p] = gs.reshape(len(gs), -1).norm(2, dim=-1)
                if bookkeeping:
                    done[p] = gs.detach()
                p.grad_sample = None
        if norms:
            step.record_norms(norms)
        if done:
            step.stash(BookkeepingStash(module, tuple(done), grad_samples=done))
