"""The two-pass DP loss of randomized clipping, with the failure modes made explicit.

Opacus' ``DPLossFastGradientClipping`` wraps the criterion so that ``loss.backward()`` runs
both passes of ghost clipping (norms, then ``sum_i c_i loss_i``). :class:`DPLossRandomizedClipping`
is that loss with four guarantees added (``tests/reliability/CATALOGUE.md``):

1. **A failed backward never becomes a step.** If anything raises between the first pass and
   the end of the second (a NaN/inf norm estimate, a module in eval mode, a broadcast input),
   the gradients are cleared (``p.grad = None``; ``p.summed_grad`` of earlier virtual steps is
   kept) and the optimizer refuses to step until ``optimizer.zero_grad()``: no unclipped
   gradient is released and nothing is accounted.
2. **One clip factor per sample.** The number of clip factors must equal the number of
   per-sample losses. Opacus multiplies them with broadcasting, so a model whose trainable
   modules only see a batch-broadcast input (``position_ids`` of shape ``[1, T]``, Opacus
   issue 841) or a per-token loss without ``shape=`` would be clipped with one factor for the
   whole batch.
3. **No silent gradient accumulation.** A second ``backward()`` before ``optimizer.step()`` or
   ``zero_grad()`` would discard the first one's clipped gradients (Opacus issue 683: the
   two-pass loss zeroes gradients between its passes). It raises instead; use Opacus'
   ``BatchMemoryManager`` (virtual steps) to split a logical batch.
4. Hooks are re-enabled even if the second pass raises.
"""

from __future__ import annotations

from typing import Any

import torch
from opacus.utils.fast_gradient_clipping_utils import (
    DPLossFastGradientClipping,
    DPTensorFastGradientClipping,
)

__all__ = ["DPLossRandomizedClipping", "DPTensorRandomizedClipping"]

_ARITHMETIC = (
    "__truediv__",
    "__mul__",
    "__rmul__",
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__neg__",
)


class DPTensorRandomizedClipping(DPTensorFastGradientClipping):
    """Per-sample losses whose ``backward()`` runs both randomized-clipping passes safely.

    Arithmetic (``loss / 2``, ``loss + other``) keeps this class. See the module docstring.
    """

    def backward(self) -> None:  # noqa: D102 - documented in the module docstring
        optimizer = self.optimizer
        if getattr(optimizer, "_rc_backward_pending", False):
            self._reset_module()
            raise RuntimeError(
                "backward() was called twice without optimizer.step() or optimizer.zero_grad() "
                "in between: the two-pass randomized-clipping loss cannot accumulate gradients "
                "over backward calls (the first batch's clipped gradients would be dropped, "
                "Opacus issue 683). Step after every backward, and use "
                "opacus.utils.batch_memory_manager.BatchMemoryManager to split a logical batch "
                "into physical ones."
            )
        if self.loss_reduction == "mean":
            reduced_loss = torch.mean(self.loss_per_sample, dim=0)
        elif self.loss_reduction == "sum":
            reduced_loss = torch.sum(self.loss_per_sample, dim=0)
        else:
            raise ValueError(
                f"loss_reduction = {self.loss_reduction}. Only 'sum' and 'mean' losses are "
                "supported"
            )
        try:
            error: Exception | None = None
            coeff = None
            try:
                reduced_loss.backward(retain_graph=True)
                optimizer.zero_grad()
                coeff = self.module.get_clipping_coef()
                self._check_coefficients(coeff)
            except Exception as err:  # noqa: BLE001 - re-raised below, after the ranks agree
                error = err
            # Distributed: every rank learns whether any rank failed, so that all raise
            # together instead of the healthy ranks waiting forever in a later all-reduce.
            all_ranks_ok = getattr(optimizer, "all_ranks_ok", None)
            if all_ranks_ok is not None and not all_ranks_ok(error is None) and error is None:
                error = RuntimeError(
                    "the randomized-clipping backward failed on another rank; no rank takes "
                    "this step"
                )
            if error is not None:
                raise error
            second_loss = torch.sum(coeff.to(self.loss_per_sample.device) * self.loss_per_sample)
            self.module.disable_hooks()
            try:
                second_loss.backward()
            finally:
                self.module.enable_hooks()
        except BaseException:
            # No unclipped (first-pass) or partial gradient may reach optimizer.step().
            optimizer.original_optimizer.zero_grad(set_to_none=True)
            optimizer._rc_backward_failed = True
            self._reset_module()
            raise
        optimizer._rc_backward_pending = True

    def _reset_module(self) -> None:
        """Drop activations a forward stored for a backward that will not run (or did not end)."""
        reset = getattr(self.module, "_reset_step_state", None)
        if reset is not None:
            reset()

    def _check_coefficients(self, coeff: torch.Tensor) -> None:
        """One clip factor per per-sample loss (see the module docstring, point 2)."""
        losses = self.loss_per_sample
        if losses.dim() != 1 or coeff.shape != losses.shape:
            raise ValueError(
                f"randomized clipping computed {coeff.numel()} clip factors for per-sample "
                f"losses of shape {tuple(losses.shape)}; there must be one factor per sample. "
                "Either the trainable modules only saw a batch-broadcast input (e.g. Hugging "
                "Face position_ids of shape [1, T], Opacus issue 841: expand it to [B, T]), or "
                "the loss is per token (pass shape=logits.shape to the criterion)"
            )


def _keep_class(name: str) -> Any:
    base = getattr(DPTensorFastGradientClipping, name)

    def method(self: DPTensorRandomizedClipping, *args: Any) -> DPTensorRandomizedClipping:
        out = base(self, *args)
        return DPTensorRandomizedClipping(
            out.module, out.optimizer, out.loss_per_sample, out.loss_reduction
        )

    method.__name__ = name
    method.__doc__ = base.__doc__
    return method


for _name in _ARITHMETIC:
    setattr(DPTensorRandomizedClipping, _name, _keep_class(_name))


class DPLossRandomizedClipping(DPLossFastGradientClipping):
    """Opacus' ``DPLossFastGradientClipping`` returning :class:`DPTensorRandomizedClipping`.

    Args:
        module: The randomized-clipping grad-sample module (or hooks object).
        optimizer: Its :class:`~opacus_rc.optimizers.RandomizedClipOptimizer`.
        criterion: The loss (``reduction`` must equal ``loss_reduction``).
        loss_reduction: ``"mean"`` or ``"sum"``.
    """

    def __call__(self, *args: Any, shape: Any = None, **kwargs: Any) -> DPTensorRandomizedClipping:
        out = super().__call__(*args, shape=shape, **kwargs)
        return DPTensorRandomizedClipping(
            out.module, out.optimizer, out.loss_per_sample, out.loss_reduction
        )
