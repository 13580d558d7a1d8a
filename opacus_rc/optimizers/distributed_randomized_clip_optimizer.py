"""Randomized clipping under ``torch.distributed`` data parallelism (DDP).

Follows Opacus' ``DistributedDPOptimizerFastGradientClipping``: every rank clips its own
samples (with its own, independently OS-seeded sketch generator), rank 0 alone adds the
Gaussian noise ``N(0, sigma^2 C^2)``, and the gradients are summed over ranks (and divided by
the world size under ``loss_reduction="mean"``, with ``expected_batch_size`` the per-rank
expected batch size, as Opacus' engine sets it). The released gradient is therefore
``(sum over all ranks' samples of c_i g_i + one noise draw) / expected global batch size``:
the single-process mechanism on the global batch, accounted once per step by each rank's
accountant. Each rank's clipped sum is formed locally, with book-keeping from its one backward
pass (or by its second pass), and all-reduced once per step, in flat buckets; torch DDP's
reducer, which would all-reduce the first pass's discarded gradients, is turned off
(:mod:`~opacus_rc.grad_sample.distributed`).

Two differences from Opacus:

* The all-reduce happens inside ``pre_step`` (right after scaling), **before** the step hook.
  Step hooks therefore see the global noisy gradient. In Opacus' distributed optimizers the
  hook runs before the all-reduce, on one rank's partial sum, which for a post-processing hook
  (e.g. the spectral denoiser) would be a function of un-noised private data on ranks > 0.
* A failure on one rank (a failed backward, a NaN gradient) is agreed on by all ranks with a
  one-element all-reduce at the end of each logical step, so every rank raises instead of the
  others hanging in the gradient all-reduce. (Inside a logical step split by BatchMemoryManager
  the ranks' physical batches do not line up, so a failure there raises on its rank only.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from opacus_rc._compat.opacus import next_step_skipped
from opacus_rc.mechanism import Mechanism
from opacus_rc.optimizers.randomized_clip_optimizer import (
    FROM_MECHANISM,
    RandomizedClipOptimizer,
)

__all__ = ["DistributedRandomizedClipOptimizer"]


class DistributedRandomizedClipOptimizer(RandomizedClipOptimizer):
    """:class:`RandomizedClipOptimizer` for data-parallel training (noise on rank 0 only).

    Args:
        optimizer: The wrapped ``torch.optim.Optimizer`` (same parameters on every rank).
        grad_sample_module: This rank's randomized-clipping module (wrapping a DDP/DPDDP model).
        noise_multiplier: ``sigma``; the noise std is ``sigma * C``, added once (rank 0).
        max_grad_norm: ``C``.
        expected_batch_size: The **per-rank** expected batch size (global / world size).
        loss_reduction: ``"mean"`` or ``"sum"``.
        generator: Noise generator (used on rank 0 only).
        secure_mode: Opacus' secure noise.
        mechanism: The run's :class:`~opacus_rc.mechanism.Mechanism` (its per-process divisor,
            ``sigma`` and ``C``); as :class:`RandomizedClipOptimizer`.

    Raises:
        RuntimeError: If ``torch.distributed`` is not initialised.
        (others): As :class:`RandomizedClipOptimizer`.
    """

    #: Rank 0 draws the noise, the other ranks pass their clipped sums on to the all-reduce.
    noise_placement: str = "ddp_rank0"

    #: Largest flat all-reduce bucket, in MiB (DDP's default ``bucket_cap_mb``).
    bucket_cap_mb: float = 25.0

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
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "DistributedRandomizedClipOptimizer needs an initialised torch.distributed "
                "process group (torch.distributed.init_process_group)"
            )
        super().__init__(
            optimizer,
            grad_sample_module=grad_sample_module,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=generator,
            secure_mode=secure_mode,
            mechanism=mechanism,
        )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def _all_ranks_ok(self, ok: bool) -> bool:
        """Whether every rank reports ``ok``, agreed on at logical-step boundaries.

        At the last physical batch of a logical step (always, without BatchMemoryManager) this
        is a one-element all-reduce that every rank reaches, as they all reach the gradient
        all-reduce. Inside a logical step split by BatchMemoryManager, ranks may process
        different numbers of physical batches, so no collective is issued there and ``ok`` is
        returned unchanged (a failure then raises on its own rank only).

        Used by :meth:`check_step_allowed`, so that a refusal on one rank makes every rank
        raise at the same point (the private backward agrees on its own,
        :meth:`~opacus_rc.grad_sample.private_step.PrivateStep.backward`).
        """
        if next_step_skipped(self):
            return ok
        device = self.params[0].device if self.params else torch.device("cpu")
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) == 0

    def check_step_allowed(self) -> None:
        """:meth:`RandomizedClipOptimizer.check_step_allowed` on every rank, agreed on by all.

        Raises:
            RuntimeError: This rank's error, or a note that another rank refused the step.
            FloatingPointError: This rank's NaN/inf gradient.
        """
        error: BaseException | None = None
        try:
            super().check_step_allowed()
        except (RuntimeError, FloatingPointError) as err:
            error = err
        if not self._all_ranks_ok(error is None):
            if error is not None:
                raise error
            raise RuntimeError(
                "another rank refused this step (failed backward or NaN/inf gradient); no rank "
                "steps and nothing is accounted"
            )

    def scale_grad(self) -> None:
        """Opacus' scaling, then the all-reduce, so that step hooks see the global gradient."""
        super().scale_grad()
        self.reduce_gradients()

    def reduce_gradients(self) -> None:
        """Sum ``p.grad`` over ranks; divide by the world size under ``"mean"``.

        Opacus' ``DistributedDPOptimizer.reduce_gradients``, with the gradients coalesced into
        flat buckets of at most :attr:`bucket_cap_mb` MiB per dtype and device (one all-reduce
        per bucket instead of one per parameter, as DDP's reducer buckets them). This is the
        step's only gradient communication: with book-keeping each rank's clipped sum, with two
        passes its second pass's gradients (torch DDP's own reducer is off,
        :mod:`~opacus_rc.grad_sample.distributed`).
        """
        grads = [p.grad for p in self.params if p.requires_grad]
        for bucket in _buckets(grads, cap_bytes=int(self.bucket_cap_mb * 2**20)):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            if self.loss_reduction == "mean":
                flat /= self.world_size
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


def _buckets(tensors: list[torch.Tensor], *, cap_bytes: int) -> list[list[torch.Tensor]]:
    """Group ``tensors`` by (device, dtype), in order, into buckets of at most ``cap_bytes``
    (a tensor larger than the cap is a bucket of its own)."""
    out: list[list[torch.Tensor]] = []
    open_bucket: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], int]] = {}
    for t in tensors:
        key = (t.device, t.dtype)
        bucket, size = open_bucket.get(key, ([], 0))
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > cap_bytes:
            out.append(bucket)
            bucket, size = [], 0
        bucket.append(t)
        open_bucket[key] = (bucket, size + nbytes)
    out.extend(bucket for bucket, _ in open_bucket.values() if bucket)
    return out
