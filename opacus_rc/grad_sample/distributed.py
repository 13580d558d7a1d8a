"""Data-parallel models under randomized clipping: torch DDP's reducer is not used.

Under data parallelism every rank clips its own samples and the DP optimizer
(:class:`~opacus_rc.optimizers.DistributedRandomizedClipOptimizer`) all-reduces the clipped,
noised sum once per step, as Opacus' ``DistributedDPOptimizer`` does for its
``DifferentiallyPrivateDistributedDataParallel`` (DPDDP) models, which have no reducer. A torch
``DistributedDataParallel`` (DDP) model has one: during every backward pass it all-reduces each
parameter's gradient. Those are the first pass's unclipped gradients, which randomized
clipping discards (book-keeping replaces them by the clipped sum, the two-pass path by the
second pass), so that all-reduce would be wasted communication. Worse, the reducer expects every
parameter's gradient in every pass, which forbids the first pass's ``inputs=`` (skipping the
weight-gradient products, Bu et al., ICML 2023, section 3).

:class:`ReducerOff` therefore turns off the gradient synchronisation of every DDP module in the
model for as long as the hooks are attached: it sets ``require_backward_grad_sync = False``, the
flag that ``DistributedDataParallel.no_sync()`` sets (the documented way to skip the reducer), so
DDP's forward does not prepare the reducer and its hooks do nothing. A ``no_sync()`` of the
user's restores that flag on exit, so it stays off. Note that DDP then does not re-broadcast
module buffers at each forward (it never does under ``no_sync()``); parameters stay in sync
because every rank applies the same all-reduced update.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ReducerOff", "ddp_modules"]


def ddp_modules(m: nn.Module) -> list[DistributedDataParallel]:
    """The torch ``DistributedDataParallel`` modules in ``m`` (``m`` itself included)."""
    return [sub for sub in m.modules() if isinstance(sub, DistributedDataParallel)]


class ReducerOff:
    """Turn off torch DDP's gradient all-reduce for the lifetime of the hooks.

    Args:
        m: The model; every ``DistributedDataParallel`` in it is affected (none: a no-op).

    Attributes:
        modules: The DDP modules whose synchronisation was turned off.
    """

    def __init__(self, m: nn.Module) -> None:
        self.modules = ddp_modules(m)
        self._previous = [ddp.require_backward_grad_sync for ddp in self.modules]
        for ddp in self.modules:
            ddp.require_backward_grad_sync = False

    @property
    def reducer_active(self) -> bool:
        """Whether a DDP reducer would still expect every gradient (synchronisation back on)."""
        return any(ddp.require_backward_grad_sync for ddp in self.modules)

    def restore(self) -> None:
        """Give each DDP module back the synchronisation flag it had (idempotent)."""
        for ddp, previous in zip(self.modules, self._previous, strict=True):
            ddp.require_backward_grad_sync = previous
        self.modules, self._previous = [], []
