"""Grad-sample modules for randomized clipping (DP-SGD-RC; DESIGN.md sections 3-4).

:class:`GradSampleModuleRandomizedClipping` wraps a model like Opacus'
``GradSampleModuleFastGradientClipping`` (ghost clipping); :class:`GradSampleHooksRandomizedClipping`
attaches the same hooks without wrapping (``wrap_model=False``). Both share
:class:`_RandomizedClippingMixin`, which changes three things:

1. Norms. In the backward hook, a layer type registered in
   :data:`~opacus_rc.grad_sample.registry.SKETCHED_NORM_SAMPLERS` gets a sketched per-sample
   norm (fresh Gaussian probes from the module's generator for every step, sample and layer;
   THEORY.md A.2 and B.2); a type registered there with ``exact=True`` (``nn.Embedding``) gets
   an exact norm from that registry. Every other layer uses Opacus' exact path unchanged:
   per-sample gradients for ``LayerNorm``/``RMSNorm``/Conv, functorch for the rest.
2. Safety checks. Non-finite norm estimates raise before a clip factor exists; a trainable
   parameter used outside the forward of the module that owns it raises before the first
   backward pass (:meth:`~_RandomizedClippingMixin.check_parameter_uses`, called by the DP
   criterion), and a parameter that received a gradient without a per-sample norm raises
   instead of passing unclipped; stale norms of a previous step are never reused; tied or
   reused sketched modules raise naming the module; eval-mode models are rejected, and a module
   switched to eval mode that still receives a gradient raises naming it; per-sample norms of
   different batch sizes (a batch-broadcast input such as ``position_ids`` of shape ``[1, T]``,
   Opacus issue 841) raise naming the parameters. (tests/reliability/CATALOGUE.md lists all.)
3. Sketch randomness. One ``torch.Generator`` owned by the module, seeded from the operating
   system's CSPRNG (:mod:`secrets`) unless the caller passes one. Probes are drawn inside the
   backward hook and never stored or logged.

The clip factor is ``min(1, C / (n_hat_i + 1e-6))`` with ``n_hat_i`` the square root of the sum
over parameters of the squared per-parameter norms (THEORY.md B.1), the same form as Opacus'
ghost clipping so that exact and sketched runs are comparable.

Book-keeping (``bookkeeping=True``, the default; Bu, Wang, Zha and Karypis, "Differentially
Private Optimization on Large Model at Small Cost", ICML 2023). Ghost clipping needs a second
backward pass of ``sum_i c_i loss_i`` once the clip factors ``c`` are known. In book-keeping mode
the first (only) backward pass keeps, for each sketched layer with a clipped-sum function
(:data:`~opacus_rc.grad_sample.registry.CLIPPED_SUM_FUNCTIONS`, e.g. ``nn.Linear``), its input
and output gradient, and for each layer on Opacus' per-sample-gradient path (``LayerNorm``,
``RMSNorm``, functorch) the per-sample gradients Opacus computes for the norm anyway;
:meth:`~_RandomizedClippingMixin.apply_clipped_sum` then writes ``p.grad = sum_i c_i grad_p
loss_i`` from them, which is exactly what the second backward pass gives. The probes are drawn
in the first pass only, in both modes, so the sketch randomness and the privacy analysis are
unchanged. A module with an Opacus ghost norm and no entry in this package's registries has no
per-sample gradient: with any of them trainable, or in distributed training, the module uses
two passes.
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
import warnings
from collections.abc import Callable
from typing import Any

import torch
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient
from opacus.grad_sample.grad_sample_module import (
    create_or_accumulate_grad_sample,
    promote_current_grad_sample,
)
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
    create_norm_sample,
)
from opacus.grad_sample.gsm_base import OPACUS_PARAM_MONKEYPATCH_ATTRS
from opacus.layers.dp_rnn import DPGRU, DPLSTM, DPRNN
from opacus.utils.module_utils import trainable_modules, trainable_parameters
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.nn.parallel import DistributedDataParallel

from opacus_rc.grad_sample.registry import (
    CLIPPED_SUM_FUNCTIONS,
    EXACT_NORM_TYPES,
    SKETCHED_NORM_SAMPLERS,
    ClippedSumFunction,
    SketchedNormSampler,
    check_modules,
)
from opacus_rc.sketching import SketchSpec, get_estimator, validate_sketch_dim

__all__ = ["GradSampleHooksRandomizedClipping", "GradSampleModuleRandomizedClipping"]

logger = logging.getLogger(__name__)

_LOSS_REDUCTIONS = ("mean", "sum")

#: Module attribute holding a book-keeping stash between the backward pass and the clipped sum.
_STASH_ATTR = "_rc_bookkeeping_stash"


def strip_grad_sample_hooks(module: nn.Module) -> None:
    """Remove every Opacus/opacus_rc hook and attribute from ``module``.

    For failure paths, where no hooks object may exist to call ``cleanup()`` on. Opacus keeps
    the hook handles in ``module.autograd_grad_sample_hooks`` and adds the attributes in
    ``OPACUS_PARAM_MONKEYPATCH_ATTRS`` to parameters and ``activations``/``max_batch_len``/
    ``ft_compute_sample_grad`` to submodules; this package adds its book-keeping stash.
    """
    handles = getattr(module, "autograd_grad_sample_hooks", None)
    if handles is not None:
        while handles:
            handles.pop().remove()
        delattr(module, "autograd_grad_sample_hooks")
    for p in module.parameters():
        for attr in OPACUS_PARAM_MONKEYPATCH_ATTRS:
            if hasattr(p, attr):
                delattr(p, attr)
    for sub in module.modules():
        for attr in ("activations", "max_batch_len", "ft_compute_sample_grad", _STASH_ATTR):
            if attr in sub.__dict__:
                delattr(sub, attr)


def check_training_mode(module: nn.Module) -> None:
    """Raise if ``module`` or any submodule with trainable parameters is in eval mode.

    Opacus' forward hook skips modules with ``training=False``, so their gradients would have
    no per-sample norm.

    Raises:
        ValueError: Naming the offending modules and telling the caller to call ``train()``.
    """
    if not module.training:
        raise ValueError(
            "the model is in eval mode; randomized clipping needs per-sample norms that are "
            "only recorded in training mode: call model.train() before make_private / before "
            "wrapping the model"
        )
    in_eval = [name or "<root>" for name, sub in trainable_modules(module) if not sub.training]
    if in_eval:
        raise ValueError(
            f"submodules with trainable parameters are in eval mode: {in_eval[:5]}; call "
            "model.train() (or freeze their parameters) before make_private"
        )


def resolve_sketch_spec(
    *,
    sketch: str,
    sketch_dim: int,
    sketch_head_dim: int | None = None,
    sketch_generator: torch.Generator | None = None,
) -> SketchSpec:
    """The :class:`SketchSpec` a randomized-clipping module built with these options uses.

    Used by the module itself and by ``PrivacyEngine.make_private_with_epsilon`` (noise search
    before the module exists), so both always agree.

    Args:
        sketch: Estimator name (see :data:`opacus_rc.sketching.ESTIMATORS`).
        sketch_dim: ``k``, Gaussian (tail) columns.
        sketch_head_dim: Hutch++ head columns ``s`` (default ``sketch_dim``); must be ``None``
            for other estimators.
        sketch_generator: The user's generator, if any (the spec is then not ``secret``).

    Returns:
        The spec: per-sample sketches, ``secret`` iff no generator was passed.

    Raises:
        ValueError: Unknown estimator, dimension < 1, or a head dimension without Hutch++.
        TypeError: Non-integer dimension.
    """
    get_estimator(sketch)
    validate_sketch_dim(sketch_dim)
    if sketch == "hutch++":
        head_dim = sketch_dim if sketch_head_dim is None else sketch_head_dim
        validate_sketch_dim(head_dim, "sketch_head_dim")
    elif sketch_head_dim is not None:
        raise ValueError(f"sketch_head_dim is only used by sketch='hutch++', not {sketch!r}")
    else:
        head_dim = None
    return SketchSpec(
        estimator=sketch,
        sketch_dim=sketch_dim,
        head_dim=head_dim,
        per_sample=True,
        secret=sketch_generator is None,
    )


class _BookkeepingStash:
    """What one module's first backward pass leaves for its clipped gradient sum (book-keeping).

    Either ``activations``/``backprops`` (a sketched layer with a clipped-sum function, fed to
    that function) or ``grad_samples`` (per-sample gradients from Opacus' exact path). Every
    tensor is detached.

    Attributes:
        params: The trainable parameters this stash gives a gradient to.
        activations: The layer's forward inputs, batch first (e.g. ``[A]`` with ``A`` of shape
            ``(B, ..., d)``), or None.
        backprops: The output gradient ``G``, batch first, already rescaled to per-sample losses
            (``(B, ..., p)``), or None.
        grad_samples: ``{parameter: (B, *parameter.shape) tensor}``, or None.
    """

    __slots__ = ("activations", "backprops", "grad_samples", "params")

    def __init__(
        self,
        params: tuple[nn.Parameter, ...],
        *,
        activations: list[torch.Tensor] | None = None,
        backprops: torch.Tensor | None = None,
        grad_samples: dict[nn.Parameter, torch.Tensor] | None = None,
    ) -> None:
        self.params = params
        self.activations = activations
        self.backprops = backprops
        self.grad_samples = grad_samples


class _RandomizedClippingMixin:
    """Shared logic of the wrapping and the hooks-only randomized-clipping classes.

    Must come before an Opacus ``...FastGradientClipping`` class in the bases.
    """

    #: Sketched samplers, looked up by exact module type before Opacus' exact ones.
    SKETCHED_NORM_SAMPLERS: dict[type[nn.Module], SketchedNormSampler] = SKETCHED_NORM_SAMPLERS
    #: Clipped-sum functions of the sketched types (book-keeping), by exact module type.
    CLIPPED_SUM_FUNCTIONS: dict[type[nn.Module], ClippedSumFunction] = CLIPPED_SUM_FUNCTIONS

    # Book-keeping state (instance attributes once constructed; class defaults for hooks that
    # could fire before __init__ ends).
    _bookkeeping: bool = False
    _bk_ready: list[tuple[nn.Module, _BookkeepingStash]] | None = None

    def __init__(
        self,
        m: nn.Module,
        *,
        max_grad_norm: float,
        sketch: str = "hutchinson",
        sketch_dim: int = 32,
        sketch_head_dim: int | None = None,
        sketch_generator: torch.Generator | None = None,
        secure_mode: bool = False,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        force_functorch: bool = False,
        bookkeeping: bool = True,
    ) -> None:
        # Everything is validated before Opacus attaches a single hook.
        spec = resolve_sketch_spec(
            sketch=sketch,
            sketch_dim=sketch_dim,
            sketch_head_dim=sketch_head_dim,
            sketch_generator=sketch_generator,
        )
        _validate_max_grad_norm(max_grad_norm)
        if loss_reduction not in _LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if not isinstance(bookkeeping, bool):
            raise TypeError(f"bookkeeping must be a bool, got {type(bookkeeping).__name__}")
        if sketch_generator is not None and not isinstance(sketch_generator, torch.Generator):
            raise TypeError(
                f"sketch_generator must be a torch.Generator, got {type(sketch_generator).__name__}"
            )
        if secure_mode and sketch_generator is not None:
            raise ValueError(
                "passing a sketch_generator is prohibited with secure_mode=True: the sketch "
                "must come from the operating system's CSPRNG"
            )
        if hasattr(m, "autograd_grad_sample_hooks"):
            raise ValueError(
                "the model already has Opacus grad-sample hooks attached; pass the plain "
                "nn.Module (call cleanup() on the previous hooks first)"
            )
        check_training_mode(m)
        check_modules(m)  # e.g. nn.Embedding(max_norm=...), refused before any forward
        self._check_tied_parameters(m)

        try:
            super().__init__(  # type: ignore[call-arg]
                m,
                batch_first=batch_first,
                loss_reduction=loss_reduction,
                strict=strict,
                force_functorch=force_functorch,
                max_grad_norm=max_grad_norm,
                use_ghost_clipping=True,
            )
        except BaseException:
            strip_grad_sample_hooks(m)  # Opacus may fail after attaching some hooks
            raise
        try:
            self._sketch_spec = spec
            estimator = get_estimator(sketch)
            if spec.head_dim is not None:
                estimator = functools.partial(estimator, head_dim=spec.head_dim)
            self._estimator: Callable[..., torch.Tensor] = estimator
            self._secure_mode = secure_mode
            if sketch_generator is None:
                sketch_generator = torch.Generator(device=_module_device(m))
                sketch_generator.manual_seed(secrets.randbits(63))
            else:
                warnings.warn(
                    "a sketch_generator was passed: the 'hidden' privacy guarantee of randomized "
                    "clipping then holds only if its seed stays secret; the reported SketchSpec "
                    "has secret=False",
                    UserWarning,
                    stacklevel=2,
                )
            self._sketch_generator = sketch_generator
            self._module_names = {id(sub): name for name, sub in m.named_modules()}
            self._param_names = {id(p): name for name, p in trainable_parameters(m)}
            self._fresh_norms: set[int] = set()
            self._grad_seen: set[int] = set()
            self._coef_dtype = torch.float32
            self._bk_stashed: list[nn.Module] = []
            self._bk_edges: list[GradientEdge | torch.Tensor] = []
            self._bk_ready = None
            self._clip_factors_issued = False
            for _, p in trainable_parameters(m):
                self.autograd_grad_sample_hooks.append(
                    p.register_post_accumulate_grad_hook(self._record_gradient)
                )
            self._register_forward_spans(m)
            self._log_norm_paths()
            self._bookkeeping = self._resolve_bookkeeping(m, requested=bookkeeping)
        except BaseException:
            self.cleanup()
            raise

    # ------------------------------------------------------------------------------------------
    # Public properties
    # ------------------------------------------------------------------------------------------

    @property
    def sketch_spec(self) -> SketchSpec:
        """The :class:`~opacus_rc.sketching.SketchSpec` this module actually uses."""
        return self._sketch_spec

    @property
    def sketch_generator(self) -> torch.Generator:
        """The generator all probes are drawn from (never the data or noise generator)."""
        return self._sketch_generator

    @property
    def bookkeeping(self) -> bool:
        """Whether steps use book-keeping (one backward pass) rather than two backward passes.

        ``True`` only if ``bookkeeping=True`` was passed, every trainable module supports it and
        the model is not distributed (decided at construction; see the module docstring).
        """
        return self._bookkeeping

    # ------------------------------------------------------------------------------------------
    # Construction-time checks
    # ------------------------------------------------------------------------------------------

    def _uses_norm_sampler(self, module: nn.Module) -> bool:
        """Whether ``module``'s norm comes from a sampler that cannot handle tied weights."""
        t = type(module)
        return t in self.SKETCHED_NORM_SAMPLERS or t in type(self).NORM_SAMPLERS  # type: ignore[attr-defined]

    def _check_tied_parameters(self, m: nn.Module) -> None:
        """Raise if a trainable parameter is shared by a norm-sampled module and another one."""
        owners: dict[int, list[tuple[str, nn.Module]]] = {}
        for name, sub in m.named_modules():
            for p in sub.parameters(recurse=False):
                if p.requires_grad:
                    owners.setdefault(id(p), []).append((name or "<root>", sub))
        for users in owners.values():
            if len(users) > 1 and any(self._uses_norm_sampler(sub) for _, sub in users):
                names = ", ".join(f"'{n}' ({type(s).__name__})" for n, s in users)
                raise NotImplementedError(
                    f"a trainable parameter is tied between modules {names}; randomized and "
                    "ghost clipping compute per-module norms and cannot combine tied weights. "
                    "Untie the weights or freeze the shared parameter."
                )

    def _log_norm_paths(self) -> None:
        """Log once, at construction, which norm path each trainable module takes."""
        if not logger.isEnabledFor(logging.INFO):
            return
        for name, sub in trainable_modules(self._module):  # type: ignore[attr-defined]
            t = type(sub)
            if t in EXACT_NORM_TYPES and t in self.SKETCHED_NORM_SAMPLERS:
                path = "exact (opacus_rc sampler, no sketch)"
            elif t in self.SKETCHED_NORM_SAMPLERS:
                path = f"sketched ({self._sketch_spec.estimator}, k={self._sketch_spec.sketch_dim})"
            elif t in type(self).NORM_SAMPLERS:  # type: ignore[attr-defined]
                path = "exact ghost norm (Opacus)"
            elif t in type(self).GRAD_SAMPLERS and not self.force_functorch:  # type: ignore[attr-defined]
                path = "exact per-sample gradients (Opacus grad sampler)"
            else:
                path = "exact per-sample gradients (functorch fallback)"
            logger.info("module %r (%s): %s", name, t.__name__, path)

    def _resolve_bookkeeping(self, m: nn.Module, *, requested: bool) -> bool:
        """Whether book-keeping can be used; logs once (INFO) why not if it was requested.

        Available iff no module of ``m`` is a (DP)DDP wrapper, the process group (if any) has
        one rank, and every hooked trainable module is covered: a sketched type with a
        clipped-sum function, or a type on Opacus' per-sample-gradient path (a grad sampler or
        functorch). An Opacus ghost norm (``nn.Embedding``) or a sketched type without a
        clipped-sum function forces two passes.
        """
        if not requested:
            return False
        ddp = (DistributedDataParallel, DifferentiallyPrivateDistributedDataParallel)
        world = (
            torch.distributed.get_world_size()
            if torch.distributed.is_available() and torch.distributed.is_initialized()
            else 1
        )
        if world > 1 or any(isinstance(sub, ddp) for sub in m.modules()):
            logger.info(
                "book-keeping (single backward) is off: distributed training keeps two "
                "backward passes"
            )
            return False
        blockers: list[str] = []
        for sub in self.iterate_submodules(m):  # type: ignore[attr-defined]
            t = type(sub)
            if t in (DPRNN, DPLSTM, DPGRU):  # hooked through their RNNLinear children
                continue
            name = f"'{self._module_name(sub)}' ({t.__name__})"
            if t in self.SKETCHED_NORM_SAMPLERS:
                if t not in self.CLIPPED_SUM_FUNCTIONS:
                    blockers.append(f"{name}: sketched norm without a clipped-sum function")
            elif t in type(self).NORM_SAMPLERS:  # type: ignore[attr-defined]
                blockers.append(f"{name}: Opacus ghost norm, no per-sample gradient")
        if blockers:
            logger.info(
                "book-keeping (single backward) is off, two backward passes per step; forced "
                "by: %s",
                "; ".join(blockers),
            )
            return False
        return True

    # ------------------------------------------------------------------------------------------
    # Parameter uses outside their module's forward
    # ------------------------------------------------------------------------------------------

    def _register_forward_spans(self, m: nn.Module) -> None:
        """Record, for every module owning a trainable parameter, the autograd sequence numbers
        its forward calls span (see :meth:`check_parameter_uses`)."""
        self._param_owners: dict[int, list[int]] = {}
        self._forward_spans: dict[int, list[tuple[int, int]]] = {}
        self._open_spans: dict[int, list[int]] = {}
        self._sequence_leaf = torch.zeros((), requires_grad=True)
        for sub in m.modules():
            own = [p for p in sub.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            for p in own:
                self._param_owners.setdefault(id(p), []).append(id(sub))
            self.autograd_grad_sample_hooks.append(  # type: ignore[attr-defined]
                sub.register_forward_pre_hook(self._open_forward_span)
            )
            self.autograd_grad_sample_hooks.append(  # type: ignore[attr-defined]
                sub.register_forward_hook(self._close_forward_span)
            )

    def _sequence_number(self) -> int:
        """The autograd sequence number of a node created now (forward nodes are numbered in
        creation order, per thread)."""
        return self._sequence_leaf.view(()).grad_fn._sequence_nr()  # type: ignore[union-attr]

    def _open_forward_span(self, module: nn.Module, _args: Any) -> None:
        if self.hooks_enabled and torch.is_grad_enabled():  # type: ignore[attr-defined]
            self._open_spans.setdefault(id(module), []).append(self._sequence_number())

    def _close_forward_span(self, module: nn.Module, _args: Any, _output: Any) -> None:
        opened = self._open_spans.get(id(module))
        if opened and self.hooks_enabled and torch.is_grad_enabled():  # type: ignore[attr-defined]
            span = (opened.pop(), self._sequence_number())
            self._forward_spans.setdefault(id(module), []).append(span)

    def check_parameter_uses(self, loss: torch.Tensor) -> None:
        """Raise if a trainable parameter reaches ``loss`` other than through its module's forward.

        Per-sample norms come from each module's own forward (its hooks see its input and
        output gradient), so a parameter also used elsewhere, e.g. ``F.linear(h,
        model.fc.weight)`` outside ``model.fc``, would get a gradient that no norm measured:
        unclipped with two backward passes, dropped with book-keeping. This walks the autograd
        graph of ``loss`` once (O(nodes)) and checks that every node consuming a trainable
        parameter was created inside a forward call of a module owning it (by autograd
        sequence numbers, recorded by forward pre- and post-hooks since the last check). The
        recorded spans are consumed. Under ``torch.autocast`` the node consuming a weight is its
        cast, which autocast caches for the whole region at the weight's first use; a region
        spanning several forward passes, or an earlier use outside the module in the same
        region, therefore raises too.

        Args:
            loss: The loss about to be backpropagated (any shape).

        Raises:
            RuntimeError: If a trainable parameter is used outside its module's forward; the
                error names the parameters.
        """
        spans, self._forward_spans = self._forward_spans, {}
        self._open_spans = {}
        root = loss.grad_fn
        if root is None:
            return
        outside: dict[int, str] = {}
        seen: dict[int, Any] = {id(root): root}  # values keep the nodes (and their ids) alive
        stack = [root]
        while stack:
            node = stack.pop()
            seq: int | None = None
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)  # AccumulateGrad: a leaf tensor
                if var is not None:
                    owners = self._param_owners.get(id(var))
                    if owners is None:
                        continue
                    seq = node._sequence_nr() if seq is None else seq
                    if not any(lo < seq < hi for o in owners for lo, hi in spans.get(o, ())):
                        outside[id(var)] = self._param_names.get(id(var), "<unnamed>")
                elif id(nxt) not in seen:
                    seen[id(nxt)] = nxt
                    stack.append(nxt)
        if outside:
            self._reset_step_state()
            raise RuntimeError(
                f"trainable parameter(s) {sorted(outside.values())} are used outside the "
                "forward of the module that owns them (e.g. F.linear(h, model.fc.weight) "
                "instead of model.fc(h)). Randomized clipping measures each per-sample norm "
                "from the owning module's own forward, so that use would get a gradient no "
                "norm accounts for. Call the module itself, give the other use its own module, "
                "or freeze the parameter. (Under torch.autocast a weight is cast once per "
                "autocast region, at its first use: enter autocast once per forward pass, and "
                "not around an earlier use of the weight outside its module.)"
            )

    # ------------------------------------------------------------------------------------------
    # Hooks
    # ------------------------------------------------------------------------------------------

    def _record_gradient(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: remember that ``param`` got a gradient in the first pass."""
        if self.hooks_enabled:  # type: ignore[attr-defined]
            self._grad_seen.add(id(param))

    def _module_name(self, module: nn.Module) -> str:
        return self._module_names.get(id(module)) or type(module).__name__

    def _reuse_error(self, module: nn.Module) -> NotImplementedError:
        return NotImplementedError(
            f"module '{self._module_name(module)}' ({type(module).__name__}) ran more than once "
            "before a backward pass (a reused module or tied weights). Randomized clipping "
            "needs one forward per module per step: use separate modules, or call backward "
            "after every forward in training mode (use torch.no_grad() or model.eval() for "
            "forwards you do not backpropagate)."
        )

    def capture_activations_hook(
        self,
        module: nn.Module,
        forward_input: list[torch.Tensor],
        _forward_output: torch.Tensor,
    ) -> None:
        """Forward hook: store inputs (Opacus) and reject a second use of a norm-sampled module."""
        if self._bk_ready is not None and self.hooks_enabled:  # type: ignore[attr-defined]
            self._bk_ready = None  # a new step: an unconsumed book-keeping stash is stale
        try:
            super().capture_activations_hook(module, forward_input, _forward_output)  # type: ignore[misc]
        except NotImplementedError as err:
            self._reset_step_state()
            raise self._reuse_error(module) from err
        if self._bookkeeping and self.hooks_enabled and torch.is_grad_enabled():  # type: ignore[attr-defined]
            self._record_first_pass_inputs(module, forward_input)
        if not self.hooks_enabled or not hasattr(module, "activations"):  # type: ignore[attr-defined]
            return
        if type(module) in self.SKETCHED_NORM_SAMPLERS and any(
            p._forward_counter > 1 for _, p in trainable_parameters(module)
        ):
            self._reset_step_state()
            raise self._reuse_error(module)
        # Index inputs expanded over the batch (position_ids.expand(B, -1), the fix for Opacus
        # issue 841) are non-contiguous; Opacus' Embedding norm sampler calls .view() on them.
        stored = module.activations[-1] if module.activations else []
        if any(_strided_index(t) for t in stored):
            module.activations[-1] = [t.contiguous() if _strided_index(t) else t for t in stored]

    def _record_first_pass_inputs(self, module: nn.Module, forward_input: Any) -> None:
        """Book-keeping: remember where the first backward pass must reach for ``module``.

        The backward hook of ``module`` fires when the gradient with respect to its input is
        computed (or, if no input requires a gradient, with respect to its output). For an
        input that requires a gradient we keep the graph edge just below the hook node that
        ``register_full_backward_hook`` put on it, so that a backward pass restricted to these
        edges runs every hook without computing any ``dL/dW`` of a layer whose input carries a
        gradient; for a module whose inputs carry none, its trainable parameters themselves.
        See :meth:`take_first_pass_inputs`.
        """
        found = False
        for t in forward_input if isinstance(forward_input, (tuple, list)) else (forward_input,):
            fn = getattr(t, "grad_fn", None)
            if isinstance(t, torch.Tensor) and t.requires_grad and fn is not None:
                if fn.name() != "BackwardHookFunctionBackward":
                    continue
                node, output_nr = fn.next_functions[t.output_nr]
                if node is not None:
                    self._bk_edges.append(GradientEdge(node, output_nr))
                    found = True
        if not found:
            self._bk_edges.extend(p for _, p in trainable_parameters(module))

    def take_first_pass_inputs(self) -> list[GradientEdge | torch.Tensor] | None:
        """The ``inputs`` of the book-keeping first backward pass (consumed), or None for all.

        With book-keeping the parameters' own first-pass gradients are discarded (the clipped
        sum replaces them), so the first pass only needs to reach every hooked module:
        ``torch.autograd.backward(loss, inputs=...)`` then skips the weight-gradient products
        ``G^T A`` of every layer whose input carries a gradient, which is most of the cost a
        second product ``(c G)^T A`` would otherwise add (Bu et al., ICML 2023, section 3).
        Modules whose inputs carry no gradient (the lowest trainable ones) are reached through
        their parameters, whose gradients are then computed and discarded.

        Returns:
            A list of graph edges and parameters recorded by the forward hooks since the last
            call, or None if there are none (the caller then backpropagates to every leaf).
        """
        edges, self._bk_edges = self._bk_edges, []
        return edges or None

    def capture_backprops_hook(
        self,
        module: nn.Module,
        _forward_input: torch.Tensor,
        forward_output: torch.Tensor,
        loss_reduction: str,
        batch_first: bool,
    ) -> None:
        """Backward hook: sketched norms for registered types, Opacus' exact path otherwise."""
        if not self.hooks_enabled:  # type: ignore[attr-defined]
            return
        if not getattr(module, "activations", None):
            self._reset_step_state()
            raise self._no_activations_error(module)
        params = [p for _, p in trainable_parameters(module)]
        if self._is_empty_batch(module, forward_output[0], batch_first):
            # Empty Poisson batch: no sample, no norm. Opacus' samplers (e.g. the Embedding
            # ghost norm) fail on B = 0, so answer directly; the step is still noised.
            module.activations.pop()
            for p in params:
                p._norm_sample = torch.zeros(0, device=p.device, dtype=torch.float32)
                p._forward_counter -= 1
                self._fresh_norms.add(id(p))
            return
        sampler = self.SKETCHED_NORM_SAMPLERS.get(type(module))
        if sampler is None and self._bookkeeping:
            self._exact_backprops_bookkeeping(module, forward_output, loss_reduction, batch_first)
            return
        if sampler is None:
            before = {id(p): getattr(p, "_norm_sample", None) for p in params}
            super().capture_backprops_hook(  # type: ignore[misc]
                module, _forward_input, forward_output, loss_reduction, batch_first
            )
            for p in params:
                if getattr(p, "_norm_sample", None) is not before[id(p)]:
                    self._fresh_norms.add(id(p))
            return

        activations, backprops = self._rearranged(
            module, forward_output, loss_reduction, batch_first
        )
        norms = sampler(
            module,
            activations,
            backprops,
            estimator=self._estimator,
            sketch_dim=self._sketch_spec.sketch_dim,
            generator=self._sketch_generator,
        )
        missing = [p for p in params if p not in norms]
        if missing:
            raise RuntimeError(
                f"the sketched norm sampler for '{self._module_name(module)}' "
                f"({type(module).__name__}) returned no norm for {len(missing)} trainable "
                "parameter(s); a sampler must cover every trainable parameter of its module"
            )
        for p in params:
            p._norm_sample = norms[p]
            p._forward_counter -= 1
            self._fresh_norms.add(id(p))
        if self._bookkeeping and params:
            self._stash(
                module,
                _BookkeepingStash(tuple(params), activations=activations, backprops=backprops),
            )
        if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
            del module.max_batch_len

    def _rearranged(
        self, module: nn.Module, forward_output: Any, loss_reduction: str, batch_first: bool
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The module's stored activations and its detached output gradient, batch first and
        scaled for the loss reduction (Opacus' ``rearrange_grad_samples``)."""
        return self.rearrange_grad_samples(  # type: ignore[attr-defined]
            module=module,
            backprops=forward_output[0].detach(),
            loss_reduction=loss_reduction,
            batch_first=batch_first,
        )

    def _exact_backprops_bookkeeping(
        self,
        module: nn.Module,
        forward_output: Any,
        loss_reduction: str,
        batch_first: bool,
    ) -> None:
        """Opacus' per-sample-gradient branch of the backward hook, keeping the gradients.

        The same computation as the ``else`` branch of Opacus'
        ``GradSampleHooksFastGradientClipping.capture_backprops_hook`` (per-sample gradients
        from a grad sampler or functorch, accumulated over repeated uses, the norm taken once
        the module's last use is processed), except that the per-sample gradients
        ``(B, *p.shape)`` are stashed for :meth:`apply_clipped_sum` instead of dropped. Only
        used in book-keeping mode, where no trainable module has an Opacus ghost norm.
        """
        activations, backprops = self._rearranged(
            module, forward_output, loss_reduction, batch_first
        )
        if not self.force_functorch and type(module) in self.GRAD_SAMPLERS:  # type: ignore[attr-defined]
            grad_sampler_fn = self.GRAD_SAMPLERS[type(module)]  # type: ignore[attr-defined]
        else:
            grad_sampler_fn = ft_compute_per_sample_gradient
        grad_samples = grad_sampler_fn(module, activations, backprops)
        for param, gs in grad_samples.items():
            create_or_accumulate_grad_sample(
                param=param, grad_sample=gs, max_batch_len=module.max_batch_len
            )
        del grad_samples
        done: dict[nn.Parameter, torch.Tensor] = {}
        for _, p in trainable_parameters(module):
            p._forward_counter -= 1
            if p._forward_counter == 0:
                promote_current_grad_sample(p)
                create_norm_sample(
                    param=p, grad_sample=p.grad_sample, max_batch_len=module.max_batch_len
                )
                done[p] = p.grad_sample.detach()
                p.grad_sample = None
                self._fresh_norms.add(id(p))
        if done:
            stash = module.__dict__.get(_STASH_ATTR)
            if stash is not None and stash.grad_samples is not None:
                done = {**stash.grad_samples, **done}
            self._stash(module, _BookkeepingStash(tuple(done), grad_samples=done))
        if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
            del module.max_batch_len

    def _stash(self, module: nn.Module, stash: _BookkeepingStash) -> None:
        """Keep ``stash`` on ``module`` until the clip factors exist (book-keeping)."""
        if _STASH_ATTR not in module.__dict__:
            self._bk_stashed.append(module)
        module.__dict__[_STASH_ATTR] = stash

    def _drop_stashes(self) -> None:
        """Free every book-keeping tensor of the current step (on modules and handed over)."""
        stashed = getattr(self, "_bk_stashed", None)
        if stashed:
            for module in stashed:
                module.__dict__.pop(_STASH_ATTR, None)
            stashed.clear()
        self._bk_ready = None

    def _no_activations_error(self, module: nn.Module) -> RuntimeError:
        name = f"'{self._module_name(module)}' ({type(module).__name__})"
        if not module.training:
            return RuntimeError(
                f"module {name} is in eval mode but received a gradient in a private backward "
                "pass: its inputs were not recorded, so it has no per-sample norm and would not "
                "be clipped. Call model.train() before training steps (use eval() only for "
                "evaluation, under torch.no_grad())."
            )
        return RuntimeError(
            f"module {name} received a gradient but its forward inputs were not recorded "
            "(its forward ran with the hooks disabled or under torch.no_grad()); no per-sample "
            "norm can be computed, so the step cannot be clipped"
        )

    @staticmethod
    def _is_empty_batch(module: nn.Module, backprops: torch.Tensor, batch_first: bool) -> bool:
        """Whether the current backward belongs to an empty batch (``B = 0``)."""
        batch_dim = 0 if batch_first else 1
        acts = module.activations[-1] if getattr(module, "activations", None) else []
        tensors = [t for t in (*acts, backprops) if isinstance(t, torch.Tensor)]
        return any(t.dim() > batch_dim and t.shape[batch_dim] == 0 for t in tensors)

    # ------------------------------------------------------------------------------------------
    # Norms and clip factors
    # ------------------------------------------------------------------------------------------

    def get_norm_sample(self) -> torch.Tensor:
        """Per-sample gradient norm estimates of the whole model for the current step.

        ``n_hat_i = sqrt(sum_params norm_{i,param}^2)`` (THEORY.md A.2, "several layers"),
        computed in float64. Only norms computed in the current step are used (never stale
        ones); a trainable parameter whose module did not run this step contributes 0.

        Returns:
            Tensor of shape ``(B,)``, float64.

        Raises:
            RuntimeError: If a parameter received a gradient in this step without a per-sample
                norm (it would otherwise pass unclipped), or if no norm was computed since the
                last :meth:`get_clipping_coef`.
        """
        parts: list[torch.Tensor] = []
        sizes: dict[str, int] = {}
        unmeasured: list[str] = []
        self._coef_dtype = torch.float32
        for p in self.trainable_parameters:  # type: ignore[attr-defined]
            name = self._param_names.get(id(p), "<unnamed>")
            if id(p) in self._fresh_norms:
                ns = p._norm_sample
                if ns.dtype == torch.float64:
                    self._coef_dtype = torch.float64
                parts.append(ns)
                sizes[name] = ns.numel()
            elif id(p) in self._grad_seen:
                unmeasured.append(name)
        if len(set(sizes.values())) > 1:
            self._end_step()
            batch = max(sizes.values())
            odd = {n: b for n, b in sizes.items() if b != batch}
            raise ValueError(
                f"per-sample norms disagree on the batch size: the batch has {batch} samples "
                f"but {odd}. A module whose input is broadcast across the batch (e.g. a position "
                "Embedding fed Hugging Face position_ids of shape [1, T], Opacus issue 841) only "
                "sees the gradient summed over samples, so its per-sample norms cannot be "
                "computed. Expand the input to the batch size (position_ids.expand(B, -1)) or "
                "freeze that module."
            )
        if unmeasured:
            self._end_step()
            raise RuntimeError(
                f"parameters {unmeasured[:5]} received a gradient but no per-sample norm was "
                "computed for them (used outside their module's forward, e.g. tied through "
                "F.linear, or their module is in eval mode); they would not be clipped"
            )
        if not parts:
            raise RuntimeError(
                "no per-sample norms for this step: run a forward pass in training mode with "
                "gradients enabled, then backward. (A step's norms are consumed by "
                "get_clipping_coef(); read per_sample_gradient_norms afterwards.)"
            )
        device = parts[0].device
        stacked = torch.stack([t.reshape(-1).to(device, torch.float64) for t in parts])
        norm = stacked.norm(2, dim=0)
        self.per_sample_gradient_norms = norm
        return norm

    def get_clipping_coef(self) -> torch.Tensor:
        """Per-sample clip factors ``min(1, C / (n_hat_i + 1e-6))`` for the current step.

        Called by Opacus' ``DPTensorFastGradientClipping.backward`` between its two backward
        passes. Consumes the step's norms: the next call needs a new backward pass. In
        book-keeping mode it also hands the tensors the backward pass stored over to
        :meth:`apply_clipped_sum` (dropped if this raises, or at the next forward pass).

        Returns:
            Tensor of shape ``(B,)``, float32 (float64 if the norms were float64).

        Raises:
            FloatingPointError: If any per-sample norm estimate is NaN or inf (no clip factor
                is produced, so the step cannot proceed).
            RuntimeError: See :meth:`get_norm_sample`; or, in book-keeping mode, a parameter
                with a norm but no stored tensors for its clipped sum.
        """
        ready = None
        try:
            norm = self.get_norm_sample()
            bad = ~torch.isfinite(norm)
            if bool(bad.any()):
                raise FloatingPointError(
                    f"{int(bad.sum())} of {norm.numel()} per-sample gradient norm estimates are "
                    "NaN or inf; no clip factor was produced and this step must not be taken. "
                    "Check the loss and the inputs for NaN/inf (or lower the learning rate)."
                )
            coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)  # type: ignore[attr-defined]
            if self._bookkeeping:
                ready = self._take_stashes(batch_size=norm.numel())
        finally:
            self._end_step()  # drops the stashes on the modules (and any left over)
        self._bk_ready = ready
        self._clip_factors_issued = True
        return coef.to(self._coef_dtype)

    @property
    def clip_factors_pending(self) -> bool:
        """Whether the current gradients can be clipped ones: clip factors were issued by
        :meth:`get_clipping_coef` since :meth:`consume_clip_factors`, and no hooked backward
        pass has run since (its norms would be unconsumed). The optimizer refuses a step on
        non-zero gradients otherwise."""
        return self._clip_factors_issued and not self._fresh_norms

    def consume_clip_factors(self) -> None:
        """Mark the issued clip factors as used (by an optimizer step or ``zero_grad``)."""
        self._clip_factors_issued = False

    def _take_stashes(self, *, batch_size: int) -> list[tuple[nn.Module, _BookkeepingStash]]:
        """This step's stashes, after checking that every normed parameter has one."""
        ready = [
            (m, m.__dict__[_STASH_ATTR]) for m in self._bk_stashed if _STASH_ATTR in m.__dict__
        ]
        if batch_size > 0:
            covered = {id(p) for _, stash in ready for p in stash.params}
            lacking = [
                self._param_names.get(id(p), "<unnamed>")
                for p in self.trainable_parameters  # type: ignore[attr-defined]
                if id(p) in self._fresh_norms and id(p) not in covered
            ]
            if lacking:
                raise RuntimeError(
                    f"book-keeping: parameters {lacking[:5]} have a per-sample norm but no "
                    "stored tensors for their clipped gradient sum; this step cannot be clipped"
                )
        return ready

    def apply_clipped_sum(self, coef: torch.Tensor) -> None:
        """Write the clipped gradient sum into ``p.grad`` (book-keeping; no second backward).

        For every trainable parameter reached by this step's backward pass, adds
        ``sum_i coef_i * grad_p loss_i`` to ``p.grad`` (set to it if ``p.grad`` is None): for a
        sketched layer from its stored input and output gradient via its clipped-sum function,
        otherwise ``einsum("b,b...->...", coef, grad_sample)`` from the stored per-sample
        gradients (Bu, Wang, Zha and Karypis, ICML 2023). This equals what a second backward
        pass of ``sum_i coef_i loss_i`` accumulates. The stored tensors are consumed (freed
        before this returns or raises): a second call raises. No random number is drawn.

        Call it right after :meth:`get_clipping_coef`, with the first-pass gradients zeroed,
        as ``DPLossRandomizedClipping`` does.

        Args:
            coef: The clip factors of this step, shape ``(B,)``.

        Raises:
            RuntimeError: If book-keeping is off, or no stash was handed over by
                :meth:`get_clipping_coef` of this step (already consumed, or dropped).
            ValueError: If a clipped sum has the wrong shape or misses a parameter.
        """
        if not self._bookkeeping:
            raise RuntimeError(
                "apply_clipped_sum() needs book-keeping mode (module.bookkeeping is False): "
                "run the second backward pass of sum_i c_i loss_i instead"
            )
        ready, self._bk_ready = self._bk_ready, None
        if ready is None:
            raise RuntimeError(
                "apply_clipped_sum(): no stored tensors for this step; call it once, right after "
                "the backward pass and get_clipping_coef() of the same step"
            )
        try:
            self._write_clipped_sums(ready, coef)
        finally:
            ready.clear()

    def _write_clipped_sums(
        self, ready: list[tuple[nn.Module, _BookkeepingStash]], coef: torch.Tensor
    ) -> None:
        with torch.no_grad():
            for module, stash in ready:
                if stash.grad_samples is not None:
                    sums = {
                        p: _per_sample_weighted_sum(coef, gs)
                        for p, gs in stash.grad_samples.items()
                    }
                else:
                    fn = self.CLIPPED_SUM_FUNCTIONS[type(module)]
                    assert stash.backprops is not None and stash.activations is not None
                    sums = fn(
                        module, stash.activations, stash.backprops, coef.to(stash.backprops.device)
                    )
                for p in stash.params:
                    g = sums.get(p)
                    if g is None or g.shape != p.shape:
                        raise ValueError(
                            f"the clipped sum of '{self._module_name(module)}' "
                            f"({type(module).__name__}) gave "
                            f"{'no tensor' if g is None else f'shape {tuple(g.shape)}'} for "
                            f"parameter '{self._param_names.get(id(p), '<unnamed>')}' of shape "
                            f"{tuple(p.shape)}"
                        )
                    g = g.to(device=p.device, dtype=p.dtype)
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad.add_(g)

    def _end_step(self) -> None:
        """Forget this step's norms, gradient marks and book-keeping stashes; reseed the sketch
        in secure mode."""
        self._fresh_norms.clear()
        self._grad_seen.clear()
        self._drop_stashes()
        self._bk_edges = []
        self._forward_spans, self._open_spans = {}, {}
        if self._secure_mode:
            self._sketch_generator.manual_seed(secrets.randbits(63))

    def _reset_step_state(self) -> None:
        """Drop stored activations and forward counters (after an error inside a hook)."""
        for sub in self._module.modules():  # type: ignore[attr-defined]
            if hasattr(sub, "activations"):
                sub.activations = []
            if hasattr(sub, "max_batch_len"):
                del sub.max_batch_len
        for _, p in trainable_parameters(self._module):  # type: ignore[attr-defined]
            p._forward_counter = 0
            if getattr(p, "_current_grad_sample", None) is not None:
                del p._current_grad_sample
        self._fresh_norms.clear()
        self._grad_seen.clear()
        self._drop_stashes()
        self._bk_edges = []
        self._forward_spans, self._open_spans = {}, {}

    def cleanup(self) -> None:
        """Remove all hooks and every attribute Opacus or this class added to the model."""
        self._drop_stashes()
        super().cleanup()  # type: ignore[misc]
        strip_grad_sample_hooks(self._module)  # type: ignore[attr-defined]


def _validate_max_grad_norm(max_grad_norm: Any) -> None:
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)):
        raise TypeError(
            "randomized clipping needs one float max_grad_norm (flat clipping); got "
            f"{type(max_grad_norm).__name__}"
        )
    if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm}")


