"""The private backward of one randomized-clipping step, run by one method
(docs/architecture.md#architecture-step, steps 2-5).

:meth:`PrivateBackwardMixin.private_backward` is the one owner of the private backward: the DP
loss (:class:`~opacus_rc.optimizers.DPLossRandomizedClipping`) reduces its per-sample losses,
checks the arguments of ``backward()`` and calls it once; it returns a frozen
:class:`ClipResult`, which the loss hands to the optimizer. In order:

1. the step protocol allows a backward now
   (:meth:`~opacus_rc.grad_sample.step.StepState.begin_backward`);
2. the losses are one per sample (or unit), every trainable parameter reaches the loss through
   its module's forward, and the step's backward is planned (checkpointed? the smaller stash?);
3. **first pass**: ``reduced_loss`` is backpropagated, with book-keeping only as far as the
   hooked modules' inputs (the graph is then freed); the backward hooks record the per-sample
   norms; the first pass's gradients are dropped (:meth:`StepPeer.discard_gradients`);
4. **clip factors**: :meth:`get_clipping_coef`, one per per-sample loss;
5. **rank agreement**: every rank learns whether any failed (:meth:`StepPeer.all_ranks_ok`),
   so that all raise together;
6. **clipped sum**: with book-keeping :meth:`apply_clipped_sum` writes ``sum_i c_i g_i`` from
   the first pass's tensors; otherwise the second backward pass of ``sum_i c_i loss_i`` runs
   with the hooks off.

Anything that raises on the way leaves no gradient behind (:meth:`StepPeer.discard_gradients`),
drops every stored tensor and marks the step failed (:meth:`abort_step`): ``optimizer.step()``
then refuses until ``zero_grad()``.

Book-keeping policy (``RandomizedClippingConfig.bookkeeping``): ``True`` (default) runs one
backward pass per step wherever every route supports it and the model is not distributed, with
activation checkpointing too (HF ``gradient_checkpointing_enable()``, either ``use_reentrant``,
or ``torch.utils.checkpoint``): in a checkpointed step each ``nn.Linear`` keeps whichever is
smaller for its clipped sum, its per-sample gradients (``p d + p`` floats per sample; its norm
is then exact) or its input and output gradient (``T (p + d)``), so the stored tensors do not
undo checkpointing's memory saving (:mod:`~opacus_rc.grad_sample.norms`); embeddings and a tied
weight's embedding side keep their ids and output gradient. ``"always"`` keeps every layer's
input and output gradient, checkpointed or not; ``False`` runs two backward passes.

The remaining methods of :class:`PrivateBackwardMixin` are the step's parts, public because
Opacus' own ``DPLossFastGradientClipping`` (two passes) drives them itself: it calls
:meth:`get_clipping_coef` and runs its second pass with the hooks disabled.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from opacus.utils.module_utils import trainable_parameters
from torch.autograd.graph import GradientEdge

from opacus_rc._compat.opacus import (
    drop_current_grad_sample,
    reset_forward_counter,
    wrapped_module,
)
from opacus_rc.grad_sample.bookkeeping import write_clipped_sums
from opacus_rc.grad_sample.checkpointing import in_backward
from opacus_rc.grad_sample.clip import apply_clip_factors
from opacus_rc.sketching import SketchSpec

__all__ = ["ClipResult", "PrivateBackwardMixin", "StepPeer"]

#: The grad-sample module's log channel (one name for every line it logs, which users filter on).
logger = logging.getLogger("opacus_rc.grad_sample.grad_sample_module")


@dataclass(frozen=True)
class ClipResult:
    """What one private backward hands to the optimizer (frozen).

    The clipped gradient sum itself is in ``p.grad``; this record says how it was made, so that
    the optimizer can emit the step's DP event from it without reading the grad-sample module.

    Attributes:
        clip_factors: ``(R,)`` clip factors ``c_r = min(1, C / (n_hat_r + 1e-6))``, one per
            per-sample loss: ``R = B`` sequences, or ``R = U`` units with ``units=``
            (docs/privacy/units.md); float32 (float64 if a norm was float64). In a physical
            batch that cuts a unit (``unit_split=``, docs/privacy/units.md#units-split) the
            factors applied: a unit closing here has the factor of its whole summed gradient,
            a unit still open NaN (it has none yet).
        per_sample_norms: ``(R,)`` float64 whole-model norm estimates the factors were made from
            (NaN for a unit still open). Not privatized: for debugging and logging only.
        num_records: ``R``, the number of sequences (or units) clipped.
        per_unit: Whether the records are units (``units=`` was passed to the criterion).
        sketch_spec: The sketch that produced the norms
            (:class:`~opacus_rc.sketching.SketchSpec`): what the DP event accounts.
        bookkeeping: Whether the clipped sum came from the first pass's tensors (one backward
            pass, Bu et al. 2023) rather than a second backward pass.
    """

    clip_factors: torch.Tensor
    per_sample_norms: torch.Tensor
    num_records: int
    per_unit: bool
    sketch_spec: SketchSpec
    bookkeeping: bool


class StepPeer(Protocol):
    """What the private backward needs of the optimizer (a
    :class:`~opacus_rc.optimizers.RandomizedClipOptimizer` is one)."""

    def discard_gradients(self) -> None:
        """Drop every parameter's ``.grad`` without ending the step (virtual steps' sums kept)."""

    def all_ranks_ok(self, ok: bool) -> bool:
        """Whether every rank reports ``ok`` (one process: ``ok``)."""


def check_one_loss_per_record(losses: torch.Tensor) -> None:
    """One loss per sample, shape ``(B,)``, before anything is backpropagated.

    Raises:
        ValueError: Naming the shape and how to pass a per-token loss.
    """
    if losses.dim() == 1:
        return
    raise ValueError(
        f"the criterion returned per-sample losses of shape {tuple(losses.shape)}; "
        "randomized clipping needs one loss per sample, shape (B,). For a per-token loss, "
        "flatten the logits and targets and pass shape=logits.shape: "
        "criterion(logits.reshape(-1, V), labels.reshape(-1), shape=logits.shape) "
        "(each sample's loss is then the mean over its positions whose label is not "
        "criterion.ignore_index); or give a criterion that returns one loss per sample "
        "(e.g. its (B, T) losses reduced over dim 1)"
    )


def check_one_factor_per_loss(coef: torch.Tensor, losses: torch.Tensor) -> None:
    """One clip factor per per-sample loss: Opacus multiplies them with broadcasting, so a
    model whose trainable modules only see a batch-broadcast input (``position_ids`` of shape
    ``[1, T]``, Opacus issue 841) would be clipped with one factor for the whole batch.

    Raises:
        ValueError: Naming both shapes and the two usual causes.
    """
    if losses.dim() != 1 or coef.shape != losses.shape:
        raise ValueError(
            f"randomized clipping computed {coef.numel()} clip factors for per-sample "
            f"losses of shape {tuple(losses.shape)}; there must be one factor per sample. "
            "Either the trainable modules only saw a batch-broadcast input (e.g. Hugging "
            "Face position_ids of shape [1, T], Opacus issue 841: expand it to [B, T]), or "
            "the loss is per token (pass shape=logits.shape to the criterion)"
        )


@contextlib.contextmanager
def no_output_hook_warning() -> Iterator[None]:
    """Silence PyTorch's "Full backward hook is firing when gradients are computed with respect
    to module outputs" during the private backward: it fires for every hooked module whose
    inputs need no gradient (the lowest trainable layers), where the output gradient is exactly
    what the per-sample norm needs, so there is nothing for the user to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="Full backward hook is firing when gradients are computed with respect to "
            "module outputs",
            category=UserWarning,
        )
        yield


