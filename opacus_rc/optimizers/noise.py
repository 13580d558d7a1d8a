"""Where the Gaussian noise of a step is drawn: one function, one placement per topology.

Every randomized-clipping optimizer (:class:`~opacus_rc.optimizers.RandomizedClipOptimizer` and
its DDP and FSDP2 variants) adds its noise by calling :func:`add_gaussian_noise` from its
``add_noise`` and nowhere else; the draw itself is Opacus' (``generate_noise`` of
:mod:`opacus_rc._compat.opacus`, which also provides secure mode). What differs between the
topologies is only *who draws* and *how a draw meets a sharded gradient*, and that is the
optimizer's ``noise_placement``, one of :data:`NOISE_PLACEMENTS`:

* ``"single_process"``: the process draws ``N(0, std^2)`` of each parameter's shape and adds it
  to that parameter's clipped sum (Opacus' ``DPOptimizer.add_noise``);
* ``"ddp_rank0"``: rank 0 draws as in one process, the other ranks pass their clipped sums on
  unchanged; the all-reduce that follows (the optimizer's ``reduce_gradients``) sums them, so
  the released gradient carries exactly one draw;
* ``"fsdp2_shard"``: every rank draws the parameter's *global* shape (the clipped sum is a
  sharded DTensor) and adds it as a replicated tensor to its own shard
  (``torch.distributed.tensor.experimental.implicit_replication``), so each coordinate receives
  the one draw of the rank that holds it (see :mod:`~opacus_rc.optimizers.
  fsdp_randomized_clip_optimizer` for why a rank does not draw only its shard).

The parameters are visited in order and each draw uses the optimizer's generator, so a seeded
generator gives the same noise as Opacus' own ``add_noise`` (bit for bit;
``tests/optimizers/test_noise.py``). The noise is added once per logical step: Opacus' processed
flag of each clipped sum is checked before and set after (a second ``add_noise`` of the same
sums raises Opacus' ``ValueError``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from opacus_rc._compat.opacus import check_processed_flag, generate_noise, mark_as_processed
from opacus_rc.validation import validate_choice

__all__ = ["NOISE_PLACEMENTS", "add_gaussian_noise"]


#: Every way the randomized-clipping optimizers place their noise (see the module docstring).
NOISE_PLACEMENTS = ("single_process", "ddp_rank0", "fsdp2_shard")


def add_gaussian_noise(
    params: Sequence[torch.Tensor],
    summed_grads: Sequence[torch.Tensor],
    *,
    std: float,
    placement: str,
    generator: torch.Generator | None,
    secure_mode: bool,
    rank: int = 0,
) -> None:
    """Set ``p.grad = summed_grad + N(0, std^2 I)`` for every parameter (the step's noise).

    The Gaussian mechanism of one DP-SGD step (Abadi et al. 2016, Algorithm 1, line "Add
    noise"), with ``std = sigma * C`` in the units of the gradient. Where the draw happens is
    the placement's (:data:`NOISE_PLACEMENTS`: rank 0 alone under ``"ddp_rank0"``, every process
    otherwise; under ``"fsdp2_shard"`` inside ``implicit_replication``); the draw is Opacus'
    (:func:`opacus_rc._compat.opacus.generate_noise`: zeros for ``std == 0``; with
    ``secure_mode`` the construction of Holohan and Braghin 2021, arXiv:2107.10138, Section
    5.1). Parameters are processed in order, one draw each from ``generator``.

    Args:
        params: The parameters, in the optimizer's order; ``p.grad`` is replaced (a tensor of
            ``p``'s shape, or ``p``'s DTensor shard).
        summed_grads: For each parameter, its clipped gradient sum (of ``p``'s shape, or a
            sharded DTensor under FSDP2); not modified, and marked processed.
        std: Noise standard deviation ``sigma * C`` (>= 0).
        placement: One of :data:`NOISE_PLACEMENTS`.
        generator: The noise generator (never the sketch generator); ``None``: torch's default.
        secure_mode: Opacus' secure noise generation.
        rank: This process's rank (0 in one process).

    Raises:
        ValueError: If ``params`` and ``summed_grads`` differ in length, the placement is
            unknown, or a clipped sum was already noised (Opacus' processed flag).
    """
    if len(params) != len(summed_grads):
        raise ValueError(
            f"{len(params)} parameters but {len(summed_grads)} clipped sums: one per parameter"
        )
    if placement not in NOISE_PLACEMENTS:  # the validator raises, listing the placements
        validate_choice("noise_placement", placement, NOISE_PLACEMENTS)
    draws = placement != "ddp_rank0" or rank == 0
    context = implicit_replication if placement == "fsdp2_shard" else contextlib.nullcontext
    with context():
        for p, summed in zip(params, summed_grads):
            check_processed_flag(summed)
            if draws:
                noise = generate_noise(
                    std=std, reference=summed, generator=generator, secure_mode=secure_mode
                )
                if (
                    noise.shape == summed.shape
                    and noise.dtype == summed.dtype
                    and not isinstance(summed, DTensor)
                ):
                    # noise + summed in the noise's fresh tensor (IEEE addition commutes: the
                    # same values as summed + noise, without a third tensor of p's size).
                    p.grad = noise.add_(summed).view_as(p)
                else:
                    p.grad = (summed + noise).view_as(p)
            else:
                p.grad = summed.clone().view_as(p)  # no aliasing of summed_grad (Opacus PR 707)
            mark_as_processed(summed)