def _strided_index(t: Any) -> bool:
    """A non-contiguous integer tensor (e.g. expanded token or position ids)."""
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_contiguous()


def _per_sample_weighted_sum(coef: torch.Tensor, grad_sample: torch.Tensor) -> torch.Tensor:
    """``einsum("b,b...->...", coef, grad_sample)`` in ``grad_sample``'s dtype, autocast off."""
    with torch.autocast(device_type=grad_sample.device.type, enabled=False):
        c = coef.to(device=grad_sample.device, dtype=grad_sample.dtype)
        return torch.tensordot(c, grad_sample, dims=1)


def _module_device(m: nn.Module) -> torch.device:
    for p in m.parameters():
        return p.device
    return torch.device("cpu")


class GradSampleModuleRandomizedClipping(
    _RandomizedClippingMixin, GradSampleModuleFastGradientClipping
):
    """Wraps a model to compute sketched per-sample norms and clip factors (DP-SGD-RC).

    Use it like Opacus' ``GradSampleModuleFastGradientClipping``: with
    :class:`~opacus_rc.optimizers.RandomizedClipOptimizer` and
    :class:`~opacus_rc.optimizers.DPLossRandomizedClipping`, whose ``backward()`` runs one
    backward pass and :meth:`apply_clipped_sum` when :attr:`bookkeeping` is true, else both
    passes. (Opacus' own ``DPLossFastGradientClipping`` always runs both passes; it works too.)

    Args:
        m: The model (in training mode).
        max_grad_norm: ``C``, the clipping bound (> 0).
        sketch: Estimator name, ``"hutchinson"`` or ``"hutch++"``.
        sketch_dim: ``k``, Gaussian (tail) columns per sample and layer (>= 1). THEORY.md 0.4
            recommends ``k >= 32``.
        sketch_head_dim: Hutch++ head columns (default ``sketch_dim``).
        sketch_generator: Source of the probes. ``None`` (recommended) seeds a private
            generator from :mod:`secrets`; passing one warns and marks the spec not secret.
        secure_mode: Reseed the sketch generator from :mod:`secrets` after every step.
        batch_first: Whether inputs are ``(B, ...)`` (else ``(T, B, ...)``).
        loss_reduction: ``"mean"`` or ``"sum"``, as the loss.
        strict: Reject trainable modules with buffers (Opacus).
        force_functorch: Use functorch for every non-sketched layer (Opacus).
        bookkeeping: ``True`` (default): one backward pass per step (book-keeping, Bu et al.,
            ICML 2023; see the module docstring) if every trainable module supports it, else
            the two-pass path, logged once at INFO with the modules that forced it; never for
            a distributed (DDP/DPDDP, world size > 1) model. ``False``: always two backward
            passes. The :attr:`bookkeeping` property tells which is used. The clipped gradient,
            the probes and the privacy guarantee are the same either way.

    Attributes:
        bookkeeping: Read-only; whether book-keeping (a single backward pass) is used.

    Raises:
        TypeError: A non-bool ``bookkeeping`` (and the type errors of the other arguments).
        ValueError: Unknown sketch, ``sketch_dim < 1``, eval-mode model, bad reduction or
            ``max_grad_norm``, hooks already attached, or a generator in secure mode.
        NotImplementedError: A trainable parameter tied between a sketched (or ghost) module
            and another module, or (at forward time) a sketched module used twice per step.
    """


class GradSampleHooksRandomizedClipping(
    _RandomizedClippingMixin, GradSampleHooksFastGradientClipping
):
    """Hooks-only twin of :class:`GradSampleModuleRandomizedClipping` (``wrap_model=False``).

    Attaches the same hooks to the model without wrapping it: keep using the original model and
    call :meth:`cleanup` to detach. Arguments and errors are those of
    :class:`GradSampleModuleRandomizedClipping`.
    """
