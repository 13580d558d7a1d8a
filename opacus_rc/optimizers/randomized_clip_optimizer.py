"""The DP optimizer of DP-SGD-RC (docs/architecture.md#architecture-step, steps 6-9;
docs/privacy/mechanism.md#mechanism-reduction).

One step releases ``sum_i c_i g_i + N(0, sigma^2 C^2 I)`` with ``c_i = min(1, C / n_hat_i)``,
divided by the expected batch size under ``loss_reduction="mean"``. The clip factors are applied
before the optimizer runs, by the module's private step, which the DP loss
(:class:`~opacus_rc.optimizers.DPLossRandomizedClipping`) runs once per batch
(:meth:`~opacus_rc.grad_sample.private_step.PrivateStep.backward`: it either backpropagates
``sum_i c_i loss_i``, exactly as Opacus' ghost clipping does, or, with book-keeping, writes
``sum_i c_i grad loss_i`` from the first pass's tensors) and whose frozen
:class:`~opacus_rc.grad_sample.private_step.ClipResult` the loss hands to this optimizer
(:meth:`RandomizedClipOptimizer.accept_clip_result`): the only thing that crosses, the
optimizer holds no reference to the grad-sample module. ``step()`` refuses without a pending
clip result and consumes it; it adds the noise, scales, runs post-processing hooks, emits the
step's DP event (:meth:`RandomizedClipOptimizer.dp_event`) and steps the wrapped optimizer.

Formal guarantee (docs/privacy/threat_models.md#threat-models): with per-sample Gaussian sketches
that are fresh every step and secret, the step's sensitivity is ``S = C W^{-1/2}`` with ``W`` in the
chi-square envelope of ``k = sketch_spec.sketch_dim`` columns; the RC accountant composes exactly
that. Edge cases: a zero-norm sample gets ``c_i = 1`` (its contribution is 0); a NaN/inf estimate
raises ``FloatingPointError`` in the module before any clip factor exists; an empty batch gives a
noise-only step that is still accounted. After a failed backward of
:class:`~opacus_rc.optimizers.DPLossRandomizedClipping`, or with a NaN/inf gradient, ``step()``
raises before anything is noised or accounted (:meth:`RandomizedClipOptimizer.check_step_allowed`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch
from opacus.optimizers import DPOptimizerFastGradientClipping
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from opacus_rc._compat.opacus import (
    adjusted_noise_multiplier,
    next_step_skipped,
    wrapped_module,
)
from opacus_rc._compat.torch import tensor_version
from opacus_rc.accountants.events import RandomizedClipDpEvent, step_event
from opacus_rc.config import RandomizedClippingConfig, validate_noise_multiplier
from opacus_rc.grad_sample.private_step import (
    ClipResult,
    StepProtocolError,
    empty_clip_result,
)
from opacus_rc.mechanism import Mechanism
from opacus_rc.optimizers.dp_loss import LOSS_SCALING_REFUSED
from opacus_rc.optimizers.noise import add_gaussian_noise
from opacus_rc.optimizers.post_processing import _PostProcessingChain
from opacus_rc.sketching import SketchSpec
from opacus_rc.units.split import check_no_open_unit

__all__ = ["RandomizedClipOptimizer"]

_TWO_BACKWARDS = (
    "backward() was called twice without optimizer.step() or optimizer.zero_grad() in between: "
    "the randomized-clipping loss cannot accumulate gradients over backward calls (the first "
    "batch's clipped gradients would be dropped, Opacus issue 683). Step after every backward, "
    "and use opacus.utils.batch_memory_manager.BatchMemoryManager to split a logical batch "
    "into physical ones (with a UnitDataLoader, units=: "
    "opacus_rc.units.UnitBatchMemoryManager, which keeps units whole or, with "
    "split_units=True, cuts them and yields each batch's unit_split=)."
)
_FAILED = (
    "the last backward() of the randomized-clipping loss raised; its gradients may be "
    "unclipped, so no step is taken and nothing is accounted. Call optimizer.zero_grad() and "
    "continue with a new batch (note that skipping a batch because of one sample's data is "
    "itself outside the DP guarantee)."
)
_NO_FACTORS = (
    "optimizer.step() was called but no clip factors were computed for them (the gradients "
    "it would release): {why}. No step is taken "
    "and nothing is accounted. Use loss = criterion(model(x), y); loss.backward(); "
    "optimizer.step(), with optimizer.zero_grad() before each batch, and the criterion "
    "returned by make_private."
)
_NO_RESULT = (
    "no private backward ran since the last step or zero_grad() (step() before backward(), "
    "step() twice, or zero_grad() between backward() and step()), or the loss did not come "
    "from the criterion returned by make_private (a plain loss.backward(), or Opacus' own "
    "DPLossFastGradientClipping: use opacus_rc.optimizers.DPLossRandomizedClipping, which "
    "hands the step's ClipResult to the optimizer)"
)

#: ``expected_batch_size`` not given: the mechanism's divisor (required without a mechanism).
FROM_MECHANISM: Any = object()


class RandomizedClipOptimizer(DPOptimizerFastGradientClipping):
    """``DPOptimizerFastGradientClipping`` tied to a randomized-clipping grad-sample module.

    Args:
        optimizer: The wrapped ``torch.optim.Optimizer``.
        grad_sample_module: The :class:`~opacus_rc.grad_sample.GradSampleModuleRandomizedClipping`
            (or hooks twin) that computes the clip factors. Its ``sketch_spec`` is what this
            optimizer reports, and its clip bound is kept equal to ``max_grad_norm``.
        noise_multiplier: ``sigma`` (>= 0); the noise std is ``sigma * C``. Required without
            ``mechanism``; with one, taken from it (if given, it must equal it).
        max_grad_norm: ``C`` (> 0); must equal the module's ``max_grad_norm`` (and the
            mechanism's). Setting it later (e.g. by an Opacus clip scheduler) updates the module
            too.
        expected_batch_size: Divisor of the noisy sum under ``loss_reduction="mean"`` (the
            expected, not realised, Poisson batch size). Required without ``mechanism``; with
            one, its per-process :attr:`~opacus_rc.mechanism.Mechanism.divisor` (if given, it
            must equal it).
        loss_reduction: ``"mean"`` or ``"sum"``; must equal the module's.
        generator: Generator for the Gaussian noise (never the sketch generator).
        secure_mode: Opacus' secure noise generation.
        mechanism: The run's :class:`~opacus_rc.mechanism.Mechanism` (``make_private`` passes
            it): the divisor, ``sigma``, ``C`` and every step's DP event come from it
            (:attr:`mechanism`). None (an optimizer built by hand): the arguments above, and
            each step's event at the rate the accountant's hook gives.

    Raises:
        TypeError: If ``grad_sample_module`` is not a randomized-clipping module, or
            ``noise_multiplier`` or ``expected_batch_size`` is missing without a mechanism.
        ValueError: Invalid ``noise_multiplier`` or ``max_grad_norm``, or a mismatch with the
            module's ``max_grad_norm``, ``loss_reduction`` or ``sketch_spec``, or with the
            mechanism.
    """

    #: post_processing.attach_post_processing_hook need not warn: attach_step_hook keeps the chain.
    _keeps_post_processing = True

    #: torch.amp.GradScaler.step then calls step() directly, with ``self.grad_scale`` and
    #: ``self.found_inf`` set, instead of unscaling the clipped sum and skipping the step on an
    #: overflow; check_step_allowed refuses such a step (dp_loss.LOSS_SCALING_REFUSED says why).
    _step_supports_amp_scaling = True

    #: Who draws the noise (a key of :data:`~opacus_rc.optimizers.noise.NOISE_PLACEMENTS`).
    noise_placement: str = "single_process"

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        grad_sample_module: Any,
        noise_multiplier: float | None = None,
        expected_batch_size: Any = FROM_MECHANISM,
        max_grad_norm: float | None = None,
        loss_reduction: str | None = None,
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
        mechanism: Mechanism | None = None,
    ) -> None:
        noise_multiplier, expected_batch_size, max_grad_norm = _step_values(
            mechanism,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            max_grad_norm=max_grad_norm,
        )
        config = getattr(grad_sample_module, "clipping_config", None)
        if not isinstance(config, RandomizedClippingConfig) or not hasattr(
            grad_sample_module, "private_step"
        ):
            raise TypeError(
                "grad_sample_module must be a GradSampleModuleRandomizedClipping or "
                f"GradSampleHooksRandomizedClipping, got {type(grad_sample_module).__name__}"
            )
        noise_multiplier = validate_noise_multiplier(noise_multiplier)
        if max_grad_norm is None:
            max_grad_norm = config.max_grad_norm
        if loss_reduction is None:
            loss_reduction = config.loss_reduction
        if config.max_grad_norm != max_grad_norm:
            raise ValueError(
                f"max_grad_norm={max_grad_norm} differs from the grad-sample module's "
                f"max_grad_norm={config.max_grad_norm}: clipping and noise must use "
                "the same bound"
            )
        if config.loss_reduction != loss_reduction:
            raise ValueError(
                f"loss_reduction={loss_reduction!r} differs from the grad-sample module's "
                f"{config.loss_reduction!r}"
            )
        # The module is read here and not held: the plain model (an optimizer parameter
        # outside it is refused) and the sketch the clip factors come from, fixed by its
        # frozen config (every ClipResult is checked against it, accept_clip_result).
        self._model: torch.nn.Module = wrapped_module(grad_sample_module)
        self._sketch_spec: SketchSpec = config.sketch_spec
        if mechanism is not None and mechanism.sketch_spec != self._sketch_spec:
            raise ValueError(
                f"the mechanism accounts the sketch {mechanism.sketch_spec}, the grad-sample "
                f"module clips with {self._sketch_spec}: build both from one make_private call"
            )
        self._mechanism = mechanism
        self._accounted_rate = None if mechanism is None else mechanism.accounted_rate
        self._events: dict[tuple[float, float, int], RandomizedClipDpEvent] = {}
        #: The last ClipResult handed over; _pending: that of the gradients step() releases.
        self._clip_result: ClipResult | None = None
        self._pending: ClipResult | None = None
        self._pending_grads: list[tuple[Any, Any, int]] = []
        self._failed = False
        #: Whether a private backward may run now (no clip result pending, no failed backward
        #: since zero_grad()): the DP loss reads it before each backward.
        self.backward_allowed = True
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=generator,
            secure_mode=secure_mode,
        )

    @property
    def max_grad_norm(self) -> float:
        """``C``: the clip bound the DP loss hands to each private backward and the noise
        scale of this optimizer (one value: set it here, e.g. by an Opacus clip scheduler)."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        if isinstance(value, bool) or not (
            isinstance(value, (int, float)) and math.isfinite(value) and value > 0
        ):
            raise ValueError(
                f"randomized clipping needs one finite max_grad_norm > 0, got {value!r}"
            )
        self._max_grad_norm = value

    @property
    def sketch_spec(self) -> SketchSpec:
        """The sketch that produces the clip factors: the module's, handed over at
        construction; every :class:`~opacus_rc.grad_sample.private_step.ClipResult` is checked
        against it (:meth:`accept_clip_result`).

        The accountant's step hook reads ``getattr(optim, "sketch_spec", None)``.
        """
        return self._sketch_spec

    def accept_clip_result(self, result: ClipResult) -> None:
        """Take what the private backward of a (physical) batch returned: the step's pending
        clip result, which the next ``step()`` requires and consumes.

        Called by the DP loss after
        :meth:`~opacus_rc.grad_sample.private_step.PrivateStep.backward` (the clipped gradient
        sum is in ``p.grad``), or by a training loop with the result of
        :meth:`~opacus_rc.grad_sample.private_step.PrivateStep.empty_batch`. The result is kept
        as :attr:`last_clip_result`; the gradients it covers are remembered, so that a
        gradient changed before ``step()`` (a later hooked backward) is refused.

        Args:
            result: The batch's :class:`~opacus_rc.grad_sample.private_step.ClipResult`.

        Raises:
            RuntimeError: If its clip factors came from a sketch other than :attr:`sketch_spec`
                (a loss built with another grad-sample module than this optimizer's): this
                optimizer would account the step for a sketch that did not produce its clip
                factors (the result is not taken, so ``step()`` refuses too).
            StepProtocolError: A clip result is pending already (two backwards without a step).
        """
        if result.sketch_spec != self._sketch_spec:
            raise RuntimeError(
                f"the clip factors of this backward came from the sketch {result.sketch_spec}, "
                f"but this optimizer accounts its steps for {self._sketch_spec}: the DP loss "
                "and the optimizer belong to different grad-sample modules. Build the criterion "
                "from this optimizer's module (make_private returns matching ones)"
            )
        if self._pending is not None or self._failed:
            self.check_backward_allowed()  # raises, saying which
        self._clip_result = result
        self._pending = result
        self.backward_allowed = False
        self._pending_grads = []
        for p in self.params:
            self._pending_grads.append((p, p.grad, tensor_version(p.grad)))

    def check_backward_allowed(self) -> None:
        """Refuse a private backward while this optimizer holds a pending clip result or the
        last backward failed (the DP loss asks before it backpropagates anything).

        Raises:
            StepProtocolError: A clip result is pending (call ``step()`` first), or the last
                backward failed (call ``zero_grad()`` first).
        """
        if self._failed:
            raise StepProtocolError(
                "the last backward() of the randomized-clipping loss raised; call "
                "optimizer.zero_grad() before the next batch's forward and backward"
            )
        if self._pending is not None:
            raise StepProtocolError(_TWO_BACKWARDS)

    def backward_failed(self) -> None:
        """The DP loss's private backward raised: no gradient is kept and ``step()`` refuses
        until ``zero_grad()``."""
        self._pending = None
        self._pending_grads = []
        self._failed = True
        self.backward_allowed = False

    @property
    def last_clip_result(self) -> ClipResult | None:
        """The :class:`~opacus_rc.grad_sample.private_step.ClipResult` of the last private
        backward handed to this optimizer (None before the first). Its norms are not
        privatized: for debugging and logging only."""
        return self._clip_result

    @property
    def mechanism(self) -> Mechanism | None:
        """The run's :class:`~opacus_rc.mechanism.Mechanism` (read-only), or None for an
        optimizer built without one.

        The record ``make_private`` built; if an Opacus scheduler has since changed
        :attr:`noise_multiplier` or :attr:`max_grad_norm`, the same record with the values the
        next step uses.
        """
        mechanism = self._mechanism
        if mechanism is None:
            return None
        sigma, bound = self.noise_multiplier, self.max_grad_norm
        if (sigma, bound) == (mechanism.noise_multiplier, mechanism.max_grad_norm):
            return mechanism
        return dataclasses.replace(mechanism, noise_multiplier=sigma, max_grad_norm=bound)

    def dp_event(self, *, sample_rate: float | None = None) -> RandomizedClipDpEvent:
        """This step's complete DP event, as the accountant's step hook composes it.

        With a :attr:`mechanism` (``make_private``), the event is the mechanism's
        (:meth:`~opacus_rc.mechanism.Mechanism.step_event`: its ``sigma``, its accounted rate
        times :attr:`accumulated_iterations`, its sketch and threat model). Without one it is
        built from what this optimizer holds, without reading the grad-sample module:
        ``sigma`` is :attr:`noise_multiplier` (what is accounted; Opacus' adaptive clipping
        may noise with more, never less), ``q = sample_rate * accumulated_iterations`` (as
        Opacus' accountants compute it), the sketch is :attr:`sketch_spec` (handed over at
        construction; every clip result of the step was checked against it), and the threat
        model is the strongest the sketch supports
        (:func:`~opacus_rc.accountants.events.accounted_threat_model`: ``"hidden"`` for
        per-sample, secret sketches, else ``"revealed"``; an accountant built for
        ``"revealed"`` accounts it so).

        Args:
            sample_rate: The Poisson sampling rate of one physical batch, in ``(0, 1]``, as the
                accountant's hook was attached with; with a mechanism it must be its accounted
                rate (None: the mechanism's).

        Returns:
            The :class:`~opacus_rc.accountants.events.RandomizedClipDpEvent` of the step.

        Raises:
            ValueError: If ``sample_rate`` (times the accumulated iterations) is not in
                ``(0, 1]``, or ``noise_multiplier`` is invalid; with a mechanism, if
                ``sample_rate`` is not its accounted rate (an accountant attached at another
                rate would account another mechanism than the run's).
            TypeError: Without a mechanism, if ``sample_rate`` is None.
        """
        mechanism = getattr(self, "_mechanism", None)
        if mechanism is not None:
            if sample_rate is not None and sample_rate != self._accounted_rate:
                raise ValueError(
                    f"the accountant's hook was attached at sample_rate={sample_rate}, but the "
                    f"run's mechanism accounts each step at {self._accounted_rate} "
                    "(engine.mechanism.accounted_rate): attach it at that rate"
                )
            # Built once per (sigma, C, accumulated iterations) and reused: an event is
            # validated when it is built, not at every step.
            key = (self.noise_multiplier, self._max_grad_norm, self.accumulated_iterations)
            event = self._events.get(key)
            if event is None:
                if key[:2] != (mechanism.noise_multiplier, mechanism.max_grad_norm):
                    mechanism = dataclasses.replace(
                        mechanism, noise_multiplier=key[0], max_grad_norm=key[1]
                    )
                event = mechanism.step_event(accumulated_iterations=key[2])
                self._events[key] = event
            return event
        if sample_rate is None:
            raise TypeError("dp_event needs sample_rate for an optimizer without a mechanism")
        return step_event(
            noise_multiplier=self.noise_multiplier,
            sample_rate=sample_rate * self.accumulated_iterations,
            # the public property (a plain twin of this optimizer has it)
            sketch_spec=self.sketch_spec,
        )

    def attach_step_hook(self, fn: Any) -> None:
        """Attach the (accountant) step hook, keeping any post-processing hooks before it."""
        if isinstance(self.step_hook, _PostProcessingChain):
            self.step_hook.inner = fn
        else:
            self.step_hook = fn

    def accumulate(self) -> None:
        """Copy the clipped gradient sum into ``p.summed_grad``.

        Unlike Opacus, a parameter without ``.grad`` (not reached by this batch) counts as a
        zero gradient, so it is still noised instead of failing. The step's clipped gradients
        are consumed (a new ``backward()`` is allowed).

        When this step is noised now (not a physical batch that only accumulates), the first
        sum is the gradient tensor itself, not a copy: :meth:`add_noise` replaces every
        ``p.grad`` by a new tensor before anything (``zero_grad``, a backward) could change the
        old one, and nothing writes to a clipped sum. A batch that only accumulates copies, as
        Opacus does, since ``zero_grad(set_to_none=False)`` zeroes ``p.grad`` in place.
        """
        noised_now = not next_step_skipped(self)
        for p in self.params:
            grad = p.grad.data if p.grad is not None else torch.zeros_like(p)
            if p.summed_grad is not None:
                p.summed_grad.add_(grad)
            elif noised_now:
                p.summed_grad = grad
            else:
                p.summed_grad = copy.deepcopy(grad)
        self._pending, self._pending_grads = None, []
        self.backward_allowed = not self._failed

    def clipped_sums(self) -> list[torch.Tensor]:
        """Each parameter's clipped gradient sum, in :attr:`params` order (``p.summed_grad``)."""
        sums = []
        for p in self.params:
            sums.append(p.summed_grad)
        return sums

    def add_noise(self) -> None:
        """``p.grad = clipped sum + N(0, sigma^2 C^2)``, drawn as :attr:`noise_placement` says.

        The one noise path of every randomized-clipping optimizer:
        :func:`~opacus_rc.optimizers.noise.add_gaussian_noise`. ``sigma`` is
        ``noise_multiplier``, or the value Opacus' adaptive clipping sets for the noise only
        (read by Opacus' own ``add_noise`` too).
        """
        sigma = adjusted_noise_multiplier(self)
        if sigma is None:
            sigma = self.noise_multiplier
        add_gaussian_noise(
            self.params,
            self.clipped_sums(),
            std=sigma * self._max_grad_norm,
            placement=self.noise_placement,
            generator=self.generator,
            secure_mode=self.secure_mode,
            rank=getattr(self, "rank", 0),
        )

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Opacus' ``zero_grad``; also ends the step (a pending clip result, a failed
        backward)."""
        super().zero_grad(set_to_none)
        self._pending, self._pending_grads, self._failed = None, [], False
        self.backward_allowed = True

    def check_step_allowed(self) -> None:
        """Raise unless the gradients about to be noised are clipped, finite and in sync.

        Called first in :meth:`pre_step`, before anything is accumulated, noised or accounted.
        The step invariant: a clip result is pending (handed over by the DP loss since the last
        step), made at this optimizer's ``max_grad_norm``, covering every gradient, none of
        which changed since; finiteness is one reduction over all gradients (one host
        synchronisation).

        Raises:
            StepProtocolError: The last private backward failed, no clip result is pending
                (step before backward, a second step, a zero_grad in between, a loss that did
                not come from the DP criterion), a gradient changed after the private backward,
                or a parameter holds a gradient that got no clip factor (a ``RuntimeError``).
            RuntimeError: If the optimizer holds a parameter that is not the private model's
                (e.g. a learnable temperature added with ``add_param_group`` after
                ``make_private``): no per-sample norm covers it, so its gradient would be
                dropped (book-keeping) or released unclipped; nothing is noised or accounted.
                Also if the module's ``max_grad_norm`` was changed behind the optimizer, or if
                ``torch.amp.GradScaler.step`` called this step (fp16 loss scaling,
                :data:`~opacus_rc.optimizers.dp_loss.LOSS_SCALING_REFUSED`).
            FloatingPointError: If a gradient is NaN or inf.
        """
        if hasattr(self, "found_inf") or hasattr(self, "grad_scale"):
            # Set by torch.amp.GradScaler.step (see _step_supports_amp_scaling); dropped here
            # because the scaler, interrupted, does not delete them.
            for name in ("found_inf", "grad_scale"):
                self.__dict__.pop(name, None)
            raise RuntimeError(LOSS_SCALING_REFUSED)
        inside = set()
        for p in self._model.parameters():
            inside.add(id(p))
        for p in self.params:
            if id(p) not in inside:
                raise RuntimeError(_outside_message(self._outside_parameters()))
        if self._failed:
            raise StepProtocolError(_FAILED)
        result = self._pending
        if result is None:
            raise StepProtocolError(_NO_FACTORS.format(why=_NO_RESULT))
        if result.max_grad_norm != self._max_grad_norm:
            raise RuntimeError(
                f"the clip factors of this step were made at max_grad_norm="
                f"{result.max_grad_norm} but the optimizer noises for {self._max_grad_norm}: "
                "set optimizer.max_grad_norm before the backward, not between it and step()"
            )
        stray, changed = [], []
        for p, grad, version in self._pending_grads:
            if p.grad is not grad or (grad is not None and tensor_version(grad) != version):
                changed.append(tuple(p.shape))
            elif grad is not None and id(p) not in result.clipped:
                stray.append(tuple(p.shape))
        if stray:
            raise StepProtocolError(
                f"parameters of shapes {stray[:5]} hold a gradient but got no per-sample norm "
                "or clip factor in this step's private backward (made trainable, tied or "
                "replaced after make_private?); they would be released unclipped. Call "
                "make_private again on the plain model after changing which parameters train."
            )
        grads, sums = [], []
        for p in self.params:  # one pass over each gradient, one host synchronisation
            g = p.grad
            if g is not None:
                grads.append(g)
                # A sharded (FSDP2 DTensor) gradient: this rank's shard; the ranks then agree
                # (DistributedRandomizedClipOptimizer.check_step_allowed).
                local = g.to_local() if isinstance(g, DTensor) else g
                # A sum is NaN or inf if an entry is; one memory-bound pass where isfinite().all()
                # takes several. A finite sum decides; a non-finite one (an entry, or finite
                # entries whose sum overflows) is decided entry by entry below.
                sums.append(local.sum().float().to(grads[0].device))
        if sums and not bool(torch.isfinite(torch.stack(sums)).all()):
            bad = sum(1 for g in grads if not _all_finite([g]))
        else:
            bad = 0
        if bad:
            raise FloatingPointError(
                f"the clipped gradients of {bad} parameter(s) contain NaN or inf; no step "
                "is taken and nothing is accounted (check the loss and inputs for NaN/inf)"
            )
        if changed:
            raise StepProtocolError(
                f"{len(changed)} gradient(s) (shapes {changed[:5]}) changed after the private "
                "backward handed its clip factors over (a later backward, e.g. a plain "
                "loss.backward() or a hooked backward that failed, or an in-place change): "
                "they may hold unclipped parts: no step is taken and nothing is accounted. "
                "Call optimizer.zero_grad() and run the batch again"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group``, refusing parameters outside the model.

        Raises:
            ValueError: If the group holds a parameter that is not one of the private model's
                (see :meth:`check_step_allowed`); the group is not added.
        """
        super().add_param_group(param_group)
        if getattr(self, "_model", None) is None:
            return  # called while Opacus builds the optimizer
        for p in self.param_groups[-1]["params"]:
            if not hasattr(p, "summed_grad"):
                p.summed_grad = None  # as Opacus' constructor sets it on the first groups
        outside = self._outside_parameters(groups=[len(self.param_groups) - 1])
        if outside:
            self.param_groups.pop()
            raise ValueError(_outside_message(outside))

    def _outside_parameters(self, *, groups: list[int] | None = None) -> list[str]:
        """The optimizer's parameters (of ``groups``, default all) that are not the private
        model's, described by position."""
        inside = {id(p) for p in self._model.parameters()}
        indices = range(len(self.param_groups)) if groups is None else groups
        return [
            f"param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)})"
            for g in indices
            for i, p in enumerate(self.param_groups[g]["params"])
            if id(p) not in inside
        ]

    def noise_only_step(self, closure: Any = None) -> Any:
        """The step of an empty Poisson batch, for a model that cannot run on ``B = 0``.

        Poisson sampling draws an empty batch with probability ``(1 - q)^N``; the step must
        still be taken, noised and accounted (docs/privacy/mechanism.md: an empty batch is a
        noise-only step), and a model that takes ``B = 0`` does this through its forward and
        backward. Many cannot (Hugging Face attention reshapes with ``view(B, T, -1, ...)``):
        call this instead of the forward, backward and ``step()``. Every gradient is the clipped
        sum of no sample, zero, so each parameter gets ``N(0, sigma^2 C^2)`` noise, scaled as
        Opacus scales it (by ``expected_batch_size`` under ``loss_reduction="mean"``), and the
        accountant counts one step. Any ``.grad`` the parameters hold is dropped. In a
        distributed run every rank must instead run its forward and backward (FSDP2's
        collectives need them; docs/distributed.md).

        Args:
            closure: Passed to the wrapped optimizer's ``step``.

        Returns:
            What ``step()`` returns.

        Raises:
            StepProtocolError: If a private backward's clip result is pending or the last
                backward failed (an empty-batch step must replace the batch's forward and
                backward; the optimizer sees no forward, so a training loop that ran one hands
                over ``module.private_step.empty_batch()``'s result instead, which checks it).
        """
        if self._pending is not None or self._failed:
            phase = "failed" if self._failed else "applied"
            raise StepProtocolError(
                f"an empty-batch step was requested in phase {phase!r}: it must "
                "replace the batch's forward and backward (call optimizer.zero_grad() first, "
                "and do not run the model on the batch)"
            )
        DPOptimizerFastGradientClipping.zero_grad(self, set_to_none=True)
        self.accept_clip_result(
            empty_clip_result(sketch_spec=self._sketch_spec, max_grad_norm=self._max_grad_norm)
        )
        return self.step(closure)

    def pre_step(self, closure: Any = None) -> bool | None:
        """:meth:`check_step_allowed`, then Opacus' accumulation, noise, scaling and hooks.

        Raises:
            RuntimeError: See :meth:`check_step_allowed`.
            FloatingPointError: See :meth:`check_step_allowed`.
            StepProtocolError: If this step ends a logical batch while a unit cut across its
                physical batches is open
                (:func:`~opacus_rc.units.check_no_open_unit`).
        """
        self.check_step_allowed()
        # A unit cut across physical batches must be closed by the batch that ends the step.
        result = self._pending
        if result is not None and result.open_unit is not None:
            check_no_open_unit(result.open_unit, step_ends=not next_step_skipped(self))
        return super().pre_step(closure)


