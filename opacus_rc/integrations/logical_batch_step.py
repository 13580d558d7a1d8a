"""A DP trainer's step: one Poisson logical batch, in micro-batches, and each one's DP loss.

* :func:`logical_batch_step`: the body of ``DPTrainerMixin.training_step``: the private
  backward of every micro-batch of a :class:`~opacus_rc.integrations.logical_batches.LogicalBatch`,
  their clipped sums accumulated (every micro-batch but the last a skipped Opacus step), or the
  noise-only step of an empty batch; the Trainer's ``optimizer.step()`` then noises the sum,
  steps and accounts one step.
* :func:`micro_batch_loss`: the body of ``DPTrainerMixin.compute_private_loss``: one
  micro-batch's per-example losses through the engine's criterion
  (:func:`~opacus_rc.integrations.per_sample_loss.per_sample_cross_entropy`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from opacus_rc._compat.transformers import prepare_inputs
from opacus_rc.batch_independence import BatchIndependenceError, batch_independence_error
from opacus_rc.integrations.batch_check import check_logical_batch
from opacus_rc.integrations.fsdp import lockstep_micro_batches, unsharded
from opacus_rc.integrations.logical_batches import UNITS_KEY, LogicalBatch
from opacus_rc.integrations.model_inputs import (
    check_decoder_inputs,
    model_inputs,
    unpadded_next_token_labels,
)
from opacus_rc.integrations.packed_batches import is_packed_micro_batch, packed_micro_batch_loss
from opacus_rc.integrations.per_sample_loss import per_sample_cross_entropy

__all__ = ["logical_batch_step", "micro_batch_loss"]


def logical_batch_step(trainer: Any, model: nn.Module, inputs: Any) -> torch.Tensor:
    """One logical batch of ``trainer`` (see ``DPTrainerMixin.training_step``).

    Each micro-batch's loss is ``trainer.compute_private_loss(model, micro)`` (so an override
    of it is used), inside the trainer's ``compute_loss_context_manager()`` and its activation
    offload context, if any.

    Args:
        trainer: The DP trainer, made private.
        model: The model (prepared by the accelerator; a ``DistributedDataParallel`` wrapper is
            run past).
        inputs: A :class:`~opacus_rc.integrations.logical_batches.LogicalBatch`.

    Returns:
        The mean per-example loss of the logical batch, a detached float32 scalar (NaN for an
        empty batch when ``logging_nan_inf_filter`` is on, else 0).

    Raises:
        TypeError: If ``inputs`` is not a ``LogicalBatch``.
        RuntimeError: A step beyond the schedule the noise was searched for; the
            randomized-clipping backward failed on another rank.
        BatchIndependenceError: At the first non-empty batch, with
            ``PrivacyArguments.check_batch_independence``: an example's row, output or loss
            depends on the other examples (:mod:`~opacus_rc.integrations.batch_check`).
    """
    private = trainer._require_private()
    if not isinstance(inputs, LogicalBatch):
        raise TypeError(
            f"a DP trainer's training batches come from its Poisson loader (LogicalBatch), "
            f"got {type(inputs).__name__}; do not override get_train_dataloader"
        )
    if (
        private.planned_steps is not None
        and len(private.engine.accountant) >= private.planned_steps
    ):
        raise RuntimeError(
            f"the noise multiplier was chosen so that {private.planned_steps} steps reach "
            f"epsilon={trainer.privacy_args.target_epsilon}; another step would pass it"
        )
    model.train()
    if hasattr(trainer.optimizer, "train") and callable(trainer.optimizer.train):
        trainer.optimizer.train()
    optimizer = private.optimizer
    if isinstance(model, DistributedDataParallel):
        model = model.module  # DDP's reducer is not used (DPTrainerMixin.training_step)
    # Ends the last logical step (its noisy sum): the Trainer only zeroes the model's grads.
    optimizer.zero_grad()
    device = trainer.args.device
    fsdp = getattr(trainer, "_fsdp_plugin", None) is not None
    if trainer.privacy_args.check_batch_independence and not trainer._batch_independence_checked:
        # Before the logical batch's first backward, until the check has seen a micro-batch of
        # two examples and one with padding: nothing is noised or accounted if it fails.
        # Under FSDP2 its forwards (a number that differs between ranks) run on the model
        # held unsharded (integrations/fsdp.py).
        held = (
            unsharded(model, reshard_after_forward=trainer._fsdp_reshard)
            if fsdp
            else contextlib.nullcontext()
        )
        with held:
            _check_batch_independence(trainer, model, inputs)
    micro_batches = list(inputs.micro_batches)
    real = len(micro_batches)
    if fsdp:
        # Every rank runs as many forwards and backwards as the rank that needs the most;
        # the others run filler micro-batches (a zero gradient, integrations/fsdp.py).
        total_micro = lockstep_micro_batches(real, device=trainer.args.device)
        micro_batches += [trainer._fsdp_filler] * (total_micro - real)
    if not micro_batches or inputs.num_examples == 0 and not fsdp:
        # No record is in the batch: the step is the noise alone, noised and accounted by
        # the Trainer's optimizer.step(). Under DDP the empty batch takes this rank's part in
        # the agreement the other ranks' last backward issues (in one process, none); under
        # FSDP2 every rank's share is empty (else fillers run).
        step = private.module.private_step
        optimizer.accept_clip_result(step.empty_batch(max_grad_norm=optimizer.max_grad_norm))
        fill = math.nan if trainer.args.logging_nan_inf_filter else 0.0
        return torch.tensor(fill, device=device)
    record = getattr(private.module, "unit_batch_record", None)
    total = torch.zeros((), device=device, dtype=torch.float64)
    records = 0  # examples, or units with privacy_unit
    last = len(micro_batches) - 1
    context = getattr(trainer, "maybe_activation_offload_context", None) or contextlib.nullcontext()
    with context:
        for i, micro in enumerate(micro_batches):
            micro = prepare_inputs(trainer, micro)
            if record is not None and record.per_unit:
                # The units the criterion's units= must group the rows as (units/record.py).
                record.record(micro[UNITS_KEY])
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_private_loss(model, micro)
            if i < last:
                # Said before the backward, so that under DDP only the last micro-batch's
                # backward issues the ranks' agreement (the ranks' counts differ).
                optimizer.signal_skip_step(do_skip=True)
            loss.backward()
            if i < real:  # a filler's loss is 0 and no record's
                total += loss.loss_per_sample.detach().to(total.device, torch.float64).sum()
                records += loss.loss_per_sample.numel()
            if i < last:
                optimizer.step()  # accumulates the clipped sum only
                optimizer.zero_grad()
    return (total / max(records, 1)).float().detach()


def _check_batch_independence(trainer: Any, model: nn.Module, inputs: LogicalBatch) -> None:
    """The check of the logical batch's micro-batches that can still teach it something
    (:func:`~opacus_rc.integrations.batch_check.check_logical_batch`), on this rank's share;
    under DDP every rank learns whether any rank's check failed and whether every rank's
    check is done (one all-reduce per logical batch while it runs, which every rank reaches),
    so that no rank goes on to the backward's collectives while another has refused, and the
    ranks stop checking together."""
    state = trainer._batch_check_state
    error: BatchIndependenceError | None = None
    try:
        check_logical_batch(trainer, model, inputs, state)
    except BatchIndependenceError as err:
        error = err
    done = state.done
    if trainer._world_size > 1:
        flags = torch.tensor(
            [0.0 if error is None else 1.0, 0.0 if done else 1.0], device=trainer.args.device
        )
        dist.all_reduce(flags)
        if error is None and float(flags[0].item()) > 0:
            error = batch_independence_error(
                "the batch-independence check failed on another rank (its error says why)"
            )
        done = float(flags[1].item()) == 0
    trainer._batch_independence_checked = done
    if error is not None:
        raise error


def micro_batch_loss(
    model: nn.Module,
    inputs: Mapping[str, Any],
    *,
    criterion: Any,
    shift_labels: bool,
    expand_positions: bool,
) -> Any:
    """The DP loss of one micro-batch (see ``DPTrainerMixin.compute_private_loss``).

    Args:
        model: The model.
        inputs: One collated micro-batch with ``labels`` ``(B, T)`` or ``(B,)`` (and, with
            ``privacy_unit``, the units ``(B,)`` under
            :data:`~opacus_rc.integrations.logical_batches.UNITS_KEY`).
        criterion: The engine's DP criterion.
        shift_labels: Whether targets are the next tokens (a causal LM): then no token is
            predicted from a padding position (:func:`unpadded_next_token_labels`).
        expand_positions: Whether the model takes ``position_ids``: then, when the batch has
            none, they are passed ``(B, T)``, one row per example, from the attention mask
            (see :func:`model_inputs`).

    Returns:
        The DP loss (see :func:`~opacus_rc.integrations.per_sample_loss.per_sample_cross_entropy`).

    Raises:
        ValueError: No ``labels`` in the batch; an encoder-decoder batch without decoder
            inputs (:func:`check_decoder_inputs`).
    """
    if is_packed_micro_batch(inputs):  # records packed into rows: clipped per record
        return packed_micro_batch_loss(model, inputs, criterion=criterion)
    inputs, labels, given_shift_labels, units = model_inputs(
        inputs, expand_positions=expand_positions
    )
    if labels is None:
        raise ValueError(
            "a DP trainer computes each example's loss from the batch's 'labels' (-100 where "
            "ignored); the data collator returned none (for a causal LM use a collator that "
            "copies input_ids to labels, e.g. DataCollatorForLanguageModeling(mlm=False))"
        )
    if shift_labels and given_shift_labels is None:
        labels = unpadded_next_token_labels(labels, inputs.get("attention_mask"))
    check_decoder_inputs(model, inputs)
    outputs = model(**inputs)
    logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
    return per_sample_cross_entropy(
        criterion,
        logits,
        labels,
        shift=shift_labels,
        shift_labels=given_shift_labels,
        units=units,
    )
