"""Randomized clipping of FSDP2-sharded models (``torch.distributed.fsdp.fully_shard``).

Opacus 1.6 supports FSDP2 for ghost clipping (``grad_sample_mode="ghost_fsdp"``,
``GradSampleModuleFastGradientClippingFSDP``, its optimizer ``FSDPOptimizerFastGradientClipping``
and ``opacus.utils.fsdp_utils.FSDP2Wrapper``). This module does the same for
``clipping="randomized"``, on top of the single-process randomized-clipping module.

**Why the sketch sees the whole layer's gradient.** Data parallelism gives every rank its own
samples; FSDP2 only shards the *parameters*. In each module's forward and backward FSDP2
all-gathers the full weight, so the activations ``A_i`` (``T x d``) and output gradients
``G_i`` (``T x p``) the hooks record are those of the whole, unsharded layer, for the rank's own
samples ``i``. The per-sample weight gradient ``G_i^T A_i`` is a function of these alone, so the
sketched norm ``||A_i^T (G_i Omega_i)||_F`` (docs/privacy/estimators.md#estimators-hutchinson)
estimates the norm of the whole layer's gradient with no communication, and sample ``i``'s clip
factor ``c_i`` multiplies every shard of its gradient alike. A sample lives on one rank only,
so there is nothing to agree on across ranks but the released sum.

**The clipped sum.** With book-keeping (the default) each rank forms its own
``sum_i c_i G_i^T A_i`` in the parameter's global shape from its one backward pass and
reduce-scatters it into the parameter's shards (a ``Partial`` DTensor redistributed to the
parameter's placements): each shard then holds the sum over all ranks' samples. With two passes,
FSDP2's own reduce-scatter of the second pass does the same; its divide factor is set to 1 so
that it sums (the optimizer divides once, by the expected global batch size). Every rank issues
the same collectives in the same order, an empty Poisson batch included (its sum is zero).

**Which groups.** Every trainable parameter must belong to an FSDP2 group
(:func:`check_fsdp_model`); a module need not be sharded on its own. A decoder layer's group may
own its RMSNorms and biases, the root's the final norm, and one group must own a tied weight
(torch refuses a parameter shared across groups): the root's, or
``fully_shard([embedding, head])`` (FSDP2's ``FSDPEmbedding`` and ``FSDPLinear`` are matched as
the embedding and the head, :func:`~opacus_rc.grad_sample.routing.find_tied_groups`). LoRA
adapters may share a group with the frozen base weights.

**Parameter identity.** The randomized-clipping step state is keyed by parameter (Opacus keeps
its FSDP norms on modules instead). FSDP2 registers a group's unsharded parameters on its
modules during the group's forward and backward (the root's from its forward to the end of the
backward) and the sharded ``DTensor`` parameters (the optimizer's) outside them. Every hook
therefore runs on the sharded ones (``_sharded_view``: the parameters registered at
construction put back for the duration of the hook), and so does the check that the trainable
set has not changed, which runs inside the root's forward. No hook reads parameter values: the
norms and clipped sums come from activations and output gradients alone (the RMSNorm and
LayerNorm closed forms recompute the normalised input from the layer input; functorch, which
evaluates a module with its parameters, is refused), and the shapes they read are the
``DTensor`` parameters' global shapes.

**Tied weights.** The joint sketch of the tied embedding / LM head
(:mod:`~opacus_rc.grad_sample.tied`) and the norms of every other layer need no collective: the
head's input and output gradient and the embedding's ids and output gradient are those of the
whole layer for the rank's own samples, so each rank's norms equal one process's on its
samples with the same probes (tests/distributed/test_fsdp_llama.py). With book-keeping the
head's and the embedding's clipped sums are added into one sum in the parameter's global shape,
reduce-scattered once into the shared parameter's shard; with two passes FSDP2's reduce-scatter
of the second pass sums both uses. FSDP2's per-module classes (``FSDPLinear``...) are mapped to
their base type with Opacus' own ``_get_module_type``; a sharded module of a type with a
project sampler but no Opacus grad sampler (a ``fully_shard``-ed ``LlamaRMSNorm``) is given its
per-sample gradient function in Opacus' table, so that Opacus does not deep-copy it for
functorch (FSDP2 refuses the copy).

**Activation checkpointing** (``torch.utils.checkpoint``, reentrant or not, and HF's
``gradient_checkpointing_enable``) needs nothing more: the recomputed forward runs inside the
group's backward, whose hooks see the same sharded parameters.

Denoising is refused under FSDP (the engine): post-processing must see the whole noisy
gradient, which no rank holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from opacus.utils.module_utils import trainable_parameters
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial

from opacus_rc._compat.opacus import fsdp_base_type as _opacus_fsdp_base_type
from opacus_rc._compat.torch import registered_parameters
from opacus_rc.grad_sample.bookkeeping import compute_clipped_sums
from opacus_rc.grad_sample.grad_sample_module import (
    GradSampleHooksRandomizedClipping,
    GradSampleModuleRandomizedClipping,
    _RandomizedClippingMixin,
)
from opacus_rc.grad_sample.norm_layers import register_loaded_transformers_norms
from opacus_rc.grad_sample.private_step import PrivateStep
from opacus_rc.grad_sample.routing import NormPath

__all__ = [
    "GradSampleHooksRandomizedClippingFSDP",
    "GradSampleModuleRandomizedClippingFSDP",
    "check_fsdp_model",
    "fsdp_base_type",
]


def fsdp_base_type(module: nn.Module) -> type:
    """The module's own type, FSDP2's per-module subclass (``FSDPLinear``) unwrapped.

    Opacus' own unwrapping (:func:`opacus_rc._compat.opacus.fsdp_base_type`).
    """
    return _opacus_fsdp_base_type(module)


def _with_fsdp_types(registry: Mapping[type, Any], fsdp_types: Mapping[type, type]) -> dict:
    """``registry`` plus an entry for each FSDP2 class whose base type is registered."""
    out = dict(registry)
    for cls, base in fsdp_types.items():
        if base in registry:
            out[cls] = registry[base]
    return out


def check_fsdp_model(m: nn.Module) -> dict[type, type]:
    """Check an FSDP2 model for randomized clipping; return ``{FSDP2 class: base type}``.

    Every trainable parameter must be managed by an FSDP2 group (a ``DTensor`` once
    ``fully_shard`` has run): the module's own group, or an enclosing one (a decoder layer's
    group owning its RMSNorms, the root's owning a tied embedding and LM head). The hooks
    map whatever parameters a group has registered (sharded or unsharded) back to the sharded
    ones (see the module docstring), so a module need not be sharded on its own.

    Raises:
        RuntimeError: If ``torch.distributed`` is not initialised.
        ValueError: If ``m`` is not ``fully_shard``-ed at its root, or a trainable parameter is
            managed by no FSDP2 group (``fully_shard(..., ignored_params=...)``): its gradient
            would be neither sharded nor reduced across ranks. The message names the modules
            and their types and says to let FSDP2 manage the parameters or to freeze them.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "randomized clipping of an FSDP2 model needs an initialised torch.distributed "
            "process group (torch.distributed.init_process_group)"
        )
    if not isinstance(m, FSDPModule):
        raise ValueError(
            "the model is not fully_shard-ed at its root: call fully_shard(model) after "
            "sharding its layers (or use opacus.utils.fsdp_utils.FSDP2Wrapper)"
        )
    unmanaged = [
        (name or "<root>", type(sub).__name__)
        for name, sub in m.named_modules()
        if any(
            p.requires_grad and not isinstance(p, DTensor) for p in sub.parameters(recurse=False)
        )
    ]
    if unmanaged:
        types = sorted({t for _, t in unmanaged})
        raise ValueError(
            f"{len(unmanaged)} module(s) own trainable parameters that no FSDP2 group manages: "
            f"{[n for n, _ in unmanaged[:5]]} (types {types}), e.g. passed to fully_shard as "
            "ignored_params. Their gradients would be neither sharded nor summed across ranks. "
            "Let FSDP2 manage them (drop them from ignored_params; fully_shard(model) manages "
            "every parameter no inner group does) or freeze them"
        )
    return {type(sub): fsdp_base_type(sub) for sub in m.modules() if isinstance(sub, FSDPModule)}