class PrivateBackwardMixin:
    """The private backward of the randomized-clipping grad-sample classes (see the module
    docstring); a base of their shared mixin, which provides the attributes used here."""

    def private_backward(
        self,
        loss_per_sample: torch.Tensor,
        *,
        reduced_loss: torch.Tensor,
        peer: StepPeer,
        refused: Exception | None = None,
    ) -> ClipResult:
        """Run the whole private backward of this step (first pass, clip factors, rank
        agreement, clipped sum or second pass) and say how its gradient was clipped.

        Args:
            loss_per_sample: ``(R,)`` per-sample (or per-unit) losses of this step's forward.
            reduced_loss: Their mean or sum (the loss's ``loss_reduction``), backpropagated by
                the first pass.
            peer: The optimizer (:class:`StepPeer`): drops the first pass's gradients and
                agrees with the other ranks.
            refused: An error the caller found in its own arguments (the DP loss's
                ``backward()`` arguments), raised at the point where every other error of the
                backward is: after the protocol check, before anything is backpropagated, so
                that the step is failed and every rank raises.

        Returns:
            The step's :class:`ClipResult`; ``p.grad`` holds the clipped gradient sum.

        Raises:
            StepProtocolError: An earlier backward's clip factors were not consumed, or the last
                backward failed (this forward's records are dropped; the earlier state is kept).
            ValueError: Losses not of shape ``(R,)``, or not one clip factor per loss
                (:func:`check_one_loss_per_record`, :func:`check_one_factor_per_loss`).
            Exception: ``refused``, or any error of the checks, hooks or clip factors
                (:meth:`check_parameter_uses`, :meth:`get_clipping_coef`); a ``RuntimeError``
                if another rank failed. The step is then failed: no gradient is kept and
                ``optimizer.step()`` refuses until ``zero_grad()``.
        """
        self.begin_private_backward()
        bookkeeping = False
        try:
            error: Exception | None = None
            coef = None
            try:
                if refused is not None:
                    raise refused
                check_one_loss_per_record(loss_per_sample)
                self.check_parameter_uses(reduced_loss)
                bookkeeping = self.bookkeeping  # type: ignore[attr-defined]
                # The first pass stops at the hooked modules' inputs, so no dL/dW is computed
                # that the clipped sum or the second pass replaces; with book-keeping the graph
                # is freed, else kept for the second pass.
                with no_output_hook_warning():
                    torch.autograd.backward(
                        reduced_loss,
                        inputs=self.take_first_pass_inputs(),
                        retain_graph=not bookkeeping,
                    )
                peer.discard_gradients()  # the first pass's (unclipped) gradients
                coef = self.get_clipping_coef()
                check_one_factor_per_loss(coef, loss_per_sample)
            except Exception as err:  # noqa: BLE001 - re-raised below, after the ranks agree
                error = err
            # Distributed: every rank learns whether any rank failed, so that all raise
            # together instead of the healthy ranks waiting forever in a later all-reduce.
            if not peer.all_ranks_ok(error is None) and error is None:
                error = RuntimeError(
                    "the randomized-clipping backward failed on another rank; no rank takes "
                    "this step"
                )
            if error is not None:
                raise error
            assert coef is not None
            if bookkeeping:
                self.apply_clipped_sum(coef)  # consumes the stored tensors
            else:
                second_loss = torch.sum(apply_clip_factors(coef, loss_per_sample))
                self.disable_hooks()  # type: ignore[attr-defined]
                try:
                    with no_output_hook_warning():
                        second_loss.backward()
                finally:
                    self.enable_hooks()  # type: ignore[attr-defined]
                self.finish_clipped_pass()
        except BaseException:
            # No unclipped (first-pass) or partial gradient may reach optimizer.step().
            peer.discard_gradients()
            self.abort_step()
            raise
        step = self.step_state  # type: ignore[attr-defined]
        return ClipResult(
            clip_factors=coef,
            per_sample_norms=step.per_sample_gradient_norms,
            num_records=coef.numel(),
            per_unit=step.units is not None,
            sketch_spec=self.sketch_spec,  # type: ignore[attr-defined]
            bookkeeping=bookkeeping,
        )

    # ------------------------------------------------------------------------------------------
    # The parts of the private backward (also driven by Opacus' own two-pass loss)
    # ------------------------------------------------------------------------------------------

    def begin_private_backward(self) -> None:
        """Check that the step protocol allows a private backward now.

        Raises:
            StepProtocolError: See :meth:`StepState.begin_backward` (a ``RuntimeError``); this
                forward's recorded activations are dropped, the earlier state is kept.
        """
        try:
            self.step_state.begin_backward()  # type: ignore[attr-defined]
        except BaseException:
            self.discard_recorded()
            raise

    def check_parameter_uses(self, loss: torch.Tensor) -> None:
        """Check, before the private backward of ``loss``, that every gradient can be clipped,
        and plan the step's backward (:meth:`StepState.plan_backward`).

        Raises if the set of trainable parameters changed since the hooks were attached
        (:class:`~opacus_rc.grad_sample.checks.TrainableSetGuard`) or if a trainable parameter
        reaches ``loss`` other than through its module's forward
        (:class:`~opacus_rc.grad_sample.checks.ParameterUseCheck`). On error the recorded
        activations are dropped.

        Args:
            loss: The loss about to be backpropagated (any shape).

        Raises:
            RuntimeError: See above.
        """
        step = self.step_state  # type: ignore[attr-defined]
        try:
            self._trainable.check()  # type: ignore[attr-defined]
            full_first_pass = self._uses.check(loss)  # type: ignore[attr-defined]
        except BaseException:
            self.discard_recorded()
            raise
        checkpointed = step.checkpointed or full_first_pass
        bookkeeping = self._bookkeeping  # type: ignore[attr-defined]
        # Checkpointed: each layer keeps the smaller of its per-sample gradients and its input
        # and output gradient (norms.py), unless bookkeeping="always" (inputs everywhere).
        smaller_stash = bookkeeping and checkpointed and self._config.bookkeeping is True  # type: ignore[attr-defined]
        step.plan_backward(full_first_pass=full_first_pass, smaller_stash=smaller_stash)
        if smaller_stash and not self._told_checkpointing:  # type: ignore[attr-defined]
            self._told_checkpointing = True
            logger.info(
                "activation checkpointing: one backward pass; each layer keeps the smaller of "
                "its per-sample gradients (then its norm is exact) and its input and output "
                "gradient for the clipped sum; bookkeeping='always' keeps the inputs everywhere, "
                "bookkeeping=False takes two passes"
            )

    def take_first_pass_inputs(self) -> list[GradientEdge | torch.Tensor] | None:
        """The ``inputs`` of the book-keeping first backward pass (consumed), or None for all.

        With book-keeping the parameters' own first-pass gradients are discarded (the clipped
        sum replaces them), so the first pass only needs to reach every hooked module:
        ``torch.autograd.backward(loss, inputs=...)`` then skips the weight-gradient products
        ``G^T A`` of every layer whose input carries a gradient (Bu et al., ICML 2023, section
        3). Modules whose inputs carry no gradient are reached through their parameters.
        Through a reentrant activation-checkpoint region PyTorch allows no ``inputs``, and a
        DDP reducer (turned off by :class:`~opacus_rc.grad_sample.distributed.ReducerOff`
        unless the user turned it back on) expects every parameter's gradient: the pass then
        reaches every leaf (None).
        """
        step = self.step_state  # type: ignore[attr-defined]
        edges = step.take_first_pass_inputs()
        reducer_off = self._reducer_off  # type: ignore[attr-defined]
        reducer = reducer_off is not None and reducer_off.reducer_active
        return None if step.full_first_pass or reducer else edges

    def get_norm_sample(self) -> torch.Tensor:
        """Per-sample gradient norm estimates of the whole model (issues nothing).

        After a backward pass: the norms the step's clip factors will be made from. After the
        clip factors: the norms they were made from, until the next hooked forward pass (as
        Opacus' ``get_norm_sample`` is readable after ``backward()``). Not privatized. With
        ``units=`` (the criterion's, docs/privacy/units.md) there is one norm per unit: that
        of the unit's summed gradient.

        Returns:
            Tensor of shape ``(B,)`` (one norm per sample), or ``(U,)`` for the ``U`` units of
            the step's ``units=``; float64.

        Raises:
            RuntimeError: No norms were computed since the last step.
        """
        step = self.step_state  # type: ignore[attr-defined]
        pending = step.pending_norm(self.trainable_parameters)  # type: ignore[attr-defined]
        if pending is not None:
            return pending
        issued = step.per_sample_gradient_norms
        if issued is not None:
            return issued
        raise RuntimeError(
            "no per-sample norms for this step: run a forward pass in training mode with "
            "gradients enabled, then backward"
        )

    def get_clipping_coef(self) -> torch.Tensor:
        """Per-sample (or, with ``units=``, per-unit) clip factors ``min(1, C / (n_hat_i +
        1e-6))`` for the current step.

        Called between the first backward pass and the clipped one. Consumes the step's norms
        (:meth:`StepState.issue_clip_factors`); in secure mode the sketch generators are
        reseeded from :mod:`secrets` afterwards.

        Returns:
            Tensor of shape ``(B,)``, or ``(U,)`` with ``units=`` (one factor per unit); float32
            (float64 if the norms were float64).

        Raises:
            FloatingPointError: If any per-sample (per-unit) norm estimate is NaN or inf.
            RuntimeError: See :meth:`StepState.issue_clip_factors`.
        """
        step = self.step_state  # type: ignore[attr-defined]
        tied = self._tied  # type: ignore[attr-defined]
        try:
            if tied is not None:
                try:
                    tied.check_complete()  # never a partial norm of a tied weight
                except RuntimeError:
                    step.reset()
                    raise
            return step.issue_clip_factors(
                max_grad_norm=self.max_grad_norm,  # type: ignore[attr-defined]
                params=self.trainable_parameters,  # type: ignore[attr-defined]
                bookkeeping=self._bookkeeping,  # type: ignore[attr-defined]
            )
        finally:
            self._uses.clear()  # type: ignore[attr-defined]
            if self._config.secure_mode:  # type: ignore[attr-defined]
                self._generators.reseed()  # type: ignore[attr-defined]

    def apply_clipped_sum(self, coef: torch.Tensor) -> None:
        """Write the clipped gradient sum into ``p.grad`` (book-keeping; no second backward).

        Adds ``sum_i coef_i * grad_p loss_i`` to ``p.grad`` for every parameter reached by this
        step's backward pass (:func:`~opacus_rc.grad_sample.bookkeeping.write_clipped_sums`):
        what a second backward pass of ``sum_i coef_i loss_i`` accumulates. The stored tensors
        are consumed. No random number is drawn.

        Args:
            coef: The clip factors of this step, shape ``(B,)``, or ``(U,)`` with ``units=``.

        Raises:
            RuntimeError: If book-keeping is off, or no stash was handed over by
                :meth:`get_clipping_coef` of this step.
            ValueError: If a clipped sum has the wrong shape or misses a parameter.
        """
        if not self._bookkeeping:  # type: ignore[attr-defined]
            raise RuntimeError(
                "apply_clipped_sum() needs book-keeping mode (module.bookkeeping is False): "
                "run the second backward pass of sum_i c_i loss_i instead"
            )
        step = self.step_state  # type: ignore[attr-defined]
        ready = step.take_stashes()
        layout = step.units
        try:
            if layout is not None and layout.split is not None:
                # A unit cut across physical batches (docs/privacy/units.md#units-split).
                from opacus_rc.units.split import write_split_clipped_sums  # imports grad_sample

                step.per_sample_gradient_norms = write_split_clipped_sums(
                    self,
                    ready,
                    coef,
                    layout,
                    clipped_sums=self.CLIPPED_SUM_FUNCTIONS,  # type: ignore[attr-defined]
                    max_grad_norm=self.max_grad_norm,  # type: ignore[attr-defined]
                    estimator=self._estimator,  # type: ignore[attr-defined]
                    sketch_dim=self._config.sketch_dim,  # type: ignore[attr-defined]
                    generator_for=self.generator_for,  # type: ignore[attr-defined]
                )
            else:
                write_clipped_sums(
                    ready,
                    coef,
                    clipped_sums=self.CLIPPED_SUM_FUNCTIONS,  # type: ignore[attr-defined]
                    name_of=self._name_of,  # type: ignore[attr-defined]
                )
        finally:
            ready.clear()
        step.mark_applied()

    def finish_clipped_pass(self) -> None:
        """Mark the second (clipped) backward pass of a two-pass step as done."""
        self.step_state.mark_applied()  # type: ignore[attr-defined]

    def abort_step(self) -> None:
        """The private backward failed: drop every stored tensor; ``step()`` refuses until
        ``zero_grad()``."""
        from opacus_rc.units.split import drop_open_unit  # units.split imports grad_sample

        self.discard_recorded()
        drop_open_unit(self)  # a unit cut across physical batches lost a part
        self.step_state.fail()  # type: ignore[attr-defined]

    def _drop_after_hook_error(self) -> None:
        """A hook is about to raise: inside a backward (the recomputed forward of a checkpointed
        region) gradients may already have been accumulated, so the step fails
        (:meth:`abort_step`); in a forward nothing reached a gradient yet, so only the records
        are dropped (:meth:`discard_recorded`)."""
        if in_backward():
            self.abort_step()
        else:
            self.discard_recorded()

    def discard_recorded(self) -> None:
        """Drop the activations and forward counters Opacus stored, and this step's records."""
        for sub in wrapped_module(self).modules():
            if hasattr(sub, "activations"):
                sub.activations = []
            if hasattr(sub, "max_batch_len"):
                del sub.max_batch_len
        inputs: Any = self._inputs  # type: ignore[attr-defined]
        if inputs is not None:
            inputs.clear()
        for _, p in trainable_parameters(wrapped_module(self)):
            reset_forward_counter(p)
            drop_current_grad_sample(p)
            p.grad_sample = None
        self._uses.clear()  # type: ignore[attr-defined]
        if self._tied is not None:  # type: ignore[attr-defined]
            self._tied.clear()  # type: ignore[attr-defined]
        self.step_state.reset()  # type: ignore[attr-defined]
