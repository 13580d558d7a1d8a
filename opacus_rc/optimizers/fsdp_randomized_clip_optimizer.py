"""Randomized clipping of FSDP2-sharded models: noise added once, sharded consistently.

Extends Opacus' ``FSDPOptimizerFastGradientClipping`` (its rank bookkeeping and its
``implicit_replication`` around the noise) with the randomized-clipping step protocol of
:class:`~opacus_rc.optimizers.DistributedRandomizedClipOptimizer` (checks agreed on by all ranks).

When ``step()`` runs, each rank's ``p.grad`` is the shard of the clipped gradient summed over
all ranks' samples (:mod:`opacus_rc.grad_sample.fsdp`). The noise is drawn as Opacus draws it:
``N(0, sigma^2 C^2)`` of the parameter's *global* shape on every rank, of which each rank adds
only its own shard (a replicated tensor added to a sharded one). Every coordinate therefore
receives exactly one Gaussian draw, from the rank that holds it: the noise of the single-process
mechanism. (Each rank drawing only its shard's values would be cheaper, but ranks seeded alike,
as FSDP scripts seed them for identical initialisations, would then add *the same* noise to
different shards, and the difference of two equal-shaped shards would be released noise-free.)
The released gradient is ``(sum over all ranks' samples of c_i g_i + one noise draw) /
expected global batch size`` (``"mean"``; ``expected_batch_size`` is the per-rank size, as
Opacus' engine sets it, multiplied here by the world size), accounted once per step by each
rank's accountant.
"""

from __future__ import annotations

from typing import Any

import torch
from opacus.optimizers.fsdpoptimizer_fast_gradient_clipping import (
    FSDPOptimizerFastGradientClipping,
)
from torch.optim import Optimizer

from opacus_rc._compat.opacus import last_step_skipped, next_step_skipped
from opacus_rc.grad_sample.private_step import StepProtocolError
from opacus_rc.optimizers.distributed_randomized_clip_optimizer import (
    DistributedRandomizedClipOptimizer,
)

__all__ = ["FSDPRandomizedClipOptimizer"]


class FSDPRandomizedClipOptimizer(
    DistributedRandomizedClipOptimizer, FSDPOptimizerFastGradientClipping
):
    """:class:`DistributedRandomizedClipOptimizer` for FSDP2 models (noise on every shard once).

    Args:
        optimizer: The wrapped ``torch.optim.Optimizer`` over the model's (sharded) parameters.
        grad_sample_module: This rank's
            :class:`~opacus_rc.grad_sample.fsdp.GradSampleModuleRandomizedClippingFSDP`.
        noise_multiplier: ``sigma``; each coordinate gets one ``N(0, sigma^2 C^2)`` draw.
        max_grad_norm: ``C``.
        expected_batch_size: The **per-rank** expected batch size (global / world size).
        loss_reduction: ``"mean"`` or ``"sum"``.
        generator: Noise generator (each rank draws the global shape and keeps its shard).
        secure_mode: Opacus' secure noise.
        mechanism: The run's :class:`~opacus_rc.mechanism.Mechanism`; as
            :class:`~opacus_rc.optimizers.RandomizedClipOptimizer`.

    Raises:
        RuntimeError: If ``torch.distributed`` is not initialised.
        (others): As :class:`~opacus_rc.optimizers.RandomizedClipOptimizer`.
    """

    #: Every rank draws the global shape and adds its own shard of it.
    noise_placement: str = "fsdp2_shard"

    def __init__(self, optimizer: Optimizer, **kwargs: Any) -> None:
        super().__init__(optimizer, **kwargs)

    def check_step_allowed(self) -> None:
        """The distributed check, but a rank that ran no forward or backward raises at once.

        Under FSDP2 every forward all-gathers each layer's weight and every backward
        reduce-scatters its gradient, so when one rank skips its forward and backward (an
        empty batch, say) the other ranks wait in those collectives: this rank must not enter
        the step's agreement all-reduce (it would wait for them forever, silently). It raises
        instead; the other ranks stay blocked until the process group's timeout or the
        launcher stops them. Nothing is noised or accounted.

        Raises:
            StepProtocolError: No private backward ran on this rank since the last step.
            RuntimeError, FloatingPointError: As
                :meth:`DistributedRandomizedClipOptimizer.check_step_allowed`.
        """
        if not next_step_skipped(self) and self._pending is None and not self._failed:
            raise StepProtocolError(
                f"rank {self.rank}: optimizer.step() without a forward and private backward on "
                "this rank since the last step. Under FSDP2 every rank must run forward and "
                "backward on its batch at every step, an empty Poisson batch included "
                "(rand_on_empty=True if the model cannot take B = 0): the other ranks are "
                "waiting in FSDP2's all-gather or reduce-scatter for this one"
            )
        super().check_step_allowed()

    def noise_only_step(self, closure: Any = None) -> Any:
        """Refused under FSDP2: the other ranks' forward and backward wait in FSDP2's
        collectives for this rank's (see :meth:`check_step_allowed`).

        Raises:
            StepProtocolError: Always, before anything is noised or accounted.
        """
        raise StepProtocolError(
            f"rank {self.rank}: noise_only_step() is not available under FSDP2: every rank must "
            "run forward and backward on its batch at every step, an empty Poisson batch "
            "included (rand_on_empty=True if the model cannot take B = 0)"
        )

    def accumulate(self) -> None:
        """The step's clipped gradient shards into Opacus' FSDP ``grad_state`` (zeros for a
        parameter without ``.grad``); the step's clipped gradients are consumed."""
        for p in self.params:
            grad = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
            state = self.grad_state[p]
            if state["summed_grad"] is not None:
                state["summed_grad"].add_(grad)
            else:
                state["summed_grad"] = torch.clone(grad)
            p.summed_grad = state["summed_grad"]  # for Opacus' processed-flag checks
        self._pending, self._pending_grads = None, []
        self.backward_allowed = not self._failed

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Opacus' FSDP ``zero_grad`` (clears ``grad_state``), ending the step."""
        super().zero_grad(set_to_none)
        if not last_step_skipped(self):
            for p in self.params:
                p.summed_grad = None

    def clipped_sums(self) -> list[torch.Tensor]:
        """Each parameter's clipped gradient shard (Opacus' FSDP ``grad_state``), in order."""
        return [self.grad_state[p]["summed_grad"] for p in self.params]

    def scale_grad(self) -> None:
        """Divide by the expected global batch size (per-rank size times world size) under
        ``"mean"``; no communication (the shards are already summed over ranks)."""
        super(DistributedRandomizedClipOptimizer, self).scale_grad()
        if self.loss_reduction == "mean":
            for p in self.params:
                p.grad /= self.world_size

    def reduce_gradients(self) -> None:
        """Nothing: FSDP2 gradients are reduce-scattered in the backward (or the clipped sum)."""
