"""The DP optimizer of DP-SGD-RC (DESIGN.md section 3, steps 4-6; THEORY.md B.1).

One step releases ``sum_i c_i g_i + N(0, sigma^2 C^2 I)`` with ``c_i = min(1, C / n_hat_i)``,
divided by the expected batch size under ``loss_reduction="mean"``. The clip factors are applied
before the optimizer runs, by the DP loss (:class:`~opacus_rc.optimizers.DPLossRandomizedClipping`,
whose ``backward()`` asks the grad-sample module for :meth:`get_clipping_coef` and either
backpropagates ``sum_i c_i loss_i``, exactly as Opacus' ghost clipping does, or, with
book-keeping, has the module write ``sum_i c_i grad loss_i`` from the first pass's tensors).
This optimizer adds the noise, scales, runs post-processing hooks, tells the accountant the
step's :class:`SketchSpec` and steps the wrapped optimizer.

Formal guarantee (THEORY.md B.1-B.2): with per-sample Gaussian sketches that are fresh every
step and secret, the step's sensitivity is ``S = C W^{-1/2}`` with ``W`` in the chi-square
envelope of ``k = sketch_spec.sketch_dim`` columns; the RC accountant composes exactly that.
Edge cases: a zero-norm sample gets ``c_i = 1`` (its contribution is 0); a NaN/inf estimate
raises ``FloatingPointError`` in the module before any clip factor exists; an empty batch gives
a noise-only step that is still accounted. After a failed backward of
:class:`~opacus_rc.optimizers.DPLossRandomizedClipping`, or with a NaN/inf gradient, ``step()``
raises before anything is noised or accounted (:meth:`RandomizedClipOptimizer.check_step_allowed`).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from opacus.optimizers import DPOptimizerFastGradientClipping
from torch.optim import Optimizer

from opacus_rc.optimizers.post_processing import _PostProcessingChain
from opacus_rc.optimizers.registry import register_optimizer
from opacus_rc.sketching import SketchSpec

__all__ = ["RandomizedClipOptimizer"]


@register_optimizer("randomized", distributed=False)
class RandomizedClipOptimizer(DPOptimizerFastGradientClipping):
    """``DPOptimizerFastGradientClipping`` tied to a randomized-clipping grad-sample module.

    Args:
        optimizer: The wrapped ``torch.optim.Optimizer``.
        grad_sample_module: The :class:`~opacus_rc.grad_sample.GradSampleModuleRandomizedClipping`
            (or hooks twin) that computes the clip factors. Its ``sketch_spec`` is what this
            optimizer reports, and its clip bound is kept equal to ``max_grad_norm``.
        noise_multiplier: ``sigma`` (>= 0); the noise std is ``sigma * C``.
        max_grad_norm: ``C`` (> 0); must equal the module's ``max_grad_norm``. Setting it later
            (e.g. by an Opacus clip scheduler) updates the module too.
        expected_batch_size: Divisor of the noisy sum under ``loss_reduction="mean"`` (the
            expected, not realised, Poisson batch size).
        loss_reduction: ``"mean"`` or ``"sum"``; must equal the module's.
        generator: Generator for the Gaussian noise (never the sketch generator).
        secure_mode: Opacus' secure noise generation.

    Raises:
        TypeError: If ``grad_sample_module`` is not a randomized-clipping module.
        ValueError: Invalid ``noise_multiplier`` or ``max_grad_norm``, or a mismatch with the
            module's ``max_grad_norm`` or ``loss_reduction``.
    """

    #: post_processing.attach_post_processing_hook need not warn: attach_step_hook keeps the chain.
    _keeps_post_processing = True

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        grad_sample_module: Any,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: int | None,
        loss_reduction: str = "mean",
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
    ) -> None:
        if not isinstance(getattr(grad_sample_module, "sketch_spec", None), SketchSpec) or not (
            callable(getattr(grad_sample_module, "get_clipping_coef", None))
        ):
            raise TypeError(
                "grad_sample_module must be a GradSampleModuleRandomizedClipping or "
                f"GradSampleHooksRandomizedClipping, got {type(grad_sample_module).__name__}"
            )
        if isinstance(noise_multiplier, bool) or not (
            isinstance(noise_multiplier, (int, float))
            and math.isfinite(noise_multiplier)
            and noise_multiplier >= 0
        ):
            raise ValueError(
                f"noise_multiplier must be a finite number >= 0, got {noise_multiplier}"
            )
        if grad_sample_module.max_grad_norm != max_grad_norm:
            raise ValueError(
                f"max_grad_norm={max_grad_norm} differs from the grad-sample module's "
                f"max_grad_norm={grad_sample_module.max_grad_norm}: clipping and noise must use "
                "the same bound"
            )
        if grad_sample_module.loss_reduction != loss_reduction:
            raise ValueError(
                f"loss_reduction={loss_reduction!r} differs from the grad-sample module's "
                f"{grad_sample_module.loss_reduction!r}"
            )
        self._grad_sample_module = grad_sample_module
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
        """``C``: the clip bound of the module and the noise scale of this optimizer."""
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
        self._grad_sample_module.max_grad_norm = value

    @property
    def sketch_spec(self) -> SketchSpec:
        """The sketch that produced this step's clip factors, read from the module.

        The accountant's step hook reads ``getattr(optim, "sketch_spec", None)``.
        """
        return self._grad_sample_module.sketch_spec

    @property
    def grad_sample_module(self) -> Any:
        """The randomized-clipping grad-sample module this optimizer is tied to."""
        return self._grad_sample_module

    def attach_step_hook(self, fn: Any) -> None:
        """Attach the (accountant) step hook, keeping any post-processing hooks before it."""
        if isinstance(self.step_hook, _PostProcessingChain):
            self.step_hook.inner = fn
        else:
            self.step_hook = fn

    def accumulate(self) -> None:
        """Copy the clipped gradient sum into ``p.summed_grad``.

        Unlike Opacus, a parameter without ``.grad`` (not reached by this batch) counts as a
        zero gradient, so it is still noised instead of failing. The clipped gradients of the
        last ``backward()`` are consumed (a new ``backward()`` is allowed).
        """
        for p in self.params:
            grad = p.grad.data if p.grad is not None else torch.zeros_like(p)
            if p.summed_grad is not None:
                p.summed_grad.add_(grad)
            else:
                p.summed_grad = copy.deepcopy(grad)
        self._grad_sample_module.consume_clip_factors()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Opacus' ``zero_grad``; also clears the state left by a failed or pending backward."""
        super().zero_grad(set_to_none)
        self._rc_backward_failed = False
        self._grad_sample_module.consume_clip_factors()

    def check_step_allowed(self) -> None:
        """Raise unless the gradients about to be noised are clipped, finite and in sync.

        Called first in :meth:`pre_step`, before anything is accumulated, noised or accounted.

        Raises:
            RuntimeError: If the last ``backward()`` of the randomized-clipping loss failed
                (its gradients may be unclipped); if a parameter has a non-zero gradient but
                the module issued no clip factors since the last step, or a backward pass ran
                after they were issued (a plain ``loss.backward()`` that bypassed the
                criterion returned by ``make_private``, or a second ``step()`` after one
                backward); or if the module's ``max_grad_norm`` was changed behind the
                optimizer. A step whose gradients are all ``None`` or zero (a noise-only step
                for an empty batch) is allowed.
            FloatingPointError: If a gradient is NaN or inf.
        """
        if getattr(self, "_rc_backward_failed", False):
            raise RuntimeError(
                "the last backward() of the randomized-clipping loss raised; its gradients may "
                "be unclipped, so no step is taken and nothing is accounted. Call "
                "optimizer.zero_grad() and continue with a new batch (note that skipping a "
                "batch because of one sample's data is itself outside the DP guarantee)."
            )
        if not self._grad_sample_module.clip_factors_pending:
            unclipped = [p for p in self.params if p.grad is not None and bool(p.grad.any())]
            if unclipped:
                raise RuntimeError(
                    f"optimizer.step() found non-zero gradients on {len(unclipped)} "
                    "parameter(s) but no clip factors were computed for them: they are not "
                    "clipped. Either the loss did not come from the criterion returned by "
                    "make_private (e.g. a plain nn.CrossEntropyLoss()(...).backward()), or "
                    "step() was called twice after one backward(). No step is taken and "
                    "nothing is accounted. Use loss = criterion(model(x), y); loss.backward(); "
                    "optimizer.step(), with optimizer.zero_grad() before each batch."
                )
        if self._grad_sample_module.max_grad_norm != self._max_grad_norm:
            raise RuntimeError(
                f"the grad-sample module clips at {self._grad_sample_module.max_grad_norm} but "
                f"the optimizer noises for {self._max_grad_norm}; set optimizer.max_grad_norm "
                "(it updates both)"
            )
        bad = [i for i, p in enumerate(self.params) if p.grad is not None and not _finite(p.grad)]
        if bad:
            raise FloatingPointError(
                f"the clipped gradients of {len(bad)} parameter(s) contain NaN or inf; no step "
                "is taken and nothing is accounted (check the loss and inputs for NaN/inf)"
            )

    def pre_step(self, closure: Any = None) -> bool | None:
        """:meth:`check_step_allowed`, then Opacus' accumulation, noise, scaling and hooks.

        Raises:
            RuntimeError: See :meth:`check_step_allowed`.
            FloatingPointError: See :meth:`check_step_allowed`.
        """
        self.check_step_allowed()
        return super().pre_step(closure)


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())
