"""Book-keeping: the clipped gradient sum from one backward pass
(docs/architecture.md#architecture-step, step 5).

Bu, Wang, Zha and Karypis, "Differentially Private Optimization on Large Model at Small Cost",
ICML 2023. Ghost and randomized clipping need a second backward pass of ``sum_i c_i loss_i``
once the clip factors ``c`` are known. Book-keeping instead keeps, during the first (only)
pass, what each module's clipped sum needs (:class:`BookkeepingStash`): a sketched or exact
layer with a clipped-sum function keeps its input and output gradient, a layer on Opacus'
per-sample-gradient path keeps those per-sample gradients, and in an activation-checkpointed
step each layer keeps whichever of the two is smaller (:mod:`~opacus_rc.grad_sample.norms`).
:func:`write_clipped_sums` then writes ``p.grad += sum_i c_i grad_p loss_i``, exactly what the
second pass accumulates. No random number is drawn here: the probes of the first pass are the only
ones, in both modes.

The stashes are owned by the step's
:class:`~opacus_rc.grad_sample.private_step.PrivateStep` and never outlive the step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import nn

from opacus_rc.grad_sample.clip import apply_clip_factors
from opacus_rc.grad_sample.registry import ClippedSumFunction

__all__ = [
    "BookkeepingStash",
    "add_to_grads",
    "compute_clipped_sums",
    "consume_weighted_sum",
    "per_sample_weighted_sum",
    "write_clipped_sums",
]


class BookkeepingStash(NamedTuple):
    """What one module's first backward pass leaves for its clipped gradient sum (a frozen
    record).

    Either ``activations``/``backprops`` (a layer with a clipped-sum function) or
    ``grad_samples`` (per-sample gradients from Opacus' exact path). Every tensor is detached.

    Attributes:
        module: The module the stash belongs to.
        params: The trainable parameters this stash gives a gradient to.
        activations: The layer's forward inputs, batch first (e.g. ``[A]`` with ``A`` of shape
            ``(B, ..., d)``), or None.
        backprops: The output gradient ``G``, batch first (``(B, ..., p)``), or None.
        grad_samples: ``{parameter: (B, *parameter.shape) tensor}``, or None.
        scale: The factor that rescales ``backprops`` (and the per-sample gradients made from
            them) to per-sample losses: Opacus' ``max_batch_len`` under
            ``loss_reduction="mean"``, applied to the ``(B,)`` clip factors instead of to a copy
            of ``G``; 1 where they are already rescaled.
    """

    module: nn.Module
    params: tuple[nn.Parameter, ...]
    activations: list[torch.Tensor] | None = None
    backprops: torch.Tensor | None = None
    grad_samples: dict[nn.Parameter, torch.Tensor] | None = None
    scale: float = 1


def per_sample_weighted_sum(coef: torch.Tensor, grad_sample: torch.Tensor) -> torch.Tensor:
    """``einsum("b,b...->...", coef, grad_sample)`` in ``grad_sample``'s dtype, autocast off.

    Args:
        coef: ``(B,)`` clip factors.
        grad_sample: ``(B, *shape)`` per-sample gradients.

    Returns:
        Tensor of shape ``shape``.
    """
    return apply_clip_factors(coef, grad_sample, dtype=grad_sample.dtype, reduce=True)


def consume_weighted_sum(coef: torch.Tensor, grad_sample: torch.Tensor) -> torch.Tensor:
    """:func:`per_sample_weighted_sum` of a stash that is used up: for ``B = 1`` the one
    per-sample gradient is scaled in place and returned (a view of ``grad_sample``), so the
    clipped sum takes no second copy of the stash.

    Args:
        coef: ``(B,)`` clip factors.
        grad_sample: ``(B, *shape)`` per-sample gradients, not used afterwards by the caller.

    Returns:
        Tensor of shape ``shape``.
    """
    return apply_clip_factors(coef, grad_sample, dtype=grad_sample.dtype, reduce=True, consume=True)


def write_clipped_sums(
    stashes: list[BookkeepingStash],
    coef: torch.Tensor,
    *,
    clipped_sums: Mapping[type[nn.Module], ClippedSumFunction],
    name_of: Callable[[object], str],
) -> None:
    """Add ``sum_i coef_i grad_p loss_i`` to ``p.grad`` for every parameter of ``stashes``.

    Args:
        stashes: This step's stashes (consumed: a ``B = 1`` per-sample-gradient stash is
            scaled in place, :func:`consume_weighted_sum`).
        coef: ``(B,)`` clip factors of this step.
        clipped_sums: Module type -> clipped-sum function
            (:data:`~opacus_rc.grad_sample.registry.CLIPPED_SUM_FUNCTIONS`).
        name_of: Qualified name of a module or parameter, for error messages.

    Raises:
        ValueError: If a clipped-sum function gives no tensor, or one of the wrong shape, for a
            parameter of its module.
    """
    sums = compute_clipped_sums(stashes, coef, clipped_sums=clipped_sums, name_of=name_of)
    with torch.no_grad():  # add_to_grads, in line (it runs at every step)
        for p, g in sums.items():
            g = g.to(device=p.device, dtype=p.dtype)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


def add_to_grads(sums: Mapping[nn.Parameter, torch.Tensor]) -> None:
    """``p.grad += g`` for each ``(p, g)`` of ``sums`` (``p.grad = g`` where it is None), in
    ``p``'s dtype and on its device.

    Args:
        sums: ``{parameter: tensor of its shape}``.
    """
    with torch.no_grad():
        for p, g in sums.items():
            g = g.to(device=p.device, dtype=p.dtype)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


def compute_clipped_sums(
    stashes: list[BookkeepingStash],
    coef: torch.Tensor,
    *,
    clipped_sums: Mapping[type[nn.Module], ClippedSumFunction],
    name_of: Callable[[object], str],
) -> dict[nn.Parameter, torch.Tensor]:
    """``{p: sum_i coef_i grad_p loss_i}`` for every parameter of ``stashes`` (nothing written).

    Arguments and errors as :func:`write_clipped_sums`; each tensor has ``p.shape`` (the global
    shape of a sharded parameter) and the dtype its clipped-sum function gave.
    """
    out: dict[nn.Parameter, torch.Tensor] = {}
    with torch.no_grad():
        for stash in stashes:
            module = stash.module
            # The stash's rescale to per-sample losses, on the (B,) factors.
            c = coef if stash.scale == 1 else coef * stash.scale
            if stash.grad_samples is not None:
                sums = {}
                for p, gs in stash.grad_samples.items():  # consume_weighted_sum, in line
                    sums[p] = apply_clip_factors(c, gs, dtype=gs.dtype, reduce=True, consume=True)
            else:
                fn = clipped_sums[type(module)]
                assert stash.backprops is not None and stash.activations is not None
                sums = fn(module, stash.activations, stash.backprops, c.to(stash.backprops.device))
            for p in stash.params:
                g = sums.get(p)
                if g is None or g.shape != p.shape:
                    raise ValueError(
                        f"the clipped sum of '{name_of(module)}' ({type(module).__name__}) gave "
                        f"{'no tensor' if g is None else f'shape {tuple(g.shape)}'} for "
                        f"parameter '{name_of(p)}' of shape {tuple(p.shape)}"
                    )
                # A weight tied between two modules (tied.py) gets both modules' sums, added
                # in place (the first may be a B = 1 stash scaled in place: no second copy).
                if p in out:
                    out[p].add_(g.to(out[p]))
                else:
                    out[p] = g
    return out