def _outside_message(outside: list[str]) -> str:
    """The error for optimizer parameters that are not the private model's."""
    return (
        f"the optimizer's parameters {outside[:5]} are not parameters of the private model "
        "(added with add_param_group after make_private, e.g. a learnable temperature, or "
        "left in the optimizer when their module was replaced or tied?): no per-sample norm "
        "or clip factor covers them, so their gradient would be dropped or released "
        "unclipped. No step is taken and nothing is accounted. Make it a parameter of the "
        "model used in its forward (e.g. a submodule that divides the logits by it), then "
        "call make_private on the model with an optimizer over model.parameters()"
    )


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite: one reduction, one host synchronisation."""
    # A sharded (FSDP2 DTensor) gradient: this rank's shard; the ranks then agree
    # (DistributedRandomizedClipOptimizer.check_step_allowed).
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    flags = torch.stack([torch.isfinite(t).all().to(tensors[0].device) for t in tensors])
    return bool(flags.all())


def _step_values(
    mechanism: Mechanism | None,
    *,
    noise_multiplier: float | None,
    expected_batch_size: Any,
    max_grad_norm: float | None,
) -> tuple[float, Any, float | None]:
    """``(sigma, divisor, C)`` of the optimizer: the mechanism's, or the arguments without one.

    Raises:
        TypeError: Without a mechanism, ``noise_multiplier`` or ``expected_batch_size``
            missing.
        ValueError: A given value that differs from the mechanism's.
    """
    if mechanism is None:
        if noise_multiplier is None or expected_batch_size is FROM_MECHANISM:
            raise TypeError(
                "RandomizedClipOptimizer needs noise_multiplier and expected_batch_size "
                "(or the run's mechanism=, as make_private passes it)"
            )
        return noise_multiplier, expected_batch_size, max_grad_norm
    if not isinstance(mechanism, Mechanism):
        raise TypeError(f"mechanism must be a Mechanism, got {type(mechanism).__name__}")
    given = {
        "noise_multiplier": (noise_multiplier, mechanism.noise_multiplier),
        "expected_batch_size": (expected_batch_size, mechanism.divisor),
        "max_grad_norm": (max_grad_norm, mechanism.max_grad_norm),
    }
    for name, (value, own) in given.items():
        if value is not None and value is not FROM_MECHANISM and value != own:
            raise ValueError(
                f"{name}={value!r} differs from the mechanism's {own!r}: the optimizer's "
                "divisor, noise and events come from the run's mechanism"
            )
    return mechanism.noise_multiplier, mechanism.divisor, mechanism.max_grad_norm
