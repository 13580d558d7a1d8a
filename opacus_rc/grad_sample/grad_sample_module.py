"""Grad-sample modules for randomized clipping (DP-SGD-RC; docs/architecture.md#architecture-step).

:class:`GradSampleModuleRandomizedClipping` wraps a model like Opacus'
``GradSampleModuleFastGradientClipping`` (ghost clipping);
:class:`GradSampleHooksRandomizedClipping` attaches the same hooks without wrapping
(``wrap_model=False``). Both share :class:`_RandomizedClippingMixin`, which holds the hooks only;
the rest lives in one module each:

* :mod:`~opacus_rc.grad_sample.routing`: how each module's norm is computed (sketched, exact
  such as ``nn.Embedding``'s, Opacus' per-sample gradients, functorch, or refused), decided once and
  used by the hooks, book-keeping, the log line and the report;
* :mod:`~opacus_rc.grad_sample.step`: the :class:`~opacus_rc.grad_sample.step.StepState` that
  records one step and enforces its invariant (every gradient the optimizer releases got a
  per-sample norm and a clip factor in this step's private backward);
* :mod:`~opacus_rc.grad_sample.tied`: the joint sketch of a weight tied between an input
  embedding and an LM head (the norm of the summed gradient);
* :mod:`~opacus_rc.grad_sample.bookkeeping`: the one-backward clipped sum (Bu, Wang, Zha and
  Karypis, ICML 2023);
* :mod:`~opacus_rc.grad_sample.checks`: training mode, tied and late-trainable parameters,
  parameters used outside their module's forward.

Book-keeping policy (``RandomizedClippingConfig.bookkeeping``): ``True`` (default) runs one
backward pass per step wherever every route supports it and the model is not distributed, with
activation checkpointing too (HF ``gradient_checkpointing_enable()``, either ``use_reentrant``,
or ``torch.utils.checkpoint``): in a checkpointed step each ``nn.Linear`` keeps whichever is
smaller for its clipped sum, its per-sample gradients (``p d + p`` floats per sample; its norm
is then exact) or its input and output gradient (``T (p + d)``), so the stored tensors do not
undo checkpointing's memory saving (:mod:`~opacus_rc.grad_sample.norms`); embeddings and a tied
weight's embedding side keep their ids and output gradient. ``"always"`` keeps every layer's
input and output gradient, checkpointed or not; ``False`` runs two backward passes.

Sketch randomness: one ``torch.Generator`` per device, created lazily on the device of the
tensors it draws for and seeded from the operating system's CSPRNG (:mod:`secrets`), unless the
caller passes one (then accounted as not secret). Probes are drawn inside the backward hook,
fresh for every step, sample and layer (docs/privacy/estimators.md#estimators-hutchinson,
docs/privacy/threat_models.md#threat-models-conditions), and never stored or logged.

The clip factor is ``min(1, C / (n_hat_i + 1e-6))`` with ``n_hat_i`` the square root of the sum
over parameters of the squared per-parameter norms (docs/privacy/mechanism.md#mechanism-reduction),
the same form as Opacus' ghost clipping so that exact and sketched runs are comparable.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from opacus.grad_sample.grad_sample_module import (
    GradSampleHooks,
)
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
)
from opacus.utils.module_utils import trainable_parameters
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from opacus_rc._compat.opacus import (
    WRAPPED_MODULE_ATTR,
    SequenceBias,
    count_down_use,
    forward_count,
    wrapped_module,
    wrapped_module_if_built,
)
from opacus_rc.config import RandomizedClippingConfig
from opacus_rc.grad_sample.checkpointing import NoEarlyStop, in_backward, in_checkpointed_forward
from opacus_rc.grad_sample.checks import (
    ParameterUseCheck,
    TrainableSetGuard,
    check_parametrizations,
    check_peft_dora,
    check_tied_parameters,
    check_training_mode,
    strip_grad_sample_hooks,
)
from opacus_rc.grad_sample.distributed import ReducerOff
from opacus_rc.grad_sample.functorch import FunctorchGradSampler
from opacus_rc.grad_sample.norms import STASH_GRAD_SAMPLERS, ModuleNorms
from opacus_rc.grad_sample.private_step import PrivateBackwardMixin
from opacus_rc.grad_sample.registry import (
    CLIPPED_SUM_FUNCTIONS,
    EXACT_NORM_TYPES,
    FORWARD_INPUT_ADAPTERS,
    SKETCHED_NORM_SAMPLERS,
    ClippedSumFunction,
    ForwardInputAdapter,
    SketchedNormSampler,
    check_modules,
)
from opacus_rc.grad_sample.routing import (
    NormPath,
    NormRoute,
    find_tied_groups,
    refuse_unsupported,
    resolve_norm_routes,
)
from opacus_rc.grad_sample.step import StepPhase, StepState
from opacus_rc.grad_sample.tied import TiedSketches
from opacus_rc.grad_sample.units import drop_open_unit, pack_for_units
from opacus_rc.sketching import SketchGenerators, SketchSpec, get_estimator

__all__ = ["GradSampleHooksRandomizedClipping", "GradSampleModuleRandomizedClipping"]

logger = logging.getLogger(__name__)

#: Paths whose norm comes from a per-module norm sampler (no tied weights, one use per step).
_NORM_SAMPLED = (NormPath.SKETCHED, NormPath.EXACT, NormPath.GHOST)

#: Exact module type -> whether a module's own tensors are batch first, where that is its own
#: attribute rather than the model's ``batch_first``: inside Opacus' ``DPMultiheadAttention``
#: the ``SequenceBias`` layers (``add_bias_kv=True``) always see ``(L, B, E)`` keys and values,
#: whatever the model's layout (with the model's ``batch_first=True`` the batch was read from the
#: sequence axis, and the backward hook failed with a shape error for every step).
_OWN_LAYOUT: dict[type[nn.Module], Any] = {SequenceBias: lambda m: bool(m.batch_first)}


def _fallback_warning(why: str) -> None:
    """Tell the user (once per module) that book-keeping was requested but two passes run.

    A warning, not a log line: Opacus configures the root logger at import, which hides INFO.
    """
    warnings.warn(
        f"book-keeping (one backward pass) is off, two backward passes per step: {why}. The "
        "clipped gradient and the guarantee are the same; pass bookkeeping=False to choose two "
        "passes explicitly (this warning then goes away).",
        UserWarning,
        stacklevel=4,
    )


def _strided_index(t: Any) -> bool:
    """A non-contiguous integer tensor (e.g. expanded token or position ids)."""
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_contiguous()


def _ancestors_of(root: nn.Module, hooked: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules of ``root`` (``root`` included) with a hooked module strictly below them."""
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


