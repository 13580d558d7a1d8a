"""One module use's per-sample gradient norms, by the path its route names
(docs/architecture.md#architecture-step, step 3).

:class:`ModuleNorms` is called by the grad-sample module's backward hook with the module's
stored activations and its output gradient (batch first, rescaled to per-sample losses). It
computes the norms of the module's trainable parameters by the route's
:class:`~opacus_rc.grad_sample.routing.NormPath` and records them, and with book-keeping what the
clipped sum needs, in the step's :class:`~opacus_rc.grad_sample.private_step.PrivateStep`:

* sketched or exact: the project's sampler
  (:data:`~opacus_rc.grad_sample.registry.SKETCHED_NORM_SAMPLERS`), drawing fresh probes from the
  sketch generator of the gradient's device;
* tied: the joint sketch of a weight shared with another module
  (:mod:`~opacus_rc.grad_sample.tied`);
* ghost: Opacus' norm sampler;
* grad sampler or functorch: Opacus' per-sample gradients, or those of the module's
  :class:`~opacus_rc.grad_sample.functorch.FunctorchGradSampler`, accumulated over repeated uses
  (RNNs), the norm taken at a parameter's last use; with book-keeping the per-sample gradients are
  kept.

**The smaller stash** (``smaller_stash=True``, passed by the private step in every book-keeping
step with ``bookkeeping=True``, checkpointed or not). A layer's clipped sum needs either its
input ``A`` and output gradient ``G`` (``T (p + d)`` floats per sample for an ``nn.Linear`` with
weight ``p x d``) or its per-sample gradients (``p d + p`` floats per sample). Under
checkpointing keeping ``A`` undoes what checkpointing freed; in any step the sketch from the
per-sample gradients costs ``2 p d k`` FLOPs against ``2 T k (p + d)`` from ``A`` and ``G`` (and
at ``B = 1`` the clipped sum scales the layer's one gradient in place). So each layer whose type has
a per-sample gradient function (:data:`STASH_GRAD_SAMPLERS`) keeps whichever is smaller
(:func:`prefers_grad_sample_stash`: the per-layer choice of the hybrid book-keeping of Bu, Wang, Zha
and Karypis, ICML 2023, implemented in fastDP, which compares the costs of the ghost norm and of
per-sample gradients, ``2 T^2`` against ``p d``; here the sizes of the two stashes are
compared). Where it keeps per-sample gradients, a sketched layer's norm is the same estimator
computed from them (:data:`~opacus_rc.sketching.GRADIENT_ESTIMATORS`: the same probe draw, the
same law, the same value up to float rounding): the choice depends on the batch's shapes, and a
padded batch's ``T`` on its longest record, so were the norm exact on one stash and sketched on
the other, a record's estimator would depend on the other records in its batch
(docs/privacy/estimators.md#estimators-stash). A sketched layer whose sampler or estimator has
no gradient form keeps its input and output gradient. The choice depends on shapes only, never
on values or probes, and costs no host synchronisation. A tied weight's head keeps its
joint sketch for the norm (:mod:`~opacus_rc.grad_sample.tied`) and only stashes its per-sample
gradient ``H_i = G_i^T A_i``; ``nn.Embedding`` (exact norm; Opacus' per-sample gradient counts the
``padding_idx`` row, which autograd leaves at zero) keeps its ids and output gradient, ``T (1 + d)``
floats per sample, which is smaller than ``V d`` at every practical ``T`` anyway.

**An exact layer's stash** (every book-keeping step, checkpointed or not): a layer on the exact
path whose type has a per-sample gradient function (the closed forms of the norm layers,
:mod:`~opacus_rc.grad_sample.norm_layers`) computes its per-sample gradients for the norm anyway;
where they are the smaller stash (``D`` against ``2 T D`` floats per sample for a norm layer)
they are kept for the clipped sum instead of being computed a second time from its input and
output gradient. Its norms are the exact norms of those gradients, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from opacus.grad_sample.grad_sample_module import (
    create_or_accumulate_grad_sample,
    promote_current_grad_sample,
)
from opacus.grad_sample.linear import compute_linear_grad_sample
from torch import nn

from opacus_rc._compat.opacus import count_down_use
from opacus_rc.grad_sample.bookkeeping import BookkeepingStash
from opacus_rc.grad_sample.linear import (
    compute_linear_sketched_norm_sample,
    sketched_weight_norm_of_gradients,
)
from opacus_rc.grad_sample.routing import NormPath, NormRoute
from opacus_rc.sketching import autocast_off

__all__ = [
    "STASH_GRAD_SAMPLERS",
    "ModuleNorms",
    "exact_norms_of_grad_samples",
    "prefers_grad_sample_stash",
]

#: Module type -> per-sample gradient function ``fn(layer, activations, backprops) -> {param:
#: (B, *param.shape)}`` (Opacus' grad-sampler signature) that a book-keeping step
#: may stash instead of the layer's input and output gradient (see the module docstring). Only
#: types whose function gives exactly autograd's per-sample gradient belong here (Opacus'
#: ``nn.Embedding`` sampler counts the ``padding_idx`` row, so ``nn.Embedding`` is not listed).
#: Lookup is by exact type.
STASH_GRAD_SAMPLERS: dict[type[nn.Module], Callable[..., dict[nn.Parameter, torch.Tensor]]] = {
    nn.Linear: compute_linear_grad_sample
}

#: Routes whose clipped sum may come from the per-sample-gradient stash (the smaller stash).
_MIXED_STASH_PATHS = (NormPath.SKETCHED, NormPath.TIED)

#: Module type -> the sketched norm sampler whose estimate :meth:`ModuleNorms.compute` can also
#: compute, with the same probes and law, from the layer's per-sample gradients. A sketched layer
#: keeps per-sample gradients only where its type is listed and its registered sampler is this
#: one: otherwise which stash the shapes pick would decide between two estimators.
_GRADIENT_FORM_SAMPLERS: dict[type[nn.Module], Callable[..., Any]] = {
    nn.Linear: compute_linear_sketched_norm_sample
}


#: Paths that materialise per-sample gradients (``NormPath.per_sample_gradients``).
_PER_SAMPLE_GRADIENT_PATHS = frozenset({NormPath.GRAD_SAMPLER, NormPath.FUNCTORCH})


def prefers_grad_sample_stash(
    params: tuple[nn.Parameter, ...], activations: list[Any], backprops: torch.Tensor
) -> bool:
    """Whether a layer's per-sample gradients are no larger than its input and output gradient.

    Per sample, the per-sample gradients of ``params`` hold ``sum_p numel(p)`` floats (``p d + p``
    for an ``nn.Linear``), the stash of the clipped-sum function ``numel(A_i) + numel(G_i)``
    (``T (d + p)``): the per-layer choice of fastDP's hybrid book-keeping (Bu et al., ICML
    2023) applied to the stash sizes. Shapes only: no host synchronisation.

    Args:
        params: The layer's trainable parameters.
        activations: Its forward inputs, batch first (non-tensors count nothing).
        backprops: Its output gradient, ``(B, ..., p)``.

    Returns:
        True if the per-sample gradients are the smaller (or equal) stash; False for ``B = 0``.
    """
    batch = backprops.shape[0] if backprops.dim() > 0 else 0
    if batch == 0:
        return False
    grads = sum(p.numel() for p in params)
    inputs = sum(a.numel() for a in activations if isinstance(a, torch.Tensor))
    return grads * batch <= inputs + backprops.numel()


def exact_norms_of_grad_samples(
    grad_samples: Mapping[nn.Parameter, torch.Tensor],
) -> dict[nn.Parameter, torch.Tensor]:
    """``{param: (B,) Frobenius norm}`` of per-sample gradients, accumulated in float64.

    Returned in at least float32 (float64 for float64 gradients), like the sketched samplers.
    """
    out = {}
    with autocast_off(next(iter(grad_samples.values())).device if grad_samples else "cpu"):
        for p, gs in grad_samples.items():
            dtype = torch.promote_types(gs.dtype, torch.float32)
            norm = torch.linalg.vector_norm(gs.reshape(len(gs), -1), dim=1, dtype=torch.float64)
            out[p] = norm.to(dtype)
    return out


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
        stash_grad_samplers: Type -> per-sample gradient function a book-keeping step may stash
            (default :data:`STASH_GRAD_SAMPLERS`).
        functorch: ``id(module) -> per-sample gradient function`` of the modules on the
            functorch path (:class:`~opacus_rc.grad_sample.functorch.FunctorchGradSampler`).
        gradient_estimator: ``estimator`` computed from per-sample weight gradients
            (:data:`~opacus_rc.sketching.GRADIENT_ESTIMATORS`), or None where the estimator has
            no such form: then a sketched layer always keeps its input and output gradient.
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
        stash_grad_samplers: Mapping[type, Callable[..., Any]] | None = None,
        functorch: Mapping[int, Callable[..., Any]] | None = None,
        gradient_estimator: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self._gradient_estimator = gradient_estimator
        self._functorch = {} if functorch is None else functorch
        self._stash_grad_samplers = (
            STASH_GRAD_SAMPLERS if stash_grad_samplers is None else stash_grad_samplers
        )
        self._sketched = sketched
        self._grad_samplers = grad_samplers
        self._norm_samplers = norm_samplers
        self._estimator = estimator
        self._sketch_dim = sketch_dim
        self._generator_for = generator_for
        self._tied = tied
        self._name_of = name_of
        self._scale: float = 1  # compute()'s backprop_scale, for the call in progress

    def compute(
        self,
        module: nn.Module,
        route: NormRoute,
        params: tuple[nn.Parameter, ...],
        activations: list[torch.Tensor],
        backprops: torch.Tensor,
        *,
        step: Any,
        bookkeeping: bool,
        smaller_stash: bool = False,
        backprop_scale: float = 1,
    ) -> None:
        """Record the norms (and, with book-keeping, the stash) of this use of ``module``.

        Args:
            module: The hooked module.
            route: Its resolved route.
            params: Its trainable parameters.
            activations: Its forward inputs, batch first.
            backprops: Its output gradient, ``(B, ..., p)``; times ``backprop_scale`` it is
                the gradient of the per-sample losses.
            step: The step state the norms go into.
            bookkeeping: Whether this step keeps tensors for the clipped sum.
            smaller_stash: With book-keeping, keep the per-sample gradients instead of the
                input and output gradient where they are smaller (every step with
                ``bookkeeping=True``; see the module docstring).
            backprop_scale: Opacus' rescale to per-sample losses (``max_batch_len`` under
                ``loss_reduction="mean"``), not applied to ``backprops``: norms and per-sample
                gradients are linear in the output gradient, so the recorded norms are
                multiplied by it and the stash carries it to the clip factors
                (:class:`~opacus_rc.grad_sample.bookkeeping.BookkeepingStash` ``scale``), with
                the same probes (the estimate scaled, up to float rounding).

        Raises:
            RuntimeError: If a sampler gives no norm for one of ``params``.
        """
        self._scale = backprop_scale
        if route.path in _PER_SAMPLE_GRADIENT_PATHS:
            self._from_grad_samples(
                module, route, params, activations, backprops, step, bookkeeping
            )
        elif (
            bookkeeping
            and params
            and (
                (
                    smaller_stash
                    and route.path in _MIXED_STASH_PATHS
                    and self._same_estimator_from_grad_samples(module, route, backprops)
                )
                # An exact layer (a norm layer's closed form) computes its per-sample
                # gradients for the norm anyway: kept, they are its clipped sum's stash, not
                # computed a second time from A and G.
                or route.path is NormPath.EXACT
            )
            and type(module) in self._stash_grad_samplers
            and prefers_grad_sample_stash(params, activations, backprops)
        ):
            self._sampled_with_grad_samples(module, route, params, activations, backprops, step)
        else:
            self._sampled(module, route, params, activations, backprops, step, bookkeeping)

    def _sampled_with_grad_samples(
        self,
        module: nn.Module,
        route: NormRoute,
        params: tuple[nn.Parameter, ...],
        activations: list[torch.Tensor],
        backprops: torch.Tensor,
        step: Any,
    ) -> None:
        """Book-keeping with the per-sample-gradient stash (the smaller stash, or an exact
        layer's; see the module docstring).

        A sketched layer's norms are the same sketch computed from its per-sample gradients
        (:meth:`_sketched_from_grad_samples`: the same probe draw); an exact layer's are their
        exact norms; a tied head's norm is still the joint sketch of the shared weight. The
        per-sample gradients are computed with autocast off, in the output gradient's dtype (as
        the clipped-sum function's product and autograd's weight gradient).
        """
        with autocast_off(backprops.device):
            grad_samples = self._stash_grad_samplers[type(module)](module, activations, backprops)
        grad_samples = {p: grad_samples[p].detach() for p in params if p in grad_samples}
        for p, gs in grad_samples.items():
            # The clipped sum scales a B = 1 stash in place: a per-sample gradient that is the
            # output gradient itself (Opacus' bias gradient of a rank-2 input), which autograd
            # may share with another module, is copied first.
            if (
                gs.shape[:1] == (1,)
                and gs.device.type != "meta"
                and gs.untyped_storage().data_ptr() == backprops.untyped_storage().data_ptr()
            ):
                grad_samples[p] = gs.clone()
        if route.path is NormPath.TIED:
            self._sampled(module, route, params, activations, backprops, step, False)
        else:
            if route.path is NormPath.SKETCHED:
                norms = self._sketched_from_grad_samples(module, activations, grad_samples)
            else:
                norms = exact_norms_of_grad_samples(grad_samples)
            self._record(module, params, norms, step, what="per-sample gradient function")
        step.stash(
            BookkeepingStash(
                module, tuple(grad_samples), grad_samples=grad_samples, scale=self._scale
            )
        )

    def _same_estimator_from_grad_samples(
        self, module: nn.Module, route: NormRoute, backprops: torch.Tensor
    ) -> bool:
        """Whether ``module``'s norm estimate is the same (law and probes) from its per-sample
        gradients as from its input and output gradient: a tied head keeps its joint sketch
        from ``A`` and ``G`` either way; a sketched layer needs the gradient form of its
        sampler and of the step's estimator (:data:`_GRADIENT_FORM_SAMPLERS`), and an output
        gradient that is not float16: per-sample gradients formed in float16 (as autograd
        forms the weight gradient) overflow above 65504 where the sketch from ``A`` and ``G``,
        computed in float32, stays finite, so a record's step would fail or not depending on
        the stash its batch's shapes picked (the dtype is the model's, not the batch's)."""
        if route.path is NormPath.TIED:
            return True
        kind = type(module)
        return (
            backprops.dtype != torch.float16
            and self._gradient_estimator is not None
            and kind in _GRADIENT_FORM_SAMPLERS
            and kind in self._sketched
            and self._sketched[kind] is _GRADIENT_FORM_SAMPLERS[kind]
        )

    def _sketched_from_grad_samples(
        self,
        module: nn.Module,
        activations: list[torch.Tensor],
        grad_samples: Mapping[nn.Parameter, torch.Tensor],
    ) -> dict[nn.Parameter, torch.Tensor]:
        """A sketched ``nn.Linear``'s norms from its per-sample gradients: what
        :func:`~opacus_rc.grad_sample.linear.compute_linear_sketched_norm_sample` gives from
        its input and output gradient, with the same probe draw (the weight's, rank-3 inputs)
        and the same exact parts (the bias; the weight of a rank-2 input), up to float
        rounding. So the stash a step keeps, which the batch's shapes decide (its padded
        length ``T``, hence the other records' lengths), never changes a record's estimator."""
        weight = getattr(module, "weight", None)
        exact = {p: g for p, g in grad_samples.items() if p is not weight}
        if weight in grad_samples and activations[0].dim() == 2:
            exact[weight] = grad_samples[weight]
        norms = exact_norms_of_grad_samples(exact) if exact else {}
        if weight in grad_samples and weight not in norms:
            gs = grad_samples[weight]
            out_dtype = torch.promote_types(gs.dtype, torch.float32)
            norms[weight] = sketched_weight_norm_of_gradients(
                gs,
                estimator=self._gradient_estimator,
                sketch_dim=self._sketch_dim,
                generator=self._generator_for(gs.device),
            ).to(out_dtype)
        return norms

    def _sampled(
        self,
        module: nn.Module,
        route: NormRoute,
        params: tuple[nn.Parameter, ...],
        activations: list[torch.Tensor],
        backprops: torch.Tensor,
        step: Any,
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
        self._record(module, params, norms, step, what="norm sampler", deferred=deferred)
        if bookkeeping and params:
            step.stash(
                BookkeepingStash(
                    module,
                    params,
                    activations=activations,
                    backprops=backprops,
                    scale=self._scale,
                )
            )

    def _record(
        self,
        module: nn.Module,
        params: tuple[nn.Parameter, ...],
        norms: Mapping[nn.Parameter, torch.Tensor],
        step: Any,
        *,
        what: str,
        deferred: frozenset[int] = frozenset(),
    ) -> None:
        """Check that ``norms`` covers every parameter of this use (but those ``deferred`` to
        the other module of a tied group), count the use, and record the norms."""
        missing = []
        recorded = {}
        for p in params:
            if p in norms:
                recorded[p] = norms[p]
            elif id(p) not in deferred:
                missing.append(p)
        if missing:
            raise RuntimeError(
                f"the {what} for '{self._name_of(module)}' ({type(module).__name__}) returned "
                f"no norm for {len(missing)} trainable parameter(s); it must cover every "
                "trainable parameter of its module"
            )
        for p in params:
            count_down_use(p)
        if self._scale != 1:
            recorded = {p: n * self._scale for p, n in recorded.items()}
        step.record_norms(recorded)

    def _from_grad_samples(
        self,
        module: nn.Module,
        route: NormRoute,
        params: tuple[nn.Parameter, ...],
        activations: list[torch.Tensor],
        backprops: torch.Tensor,
        step: Any,
        bookkeeping: bool,
    ) -> None:
        """Exact norms from per-sample gradients (Opacus' grad sampler, or functorch).

        Per-sample gradients are accumulated over repeated uses (RNNs), as in Opacus' ghost
        module, and the norm is taken once a parameter's last use is processed; with
        book-keeping the per-sample gradients ``(B, *p.shape)`` are kept for the clipped sum.
        """
        if route.path is NormPath.GRAD_SAMPLER:
            grad_sampler_fn = self._grad_samplers[type(module)]
        else:
            grad_sampler_fn = self._functorch[id(module)]
        grad_samples = grad_sampler_fn(module, activations, backprops)
        self._accumulate_and_record(module, params, grad_samples, step, bookkeeping)

    def record_grad_samples(
        self,
        module: nn.Module,
        params: tuple[nn.Parameter, ...],
        grad_samples: dict[nn.Parameter, torch.Tensor],
        *,
        step: Any,
        bookkeeping: bool,
    ) -> None:
        """Record exact norms from per-sample gradients computed by the caller.

        As the per-sample-gradient paths do with their sampler's output (accumulated over a
        module's uses, the norm taken at a parameter's last use, kept for the clipped sum with
        book-keeping); for per-record gradients of packed rows
        (:meth:`opacus_rc.packed_loss.PackedRecordLayout.record_norms`), already the
        gradients of the per-record losses (no rescale).

        Args:
            module: The hooked module (its ``max_batch_len`` the number of samples).
            params: Its trainable parameters.
            grad_samples: ``{param: (N, *param.shape)}`` for each of ``params``.
            step: The step state.
            bookkeeping: Keep the per-sample gradients for the clipped sum.
        """
        self._scale = 1
        self._accumulate_and_record(module, params, grad_samples, step, bookkeeping)

    def _accumulate_and_record(
        self,
        module: nn.Module,
        params: tuple[nn.Parameter, ...],
        grad_samples: dict[nn.Parameter, torch.Tensor],
        step: Any,
        bookkeeping: bool,
    ) -> None:
        for param, gs in grad_samples.items():
            create_or_accumulate_grad_sample(
                param=param, grad_sample=gs, max_batch_len=module.max_batch_len
            )
        del grad_samples
        last: dict[nn.Parameter, torch.Tensor] = {}
        done: dict[nn.Parameter, torch.Tensor] = {}
        for p in params:
            if count_down_use(p) == 0:
                promote_current_grad_sample(p)
                last[p] = p.grad_sample.detach()
                if bookkeeping:
                    done[p] = last[p]
                p.grad_sample = None
        if last:
            norms = exact_norms_of_grad_samples(last)
            if self._scale != 1:
                norms = {p: n * self._scale for p, n in norms.items()}
            step.record_norms(norms)
        if done:
            step.stash(BookkeepingStash(module, tuple(done), grad_samples=done, scale=self._scale))
