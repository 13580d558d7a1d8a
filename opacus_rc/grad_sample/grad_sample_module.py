"""Grad-sample modules for randomized clipping (DP-SGD-RC; docs/architecture.md#architecture-step).

:class:`GradSampleModuleRandomizedClipping` wraps a model like Opacus'
``GradSampleModuleFastGradientClipping`` (ghost clipping);
:class:`GradSampleHooksRandomizedClipping` attaches the same hooks without wrapping
(``wrap_model=False``). Both share :class:`_RandomizedClippingMixin`, which builds them (checks,
routes, generators, hooks) and holds their public properties. Everything about one step lives in
the :class:`~opacus_rc.grad_sample.private_step.PrivateStep` each holds as ``private_step``
(composition: Opacus' hook methods are one-line delegations to it);
:mod:`~opacus_rc.grad_sample.routing` decides once how each module's norm is computed.

Sketch randomness: one ``torch.Generator`` per device, created lazily on the device of the
tensors it draws for and seeded from the operating system's CSPRNG (:mod:`secrets`), unless the
caller passes one (then accounted as not secret). Probes are drawn inside the backward hook,
fresh for every step, sample and layer (docs/privacy/estimators.md#estimators-hutchinson,
docs/privacy/threat_models.md#threat-models-conditions), and never stored or logged.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP  # noqa: N817
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
)
from opacus.utils.module_utils import trainable_parameters
from torch import nn
from torch.distributed.fsdp import FSDPModule

from opacus_rc._compat.opacus import (
    WRAPPED_MODULE_ATTR,
    wrapped_module,
    wrapped_module_if_built,
)
from opacus_rc.config import RandomizedClippingConfig
from opacus_rc.grad_sample import private_step as private_step_module
from opacus_rc.grad_sample.checkpointing import NoEarlyStop, RecordBeforeForward, modules_above
from opacus_rc.grad_sample.checks import (
    ParameterUseCheck,
    TrainableSetGuard,
    check_parametrizations,
    check_peft_dora,
    check_tied_parameters,
    check_training_mode,
    strip_grad_sample_hooks,
)
from opacus_rc.grad_sample.distributed import ReducerOff, ddp_modules
from opacus_rc.grad_sample.forward_inputs import ForwardInputBinder, explain_forward_error
from opacus_rc.grad_sample.functorch import FunctorchGradSampler
from opacus_rc.grad_sample.norm_layers import register_loaded_transformers_norms
from opacus_rc.grad_sample.norms import STASH_GRAD_SAMPLERS, ModuleNorms
from opacus_rc.grad_sample.private_step import NORM_SAMPLED_PATHS, PrivateStep
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
    bookkeeping_blockers,
    find_tied_groups,
    refuse_unsupported,
    resolve_norm_routes,
)
from opacus_rc.grad_sample.tied import TiedSketches
from opacus_rc.sketching import (
    GRADIENT_ESTIMATORS,
    SketchGenerators,
    SketchSpec,
    get_estimator,
)

__all__ = ["GradSampleHooksRandomizedClipping", "GradSampleModuleRandomizedClipping"]

logger = logging.getLogger(__name__)


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


def _module_device(m: nn.Module) -> torch.device:
    for p in m.parameters():
        return p.device
    return torch.device("cpu")


class _RandomizedClippingMixin(GradSampleHooksFastGradientClipping):
    """Construction and public properties of the wrapping and the hooks-only
    randomized-clipping classes; the step itself is their :attr:`private_step`.

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

    #: The class of :attr:`private_step` (FSDP2 writes its clipped sums differently).
    PRIVATE_STEP: type[PrivateStep] = PrivateStep
    #: Reach a module whose inputs carry no gradient through its output's graph edge, not its
    #: parameters, in the book-keeping first pass (FSDP2: the registered parameters are shards
    #: that are not in the autograd graph).
    FIRST_PASS_OUTPUT_EDGES: bool = False
    #: The step's owner (built by the constructor).
    private_step: PrivateStep
    _reducer_off: ReducerOff | None = None

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
        # The closed forms of the transformers RMSNorm classes imported since opacus_rc was, in
        # the tables the routes are resolved from.
        register_loaded_transformers_norms()
        check_modules(m)  # e.g. nn.Embedding(max_norm=...), refused before any forward
        check_peft_dora(m)
        check_parametrizations(m)  # weight_norm, spectral_norm: computed outside the forward
        names = {id(sub): name for name, sub in m.named_modules()}
        hooked = list(self.iterate_submodules(m))
        tied_groups = find_tied_groups(hooked, names=names)  # embedding tied to an LM head
        routes = resolve_norm_routes(
            hooked,
            names=names,
            sketched=self.SKETCHED_NORM_SAMPLERS,
            exact_types=self.EXACT_NORM_TYPES,
            clipped_sums=self.CLIPPED_SUM_FUNCTIONS,
            grad_samplers=self.GRAD_SAMPLERS,
            norm_samplers=self.NORM_SAMPLERS,
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
                getattr(routes.get(id(sub)), "path", None) in (*NORM_SAMPLED_PATHS, NormPath.TIED)
            ),
            supported={id(g.weight) for g in tied_groups},
        )
        try:
            super().__init__(
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
            gradient_estimator = GRADIENT_ESTIMATORS.get(estimator)
            if config.sketch_spec.head_dim is not None:
                estimator = functools.partial(estimator, head_dim=config.sketch_spec.head_dim)
                if gradient_estimator is not None:
                    gradient_estimator = functools.partial(
                        gradient_estimator, head_dim=config.sketch_spec.head_dim
                    )
            self._generators = SketchGenerators(user_generator=config.sketch_generator)
            if config.sketch_generator is not None:
                warnings.warn(
                    "a sketch_generator was passed: the 'hidden' privacy guarantee of randomized "
                    "clipping then holds only if its seed stays secret; the reported SketchSpec "
                    "has secret=False",
                    UserWarning,
                    stacklevel=3,
                )
            tied = TiedSketches(tied_groups, name_of=self._name_of)
            norms = ModuleNorms(
                sketched=self.SKETCHED_NORM_SAMPLERS,
                grad_samplers=self.GRAD_SAMPLERS,
                norm_samplers=self.NORM_SAMPLERS,
                estimator=estimator,
                sketch_dim=config.sketch_dim,
                generator_for=self._generators.for_device,
                tied=tied,
                name_of=self._name_of,
                stash_grad_samplers=self.STASH_GRAD_SAMPLERS,
                functorch=functorch,
                gradient_estimator=gradient_estimator,
            )
            uses = ParameterUseCheck(m, name_of=self._name_of, active=lambda: self.hooks_enabled)
            uses.register(self.autograd_grad_sample_hooks)
            inputs = ForwardInputBinder(
                name_of=self._name_of,
                adapters=self.FORWARD_INPUT_ADAPTERS,
                batch_first=config.batch_first,
            )
            for sub in hooked:
                self.autograd_grad_sample_hooks.append(
                    sub.register_forward_pre_hook(inputs.record_call_kwargs, with_kwargs=True)
                )
            # A recomputation records nn.Linear and norm layers before their forward; where
            # that covers every hooked module it may stop early (checkpointing.py). Otherwise
            # early stop is off in the forward of the model and of every module above a hooked
            # one, so that a submodule called directly (model.body(x), then model.head(h))
            # records every layer of its checkpointed regions too.
            early = RecordBeforeForward(
                hooked,
                routes,
                self.autograd_grad_sample_hooks,
                record=lambda module, args: self.private_step.record_before_forward(module, args),
            )
            NoEarlyStop(
                [m, *modules_above(m, hooked)],
                self.autograd_grad_sample_hooks,
                active=lambda: self.hooks_enabled and not early.allows_early_stop(),
            )
            trainable = TrainableSetGuard(m, name_of=self._name_of)
            self._log_norm_paths()
            self._reducer_off = ReducerOff(m)  # the DP optimizer all-reduces the clipped sum
            self.private_step = self.PRIVATE_STEP(
                self,
                model=m,
                config=config,
                routes=routes,
                norms=norms,
                tied=tied,
                uses=uses,
                trainable=trainable,
                inputs=inputs,
                ddp_modules=self._reducer_off.modules,
                bookkeeping=self._resolve_bookkeeping(m, requested=bool(config.bookkeeping)),
                name_of=self._name_of,
                generators=self._generators,
                estimator=estimator,
                clipped_sums=self.CLIPPED_SUM_FUNCTIONS,
                adapters=self.FORWARD_INPUT_ADAPTERS,
                output_edges=self.FIRST_PASS_OUTPUT_EDGES,
                distributed=_is_distributed(m),
            )
            for p in self.private_step.params:
                self.autograd_grad_sample_hooks.append(
                    p.register_post_accumulate_grad_hook(self.private_step.record_gradient)
                )
        except BaseException:
            self.cleanup()
            raise

    # ------------------------------------------------------------------------------------------
    # Opacus' hooks and readers: one-line delegations to the step
    # ------------------------------------------------------------------------------------------

    #: Opacus' forward and backward hooks: delegations to :attr:`private_step`, defined with
    #: it (:func:`~opacus_rc.grad_sample.private_step.capture_activations_hook`).
    capture_activations_hook = private_step_module.capture_activations_hook
    capture_backprops_hook = private_step_module.capture_backprops_hook

    def get_clipping_coef(self) -> torch.Tensor:
        """Per-sample (per-unit) clip factors ``min(1, C / (n_hat_i + 1e-6))`` of this step, at
        this module's ``max_grad_norm`` (Opacus' API; :meth:`PrivateStep.issue_clip_factors`).

        Returns:
            Tensor of shape ``(B,)``, or ``(U,)`` with ``units=``.

        Raises:
            FloatingPointError, RuntimeError: See :meth:`PrivateStep.issue_clip_factors`.
        """
        self.private_step.uses.clear()  # no private backward consumes this forward's spans
        return self.private_step.issue_clip_factors(max_grad_norm=self.max_grad_norm)

    def get_norm_sample(self) -> torch.Tensor:
        """Per-sample (per-unit) whole-model norm estimates (:meth:`PrivateStep.norm_sample`);
        ``(B,)`` or ``(U,)`` float64. Not privatized.

        Raises:
            RuntimeError: No norms were computed since the last step.
        """
        return self.private_step.norm_sample()

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
    def norm_routes(self) -> dict[str, NormRoute]:
        """``{module name: NormRoute}``: how each hooked module's norm is computed."""
        return {r.name: r for r in self._routes.values()}

    @property
    def per_sample_gradient_norms(self) -> torch.Tensor:
        """``(B,)`` float64 norm estimates of the whole model from the last clip factors
        (``(U,)``, one per unit, when the step's criterion had ``units=``).

        Readable from the clip factors of a step until the next hooked forward pass. These are
        not privatized: for debugging and logging only.

        Raises:
            AttributeError: If no clip factors were computed since the last forward pass.
        """
        step = getattr(self, "private_step", None)
        norms = None if step is None else step.per_sample_gradient_norms
        if norms is None:
            raise AttributeError(
                "per_sample_gradient_norms is not set: they exist from the private backward "
                "(criterion(...).backward()) of a step until the next forward pass"
            )
        return norms

    @per_sample_gradient_norms.setter
    def per_sample_gradient_norms(self, value: Any) -> None:
        # Opacus' base __init__ assigns it (None); the value lives in the step.
        step = getattr(self, "private_step", None)
        if step is not None and value is not None:
            step.per_sample_gradient_norms = value

    @property
    def norm_samples(self) -> dict[str, torch.Tensor]:
        """``{parameter name: (B,) norm}``: this step's per-parameter norms (after its backward),
        or those of the last clip factors (until the next forward); ``(U,)``, one per unit, with
        ``units=``. Not privatized."""
        return {self._name_of(p): t for p, t in self.private_step.norm_samples.items()}

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
        use it too: with ``bookkeeping=True`` each layer keeps the smaller of its per-sample
        gradients and its input and output gradient (:mod:`~opacus_rc.grad_sample.norms`);
        ``bookkeeping="always"`` keeps the inputs and output gradients everywhere.
        """
        return self.private_step.bookkeeping

    @property
    def step_smaller_stash(self) -> bool:
        """Whether the current step is a checkpointed book-keeping step with
        ``bookkeeping=True`` (decided with :attr:`bookkeeping`): then the packed-row paths of
        ``record_ids=`` batches also defer to the smaller stash. Every step with
        ``bookkeeping=True`` lets each ``nn.Linear`` keep the smaller of its per-sample
        gradients and its input and output gradient; a sketched layer's norm is the same sketch
        from either (:mod:`~opacus_rc.grad_sample.norms`)."""
        return self.private_step.smaller_stash

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
        """Whether book-keeping can be used; warns once why not if it was requested.

        Available iff every route supports it (:attr:`NormRoute.supports_bookkeeping`). Under
        DDP/DPDDP each rank forms its clipped sum from its own samples and the distributed
        optimizer all-reduces it once (:mod:`~opacus_rc.grad_sample.distributed`).
        """
        if not requested:
            return False
        blockers = bookkeeping_blockers(self._routes)
        if blockers:
            _fallback_warning("forced by " + "; ".join(blockers[:5]))
            return False
        return True

    def cleanup(self) -> None:
        """Remove all hooks and every attribute Opacus or this class added to the model."""
        step = getattr(self, "private_step", None)
        if step is not None:
            step.abort()  # frees every stored tensor (and an open unit)
        if self._reducer_off is not None:
            self._reducer_off.restore()
        super().cleanup()
        strip_grad_sample_hooks(wrapped_module(self))


def _is_distributed(m: nn.Module) -> bool:
    """Whether ``m`` is data-parallel over an initialised process group (the ranks of a step
    then agree after each first pass): Opacus' DPDDP, torch DDP or FSDP2, as the engine
    decides it."""
    parallel = isinstance(m, (DPDDP, FSDPModule)) or bool(ddp_modules(m))
    return parallel and dist.is_available() and dist.is_initialized()


class GradSampleModuleRandomizedClipping(
    _RandomizedClippingMixin, GradSampleModuleFastGradientClipping
):
    """Wraps a model to compute sketched per-sample norms and clip factors (DP-SGD-RC).

    Attributes the wrapper does not have are read from the wrapped model (``generate``, a
    Hugging Face ``config``...), so the wrapped model behaves as the model. Use it like Opacus'
    ``GradSampleModuleFastGradientClipping``: with
    :class:`~opacus_rc.optimizers.RandomizedClipOptimizer` and
    :class:`~opacus_rc.optimizers.DPLossRandomizedClipping`, whose ``backward()`` calls
    ``module.private_step.backward`` (one backward pass if :attr:`bookkeeping`, else two) and
    hands its clip result to the optimizer.

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
        private_step: The :class:`~opacus_rc.grad_sample.private_step.PrivateStep` that owns
            each step.
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
            self.private_step.reset()
            batch_first = self.clipping_config.batch_first
            model = wrapped_module(self)
            explained = explain_forward_error(
                err, model=model, args=args, kwargs=kwargs, batch_first=batch_first
            )
            if explained is None:
                raise
            raise explained from err

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