def _module_device(m: nn.Module) -> torch.device:
    for p in m.parameters():
        return p.device
    return torch.device("cpu")


class _RandomizedClippingMixin(PrivateBackwardMixin):
    """Shared hooks of the wrapping and the hooks-only randomized-clipping classes.

    Must come before an Opacus ``...FastGradientClipping`` class in the bases.
    """

    #: Sketched samplers, looked up by exact module type before Opacus' exact ones.
    SKETCHED_NORM_SAMPLERS: dict[type[nn.Module], SketchedNormSampler] = SKETCHED_NORM_SAMPLERS
    #: Clipped-sum functions of the sketched types (book-keeping), by exact module type.
    CLIPPED_SUM_FUNCTIONS: dict[type[nn.Module], ClippedSumFunction] = CLIPPED_SUM_FUNCTIONS
    #: Types of SKETCHED_NORM_SAMPLERS whose sampler is exact.
    EXACT_NORM_TYPES: set[type[nn.Module]] = EXACT_NORM_TYPES
    #: Per-sample gradient functions a checkpointed book-keeping step may stash, by exact type.
    STASH_GRAD_SAMPLERS: dict[type[nn.Module], Any] = STASH_GRAD_SAMPLERS
    #: How one forward call is stored for the backward hook, by exact type (nn.EmbeddingBag).
    FORWARD_INPUT_ADAPTERS: dict[type[nn.Module], ForwardInputAdapter] = FORWARD_INPUT_ADAPTERS

    # Class defaults for hooks that could fire before __init__ ends.
    _bookkeeping: bool = False
    _reducer_off: ReducerOff | None = None
    #: Reach a module whose inputs carry no gradient through its output's graph edge, not its
    #: parameters, in the book-keeping first pass (FSDP2: the registered parameters are shards
    #: that are not in the autograd graph).
    _first_pass_output_edges: bool = False
    _step: StepState | None = None
    _tied: TiedSketches | None = None
    #: ``id(module) -> kwargs`` of a hooked module's call in progress (forward pre-hook).
    _call_kwargs: dict[int, dict[str, Any]] | None = None

    def __init__(
        self,
        m: nn.Module,
        *,
        config: RandomizedClippingConfig | None = None,
        **options: Any,
    ) -> None:
        # Everything is validated (once, by the config) before Opacus attaches a single hook.
        if config is None:
            config = RandomizedClippingConfig(**options)
        elif options:
            raise TypeError(f"pass either config= or the options, not both: {sorted(options)}")
        elif not isinstance(config, RandomizedClippingConfig):
            raise TypeError(
                f"config must be a RandomizedClippingConfig, got {type(config).__name__}"
            )
        if hasattr(m, "autograd_grad_sample_hooks"):
            raise ValueError(
                "the model already has Opacus grad-sample hooks attached; pass the plain "
                "nn.Module (call cleanup() on the previous hooks first)"
            )
        check_training_mode(m)
        check_modules(m)  # e.g. nn.Embedding(max_norm=...), refused before any forward
        check_peft_dora(m)
        check_parametrizations(m)  # weight_norm, spectral_norm: computed outside the forward
        names = {id(sub): name for name, sub in m.named_modules()}
        hooked = list(self.iterate_submodules(m))  # type: ignore[attr-defined]
        tied_groups = find_tied_groups(hooked, names=names)  # embedding tied to an LM head
        routes = resolve_norm_routes(
            hooked,
            names=names,
            sketched=self.SKETCHED_NORM_SAMPLERS,
            exact_types=self.EXACT_NORM_TYPES,
            clipped_sums=self.CLIPPED_SUM_FUNCTIONS,
            grad_samplers=self.GRAD_SAMPLERS,  # type: ignore[attr-defined]
            norm_samplers=self.NORM_SAMPLERS,  # type: ignore[attr-defined]
            force_functorch=config.force_functorch,
            tied=tied_groups,
        )
        refuse_unsupported(routes)
        # Built before any hook is attached: the replayed copies carry none.
        functorch = {
            id(sub): FunctorchGradSampler(sub, batch_first=config.batch_first)
            for sub in hooked
            if getattr(routes.get(id(sub)), "path", None) is NormPath.FUNCTORCH
        }
        check_tied_parameters(
            m,
            norm_sampled=lambda sub: (
                getattr(routes.get(id(sub)), "path", None) in (*_NORM_SAMPLED, NormPath.TIED)
            ),
            supported={id(g.weight) for g in tied_groups},
        )
        try:
            super().__init__(  # type: ignore[call-arg]
                m,
                batch_first=config.batch_first,
                loss_reduction=config.loss_reduction,
                strict=config.strict,
                force_functorch=config.force_functorch,
                max_grad_norm=config.max_grad_norm,
                use_ghost_clipping=True,
            )
        except BaseException:
            strip_grad_sample_hooks(m)  # Opacus may fail after attaching some hooks
            raise
        try:
            self._config = config
            self._routes = routes
            self._module_names = names
            self._param_names = {id(p): name for name, p in trainable_parameters(m)}
            estimator = get_estimator(config.sketch)
            if config.sketch_spec.head_dim is not None:
                estimator = functools.partial(estimator, head_dim=config.sketch_spec.head_dim)
            self._generators = SketchGenerators(user_generator=config.sketch_generator)
            if config.sketch_generator is not None:
                warnings.warn(
                    "a sketch_generator was passed: the 'hidden' privacy guarantee of randomized "
                    "clipping then holds only if its seed stays secret; the reported SketchSpec "
                    "has secret=False",
                    UserWarning,
                    stacklevel=3,
                )
            self._estimator = estimator  # also the norm of a unit cut across batches (units.py)
            self._step = StepState(name_of=self._name_of)
            self._tied = TiedSketches(tied_groups, name_of=self._name_of)
            self._norms = ModuleNorms(
                sketched=self.SKETCHED_NORM_SAMPLERS,
                grad_samplers=self.GRAD_SAMPLERS,  # type: ignore[attr-defined]
                norm_samplers=self.NORM_SAMPLERS,  # type: ignore[attr-defined]
                estimator=estimator,
                sketch_dim=config.sketch_dim,
                generator_for=self.generator_for,
                tied=self._tied,
                name_of=self._name_of,
                stash_grad_samplers=self.STASH_GRAD_SAMPLERS,
                functorch=functorch,
            )
            for _, p in trainable_parameters(m):
                self.autograd_grad_sample_hooks.append(
                    p.register_post_accumulate_grad_hook(self._record_gradient)
                )
            self._uses = ParameterUseCheck(
                m, name_of=self._name_of, active=lambda: self.hooks_enabled
            )
            self._uses.register(self.autograd_grad_sample_hooks)
            self._call_kwargs = {}
            self._signatures: dict[type[nn.Module], inspect.Signature] = {}
            for sub in hooked:
                self.autograd_grad_sample_hooks.append(
                    sub.register_forward_pre_hook(self._record_call_kwargs, with_kwargs=True)
                )
            # Early stop off in the forward of the model and of every module above a hooked one,
            # so that a submodule called directly (model.body(x), then model.head(h)) records
            # every layer of its checkpointed regions too.
            NoEarlyStop(
                [m, *_ancestors_of(m, hooked)],
                self.autograd_grad_sample_hooks,
                active=lambda: self.hooks_enabled,
            )
            self._trainable = TrainableSetGuard(m, name_of=self._name_of)
            self._log_norm_paths()
            self._reducer_off = ReducerOff(m)  # the DP optimizer all-reduces the clipped sum
            self._bookkeeping = self._resolve_bookkeeping(m, requested=bool(config.bookkeeping))
            self._told_checkpointing = False
        except BaseException:
            self.cleanup()
            raise

    # ------------------------------------------------------------------------------------------
    # Public properties
    # ------------------------------------------------------------------------------------------

    @property
    def clipping_config(self) -> RandomizedClippingConfig:
        """The validated options this module was built with (shared with the optimizer).

        (Not ``config``: a wrapped Hugging Face model's ``config`` is forwarded to the model.)
        """
        return self._config

    @property
    def sketch_spec(self) -> SketchSpec:
        """The :class:`~opacus_rc.sketching.SketchSpec` this module actually uses."""
        return self._config.sketch_spec

    @property
    def step_state(self) -> StepState:
        """The :class:`~opacus_rc.grad_sample.step.StepState` of the current step."""
        assert self._step is not None
        return self._step

    @property
    def parameter_use_check(self) -> ParameterUseCheck:
        """The check of parameters used outside their module's forward (its forward spans)."""
        return self._uses

    @property
    def norm_routes(self) -> dict[str, NormRoute]:
        """``{module name: NormRoute}``: how each hooked module's norm is computed."""
        return {r.name: r for r in self._routes.values()}

    @property
    def per_sample_gradient_norms(self) -> torch.Tensor:
        """``(B,)`` float64 norm estimates of the whole model from the last clip factors.

        Readable from the clip factors of a step until the next hooked forward pass. These are
        not privatized: for debugging and logging only.

        Raises:
            AttributeError: If no clip factors were computed since the last forward pass.
        """
        norms = None if self._step is None else self._step.per_sample_gradient_norms
        if norms is None:
            raise AttributeError(
                "per_sample_gradient_norms is not set: they exist from the private backward "
                "(criterion(...).backward()) of a step until the next forward pass"
            )
        return norms

    @per_sample_gradient_norms.setter
    def per_sample_gradient_norms(self, value: Any) -> None:
        # Opacus' base __init__ assigns it; the value lives in the step state.
        if self._step is not None and value is not None:
            self._step.per_sample_gradient_norms = value

    @property
    def norm_samples(self) -> dict[str, torch.Tensor]:
        """``{parameter name: (B,) norm}``: this step's per-parameter norms (after its backward),
        or those of the last clip factors (until the next forward). Not privatized."""
        return {self._name_of(p): t for p, t in self.step_state.norm_samples.items()}

    def generator_for(self, device: torch.device | str) -> torch.Generator:
        """The sketch generator for tensors on ``device``
        (:class:`~opacus_rc.sketching.SketchGenerators`)."""
        return self._generators.for_device(device)

    @property
    def sketch_generator(self) -> torch.Generator:
        """The generator probes for the model's own device are drawn from (never the noise's)."""
        return self.generator_for(_module_device(wrapped_module(self)))

    @property
    def bookkeeping(self) -> bool:
        """Whether steps can use book-keeping (one backward pass) rather than two passes.

        ``True`` only if book-keeping was requested and every trainable module supports it
        (decided at construction; under DDP/DPDDP and FSDP2 too). Activation-checkpointed steps
        use it too: with ``bookkeeping=True`` each layer then keeps the smaller of its
        per-sample gradients and its input and output gradient (:attr:`step_smaller_stash`,
        :mod:`~opacus_rc.grad_sample.norms`); ``bookkeeping="always"`` keeps the inputs and
        output gradients everywhere.
        """
        return self._bookkeeping

    @property
    def step_smaller_stash(self) -> bool:
        """Whether the current step's layers keep the smaller of their per-sample gradients and
        their input and output gradient: a book-keeping step whose forward ran activation-
        checkpointed regions, with ``bookkeeping=True`` (decided with :attr:`bookkeeping`).
        Layers that keep per-sample gradients get exact norms (docs/privacy/envelope.md, Lemma
        D: the step is accounted with the same sketch spec)."""
        return self._step is not None and self._step.smaller_stash

    # ------------------------------------------------------------------------------------------
    # Construction-time decisions
    # ------------------------------------------------------------------------------------------

    def _name_of(self, obj: Any) -> str:
        """Qualified name of a module or trainable parameter (for messages)."""
        name = self._param_names.get(id(obj)) or self._module_names.get(id(obj))
        if name:
            return name
        return type(obj).__name__ if isinstance(obj, nn.Module) else "<unnamed>"

    def _log_norm_paths(self) -> None:
        """Log once, at construction, which norm path each hooked module takes."""
        if not logger.isEnabledFor(logging.INFO):
            return
        for route in self._routes.values():
            logger.info(
                "module %r (%s): %s",
                route.name,
                route.module_type,
                route.describe(self._config.sketch_spec),
            )

    def _resolve_bookkeeping(self, m: nn.Module, *, requested: bool) -> bool:
        """Whether book-keeping can be used; logs once (INFO) why not if it was requested.

        Available iff every route supports it (:attr:`NormRoute.supports_bookkeeping`). Under
        DDP/DPDDP each rank forms its clipped sum from its own samples and the distributed
        optimizer all-reduces it once (:mod:`~opacus_rc.grad_sample.distributed`).
        """
        if not requested:
            return False
        blockers = [
            f"'{r.name}' ({r.module_type}): "
            + (
                "Opacus ghost norm, no per-sample gradient"
                if r.path is NormPath.GHOST
                else "sketched norm without a clipped-sum function"
            )
            for r in self._routes.values()
            if not r.supports_bookkeeping
        ]
        if blockers:
            _fallback_warning("forced by " + "; ".join(blockers[:5]))
            return False
        return True

    # ------------------------------------------------------------------------------------------
    # Hooks
    # ------------------------------------------------------------------------------------------

    def _record_gradient(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ``param`` got a gradient in the private backward."""
        if self.hooks_enabled and self._step is not None:  # type: ignore[attr-defined]
            self._step.record_gradient(param)

    def _record_call_kwargs(self, module: nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook: keep the keyword arguments of this call for the forward hook
        (Opacus' forward hook only sees the positional ones)."""
        if self._call_kwargs is None:
            return
        if kwargs:
            self._call_kwargs[id(module)] = kwargs
        else:
            self._call_kwargs.pop(id(module), None)

    def _forward_inputs(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None
    ) -> list[torch.Tensor]:
        """The tensors stored for ``module``'s backward hook from one call ``module(*args,
        **kwargs)``.

        Keyword arguments are bound to their positions in ``forward``'s signature
        (``fc(input=x)`` stores ``[x]``); a type with a forward-input adapter
        (:data:`~opacus_rc.grad_sample.registry.FORWARD_INPUT_ADAPTERS`, e.g.
        ``nn.EmbeddingBag``) gets the bound inputs, ``None`` included; for any other type the
        trailing ``None`` inputs are dropped and every other input must be a tensor.

        Raises:
            TypeError: Naming the module: keyword-only arguments (their values would not reach
                the per-sample gradient), arguments that do not match ``forward``'s signature,
                or a non-tensor input of a type without an adapter.
        """
        name = f"'{self._name_of(module)}' ({type(module).__name__})"
        inputs: list[Any] = list(args)
        if kwargs:
            try:
                signature = self._signatures.get(type(module))
                if signature is None:  # type(module).forward: ``self`` first
                    signature = self._signatures[type(module)] = inspect.signature(
                        type(module).forward
                    )
                bound = signature.bind(module, *args, **kwargs).arguments
            except (TypeError, ValueError) as err:
                raise TypeError(
                    f"module {name} was called with keyword argument(s) {sorted(kwargs)} that "
                    f"do not match its forward signature ({err})"
                ) from err
            kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            positional = [q for q in signature.parameters.values() if q.kind in kinds][1:]
            keyword_only = sorted(set(kwargs) - {q.name for q in positional})
            if keyword_only:
                raise TypeError(
                    f"module {name} was called with keyword-only argument(s) {keyword_only}: "
                    "its per-sample gradient is computed from its positional inputs, which "
                    "would not carry them. Pass them positionally, or keep them out of the "
                    "module's forward (e.g. as attributes)"
                )
            last = max((i for i, q in enumerate(positional) if q.name in bound), default=-1)
            inputs = [bound.get(q.name, q.default) for q in positional[: last + 1]]
            for q in signature.parameters.values():
                if q.kind is inspect.Parameter.VAR_POSITIONAL and q.name in bound:
                    inputs.extend(bound[q.name])
        adapter = self.FORWARD_INPUT_ADAPTERS.get(type(module))
        if adapter is not None:
            return adapter(module, inputs, batch_first=self._config.batch_first)
        while inputs and inputs[-1] is None:
            inputs.pop()
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"module {name} was called with a {type(t).__name__} as input {i}: its "
                    "per-sample gradient is computed from tensor inputs only. Pass only "
                    "tensors to a layer with trainable parameters (keep options as attributes)"
                )
        return inputs

    def _check_single_output(self, module: nn.Module, output: Any) -> None:
        """A module on the functorch path must return one tensor: its backward hook sees the
        gradient of the first output only, and the replay multiplies the output by it.

        Raises:
            TypeError: Naming the module and what it returned.
        """
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"module '{self._name_of(module)}' ({type(module).__name__}) has no grad "
                f"sampler and returned a {type(output).__name__}, not a tensor: its per-sample "
                "gradient (functorch) can only be computed for a layer with one tensor output. "
                "Return one tensor, split the layer, or register a grad sampler for it"
            )

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
        kwargs = None if self._call_kwargs is None else self._call_kwargs.pop(id(module), None)
        recording = (
            self.hooks_enabled  # type: ignore[attr-defined]
            and torch.is_grad_enabled()
            and module.training
            and self._step is not None
        )
        if recording and any(p.requires_grad for p in module.parameters(recurse=False)):
            try:
                stored_input = self._forward_inputs(module, tuple(forward_input), kwargs)
                route = self._routes.get(id(module))
                if route is not None and route.path is NormPath.FUNCTORCH:
                    self._check_single_output(module, _forward_output)
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
            and route.path in _NORM_SAMPLED
            and any(forward_count(p) > 1 for _, p in trainable_parameters(module))
        ):
            self._drop_after_hook_error()
            raise self._reuse_error(module)
        # Index inputs expanded over the batch (position_ids.expand(B, -1), the fix for Opacus
        # issue 841) are non-contiguous; Opacus' Embedding norm sampler calls .view() on them.
        stored = module.activations[-1] if module.activations else []
        if any(_strided_index(t) for t in stored):
            module.activations[-1] = [t.contiguous() if _strided_index(t) else t for t in stored]

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

    def cleanup(self) -> None:
        """Remove all hooks and every attribute Opacus or this class added to the model."""
        if self._step is not None:
            self._step.consume()  # frees every stored tensor
        if self._tied is not None:
            self._tied.clear()
        if self._reducer_off is not None:
            self._reducer_off.restore()
        drop_open_unit(self)
        super().cleanup()  # type: ignore[misc]
        strip_grad_sample_hooks(wrapped_module(self))