class FSDPPrivateStep(PrivateStep):
    """The :class:`~opacus_rc.grad_sample.private_step.PrivateStep` of an FSDP2 model: its
    book-keeping clipped sums are reduce-scattered into the parameters' shards."""

    def _write_clipped_sums(self, ready: list[Any], coef: torch.Tensor) -> None:
        """Book-keeping under FSDP2: each rank's clipped sum, reduce-scattered into the shards.

        For every trainable parameter, in the model's order (the same on every rank, so the
        collectives line up; a parameter this rank's batch did not reach, or an empty batch,
        contributes zeros), ``sum_i coef_i grad_p loss_i`` over this rank's samples is formed in
        the parameter's global shape and redistributed from ``Partial`` (a sum over ranks) to
        the parameter's placements: a reduce-scatter. ``p.grad`` then holds the shard of the
        sum over all ranks' samples.

        Raises:
            ValueError: As the single-process clipped sum.
        """
        sums = compute_clipped_sums(
            ready, coef, clipped_sums=self.clipped_sums, name_of=self.name_of
        )
        with torch.no_grad():
            for p in _trainable(self.model):
                _add_reduced(p, sums.pop(p, None))


class _FSDPRandomizedClippingMixin(_RandomizedClippingMixin):
    """The FSDP2 differences, before a randomized-clipping class in the bases."""

    FIRST_PASS_OUTPUT_EDGES = True
    PRIVATE_STEP = FSDPPrivateStep

    def __init__(self, m: nn.Module, **kwargs: Any) -> None:
        register_loaded_transformers_norms()  # before the refusals and the tables below
        if isinstance(m, FSDPModule):  # else check_fsdp_model says what to do
            config = kwargs.get("config")
            force = config.force_functorch if config is not None else kwargs.get("force_functorch")
            self._refuse_functorch(m, force_functorch=bool(force))
        fsdp_types = check_fsdp_model(m)
        # FSDP2's per-module classes (FSDPLinear...) take their base type's samplers. Set on
        # the instance before the base class resolves the routes.
        self.SKETCHED_NORM_SAMPLERS = _with_fsdp_types(
            type(self).SKETCHED_NORM_SAMPLERS, fsdp_types
        )
        self.CLIPPED_SUM_FUNCTIONS = _with_fsdp_types(type(self).CLIPPED_SUM_FUNCTIONS, fsdp_types)
        self.GRAD_SAMPLERS = _with_fsdp_types(type(self).GRAD_SAMPLERS, fsdp_types)
        self.NORM_SAMPLERS = _with_fsdp_types(type(self).NORM_SAMPLERS, fsdp_types)
        exact = set(type(self).EXACT_NORM_TYPES)
        self.EXACT_NORM_TYPES = exact | {c for c, b in fsdp_types.items() if b in exact}
        self.STASH_GRAD_SAMPLERS = _with_fsdp_types(type(self).STASH_GRAD_SAMPLERS, fsdp_types)
        # Opacus prepares a functorch copy of every hooked module whose type has no grad sampler
        # (a deepcopy, which FSDP2 refuses for a sharded module, and a copy of the shards for
        # one in an enclosing group): a module of a sketched or exact type without one (e.g.
        # LlamaRMSNorm) takes its per-sample gradient function, if it has one, or a stand-in;
        # its route is sketched or exact, so neither is called for its norm.
        for cls in {type(sub) for sub in m.modules()}:
            if cls not in self.GRAD_SAMPLERS and cls in self.SKETCHED_NORM_SAMPLERS:
                self.GRAD_SAMPLERS[cls] = self.STASH_GRAD_SAMPLERS.get(cls, _no_grad_sampler)
        # The sharded parameters, registered now (outside forward and backward): the ones the
        # optimizer holds and the step state is keyed by (see _sharded_view).
        self._sharded_params = {
            id(sub): dict(sub.named_parameters(recurse=False))
            for sub in m.modules()
            if any(True for _ in sub.parameters(recurse=False))
        }
        self._owning_modules = [
            sub for sub in m.modules() if any(True for _ in sub.parameters(recurse=False))
        ]
        super().__init__(m, **kwargs)
        # Inside the root's forward and backward (and an enclosing group's), the modules it
        # owns register unsharded parameters: the trainable-set check runs on the sharded ones.
        self.private_step.trainable = _ShardedTrainableSet(
            self.private_step.trainable, self._sharded_model_view
        )
        functorch = [r.name for r in self._routes.values() if r.path is NormPath.FUNCTORCH]
        if functorch:  # _refuse_functorch refuses these first; the routes are the reference
            self.cleanup()
            raise NotImplementedError(_functorch_message(functorch, []))
        # Gradients are summed over ranks by FSDP2's reduce-scatter (two passes) as by the
        # book-keeping reduce-scatter; the optimizer divides by the expected batch size.
        self._fsdp_modules = [sub for sub in m.modules() if isinstance(sub, FSDPModule)]
        for sub in self._fsdp_modules:
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)

    def _refuse_functorch(self, m: nn.Module, *, force_functorch: bool) -> None:
        """Refuse, before Opacus attaches hooks, a trainable module that would take functorch.

        Opacus prepares a functorch module when it attaches its hooks (``prepare_layer``
        deep-copies it), and FSDP2 refuses a deep copy with a bare ``AssertionError``; a module
        left unsharded would get there too. A module whose base type (FSDP2's ``FSDPLinear``
        unwrapped) has no sketched norm sampler, ghost norm sampler or grad sampler (or every
        non-sketched one under ``force_functorch``) takes that path.

        Raises:
            NotImplementedError: Naming the modules and their types: register a sampler, or
                freeze them.
        """
        sketched = type(self).SKETCHED_NORM_SAMPLERS
        samplers = {**type(self).GRAD_SAMPLERS, **type(self).NORM_SAMPLERS}
        bad = []
        for name, sub in m.named_modules():
            if not any(p.requires_grad for p in sub.parameters(recurse=False)):
                continue
            base = fsdp_base_type(sub)
            if base in sketched or (base in samplers and not force_functorch):
                continue
            bad.append((name or "<root>", base.__name__))
        if bad:
            raise NotImplementedError(
                _functorch_message([n for n, _ in bad], sorted({t for _, t in bad}))
            )

    @contextlib.contextmanager
    def _sharded_view(self, module: nn.Module) -> Iterator[None]:
        """Register ``module``'s sharded parameters on it for the duration of a hook.

        FSDP2 registers the unsharded parameters during the forward and backward of the group
        owning the module (its own, or an enclosing one: a decoder layer's, the root's) and the
        sharded DTensors outside them (``unsafe_setattr_param`` on the module's registered
        parameters); which one a hook sees depends on the order of FSDP2's and Opacus' hooks
        and on the group. The step state
        is keyed by parameter, so every hook sees the sharded ones (the optimizer's). No hook
        of this class reads parameter values (functorch, which would, is refused): the norms
        come from activations and output gradients alone.
        """
        registered = registered_parameters(module)
        swapped: dict[str, Any] = {}
        for name, sharded in self._sharded_params.get(id(module), {}).items():
            current = registered.get(name)
            if current is not sharded:
                swapped[name] = current
                registered[name] = sharded
        try:
            yield
        finally:
            for name, current in swapped.items():
                registered[name] = current

    @contextlib.contextmanager
    def _sharded_model_view(self) -> Iterator[None]:
        """:meth:`_sharded_view` for every module of the model at once."""
        with contextlib.ExitStack() as stack:
            for sub in self._owning_modules:
                stack.enter_context(self._sharded_view(sub))
            yield

    def capture_activations_hook(self, module: nn.Module, *args: Any) -> None:
        """The randomized-clipping forward hook, on the sharded parameters."""
        with self._sharded_view(module):
            self.private_step.forward_hook(module, *args)

    def capture_backprops_hook(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        """The randomized-clipping backward hook, on the sharded parameters."""
        with self._sharded_view(module):
            self.private_step.backward_hook(module, *args, **kwargs)


def _no_grad_sampler(layer: nn.Module, *_args: Any) -> dict[nn.Parameter, torch.Tensor]:
    """The stand-in grad sampler of a sharded sketched type without a per-sample gradient
    function (Opacus' table only; the module's norms take its sketched route).

    Raises:
        NotImplementedError: Always.
    """
    raise NotImplementedError(
        f"{type(layer).__name__} has a sketched norm sampler but no per-sample gradient "
        "function: its per-sample gradients cannot be formed under FSDP2"
    )


class _ShardedTrainableSet:
    """A :class:`~opacus_rc.grad_sample.checks.TrainableSetGuard` checked on the sharded
    parameters (an enclosing FSDP2 group registers unsharded ones during its forward)."""

    def __init__(self, guard: Any, view: Any) -> None:
        self._guard = guard
        self._view = view

    @property
    def parameter_ids(self) -> frozenset[int]:
        """As the guard's."""
        return self._guard.parameter_ids

    def check(self) -> None:
        """The guard's check, with every module's sharded parameters registered.

        Raises:
            RuntimeError: As the guard's.
        """
        with self._view():
            self._guard.check()


def _functorch_message(names: list[str], types: list[str]) -> str:
    of = f" (types {types})" if types else ""
    return (
        f"modules {names[:5]}{of} own trainable parameters but have no grad sampler or "
        "sketched norm sampler: in one process they take Opacus' functorch path, which "
        "evaluates the module with its parameters; under FSDP2 those are shards, so they are "
        "refused. Freeze them (p.requires_grad_(False) for their parameters), or register "
        "a grad sampler for their type (opacus.grad_sample.register_grad_sampler) or a "
        "sketched norm sampler (opacus_rc.grad_sample.register_sketched_norm_sampler)"
    )


def _trainable(m: nn.Module) -> Iterable[nn.Parameter]:
    return (p for _, p in trainable_parameters(m))


def _add_reduced(p: nn.Parameter, local_sum: torch.Tensor | None) -> None:
    """``p.grad += reduce_scatter(local_sum)`` for a sharded ``p`` (zeros if ``None``)."""
    if not isinstance(p, DTensor):
        raise TypeError(
            "a trainable parameter of the FSDP2 model is not a DTensor; every module with "
            "trainable parameters must be fully_shard-ed"
        )
    mesh = p.device_mesh
    local = p.to_local()
    if local_sum is None:
        local_sum = torch.zeros(p.shape, device=local.device, dtype=local.dtype)
    local_sum = local_sum.to(device=local.device, dtype=local.dtype).contiguous()
    partial = DTensor.from_local(local_sum, mesh, [Partial()] * mesh.ndim, run_check=False)
    reduced = partial.redistribute(mesh, p.placements)
    if p.grad is None:
        p.grad = reduced
    else:
        p.grad.add_(reduced)


class GradSampleModuleRandomizedClippingFSDP(
    _FSDPRandomizedClippingMixin, GradSampleModuleRandomizedClipping
):
    """:class:`~opacus_rc.grad_sample.GradSampleModuleRandomizedClipping` for an FSDP2 model.

    Arguments, attributes and errors as the single-process class; in addition the model must
    be ``fully_shard``-ed at its root and every trainable parameter managed by an FSDP2 group
    (:func:`check_fsdp_model`; a tied embedding / LM head in one group). Use with
    :class:`~opacus_rc.optimizers.FSDPRandomizedClipOptimizer`. See the module docstring.
    """


class GradSampleHooksRandomizedClippingFSDP(
    _FSDPRandomizedClippingMixin, GradSampleHooksRandomizedClipping
):
    """Hooks-only twin of :class:`GradSampleModuleRandomizedClippingFSDP` (``wrap_model=False``)."""