def _is_empty_batch_call(args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int) -> bool:
    """Whether a forward's tensor arguments (nested in lists, tuples and mappings) hold an
    empty batch: some tensor with a dimension ``batch_dim`` of size 0."""
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.dim() > batch_dim and value.shape[batch_dim] == 0:
                return True
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif hasattr(value, "values") and callable(value.values):
            stack.extend(value.values())
    return False


class GradSampleModuleRandomizedClipping(
    _RandomizedClippingMixin, GradSampleModuleFastGradientClipping
):
    """Wraps a model to compute sketched per-sample norms and clip factors (DP-SGD-RC).

    Attributes the wrapper does not have are read from the wrapped model (``generate``, a
    Hugging Face ``config``...), so the wrapped model behaves as the model. Use it like Opacus'
    ``GradSampleModuleFastGradientClipping``: with
    :class:`~opacus_rc.optimizers.RandomizedClipOptimizer` and
    :class:`~opacus_rc.optimizers.DPLossRandomizedClipping`, whose ``backward()`` runs one
    backward pass and :meth:`apply_clipped_sum` when :attr:`bookkeeping` is true, else both
    passes. (Opacus' own ``DPLossFastGradientClipping`` always runs both passes; it works too.)

    Args:
        m: The model (in training mode).
        config: The validated options (:class:`~opacus_rc.config.RandomizedClippingConfig`),
            or None to build them from ``**options``.
        **options: The fields of :class:`~opacus_rc.config.RandomizedClippingConfig`
            (``max_grad_norm`` required; ``sketch``, ``sketch_dim``, ``sketch_head_dim``,
            ``sketch_generator``, ``secure_mode``, ``batch_first``, ``loss_reduction``,
            ``strict``, ``force_functorch``, ``bookkeeping``), validated there.

    Attributes:
        bookkeeping: Read-only; whether book-keeping (a single backward pass) is used: only if
            requested and every route supports it.
        norm_routes: How each hooked module's norm is computed.
        step_state: The step protocol's state.
        clipping_config: The validated options.

    Raises:
        TypeError: Both ``config`` and options, or invalid option types.
        ValueError: Invalid options (see the config), an eval-mode model, hooks already
            attached.
        NotImplementedError: A trainable parameter tied between a norm-sampled module and
            another module (except one ``nn.Embedding`` weight tied to one ``nn.Linear``
            weight, an LM head: :mod:`~opacus_rc.grad_sample.tied`), a module whose norm
            cannot be computed
            (:class:`~opacus_rc.grad_sample.routing.UnsupportedModuleError`), or (at forward
            time) a norm-sampled module used twice per step.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward. If it raises, what it recorded is dropped; an in-place change of
        a hooked module's output is explained."""
        try:
            return super().forward(*args, **kwargs)
        except BaseException as err:
            # A forward that raised half-way (e.g. an empty batch a model cannot take) must not
            # leave recorded inputs behind for the next step.
            self.discard_recorded()
            batch_dim = 0 if self.clipping_config.batch_first else 1
            if isinstance(err, Exception) and _is_empty_batch_call(args, kwargs, batch_dim):
                raise RuntimeError(
                    f"the model's forward raised on an empty batch ({type(err).__name__}: "
                    f"{err}). Poisson sampling draws an empty batch (B = 0) with probability "
                    "(1 - q)^N at every step, and this model cannot take B = 0. The step "
                    "must still be taken, noised and accounted: for an empty batch call "
                    "optimizer.noise_only_step() instead of the forward, backward and "
                    "step() (e.g. `if len(labels) == 0: optimizer.noise_only_step(); "
                    "continue`), or pass rand_on_empty=True to make_private (a batch of one "
                    "random input that depends on no record)"
                ) from err
            if not isinstance(err, RuntimeError) or (
                "BackwardHookFunction is a view and is being modified inplace" not in str(err)
            ):
                raise
            inplace = [
                name or "<root>"
                for name, sub in wrapped_module(self).named_modules()
                if getattr(sub, "inplace", False) is True
            ]
            raise RuntimeError(
                "an in-place operation modified the output (or input) of a module whose "
                "per-sample norm is measured: its backward hook must see that tensor unchanged. "
                + (
                    f"Modules with inplace=True: {inplace[:5]}: set inplace=False. "
                    if inplace
                    else ""
                )
                + "Replace in-place updates such as h += x by h = h + x. (Opacus' "
                "ModuleValidator.fix does not change inplace=True.)"
            ) from err

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # Our own attributes (and a property that raised) are not forwarded.
            inner = None if name == WRAPPED_MODULE_ATTR else wrapped_module_if_built(self)
            if inner is None or hasattr(type(self), name):
                raise
            return getattr(inner, name)


class GradSampleHooksRandomizedClipping(
    _RandomizedClippingMixin, GradSampleHooksFastGradientClipping
):
    """Hooks-only twin of :class:`GradSampleModuleRandomizedClipping` (``wrap_model=False``).

    Attaches the same hooks to the model without wrapping it: keep using the original model and
    call :meth:`cleanup` to detach. Arguments and errors are those of
    :class:`GradSampleModuleRandomizedClipping`.
    """
