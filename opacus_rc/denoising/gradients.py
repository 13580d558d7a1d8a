"""Denoising a list of gradients in place: which are eligible, one batched SVD per shape group,
one device read per device (the finiteness check), the records left on the device.

Used by :class:`~opacus_rc.denoising.SpectralDenoiser` on ``optimizer.params``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from opacus_rc.denoising.batch import _denoise_batch
from opacus_rc.denoising.checks import _compute_dtype
from opacus_rc.denoising.options import DenoiseOptions
from opacus_rc.denoising.records import DenoiseRecord, _PendingReport

__all__: list[str] = []


def _classify(grad: Tensor | None, *, min_dim: int) -> str | None:
    """The skip status of a gradient (see :class:`DenoiseRecord`), ``None`` if it is denoised.

    Reads metadata only (no host synchronisation).
    """
    if grad is None:
        return "no_grad"
    if grad.dim() != 2 or grad.layout != torch.strided:
        return "skipped_not_2d"
    if min(grad.shape) < min_dim:
        return "skipped_min_dim"
    return None


def _denoise_gradients_(
    params: Sequence[Tensor],
    statuses: Sequence[str | None],
    *,
    noise_std: float,
    options: DenoiseOptions,
) -> _PendingReport:
    """Denoise ``p.grad`` in place for every ``p`` whose status (:func:`_classify`) is ``None``.

    Gradients of equal shape, dtype and device share one batched SVD, in float32 (float64 for
    float64 gradients), cast back to the gradient's dtype. Every eligible gradient is written
    back: ``torch.where`` has already put the noisy matrix where the threshold rule fails, and
    the round trip through the compute dtype is exact, so those gradients keep their values.

    Host synchronisation: one per device, for the finiteness check, and none per layer. The
    check comes first, so on non-finite input nothing is written.

    Raises:
        ValueError: If a gradient to denoise has non-finite entries (the message names the first
            group, in order of first appearance, that has one).
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, st in enumerate(statuses):
        if st is None:
            g = params[i].grad
            groups.setdefault((tuple(g.shape), g.dtype, g.device), []).append(i)
    _check_finite(params, groups)

    records: list[DenoiseRecord] = []
    for i, (p, st) in enumerate(zip(params, statuses, strict=True)):
        grad = p.grad
        shape = tuple(grad.shape) if grad is not None else tuple(p.shape)
        records.append(DenoiseRecord(index=i, shape=shape, status=st if st is not None else ""))
    stats: list[tuple[tuple[int, ...], Tensor]] = []
    for (shape, _, _), indices in groups.items():
        grads = [params[i].grad for i in indices]
        stack = torch.stack(grads)
        result = _denoise_batch(
            stack.to(_compute_dtype(stack.dtype)), noise_std=noise_std, options=options
        )
        out = result.out.to(stack.dtype)
        for j, grad in enumerate(grads):
            grad.copy_(out[j])
        threshold = options.kappa * noise_std * (math.sqrt(shape[0]) + math.sqrt(shape[1]))
        for i in indices:
            records[i] = DenoiseRecord(
                index=i, shape=shape, status="", threshold=threshold, svd_rank=result.svd_rank
            )
        numbers = torch.stack(
            [t.to(torch.float64) for t in (result.top, result.applied, result.kept_rank)]
        )
        stats.append((tuple(indices), numbers))
    return _PendingReport(noise_std=noise_std, records=tuple(records), stats=tuple(stats))


def _check_finite(params: Sequence[Tensor], groups: dict[tuple[Any, ...], list[int]]) -> None:
    """One device read per device: are all gradients in ``groups`` finite? Raise if not."""
    flags: dict[torch.device, list[Tensor]] = {}
    for (_, _, device), indices in groups.items():
        flags.setdefault(device, []).extend(torch.isfinite(params[i].grad).all() for i in indices)
    if all(bool(torch.stack(fl).all()) for fl in flags.values()):
        return
    for (shape, _, _), indices in groups.items():  # error path: find the first bad group
        bad = [i for i in indices if not bool(torch.isfinite(params[i].grad).all())]
        if bad:
            raise ValueError(
                f"non-finite gradient (nan or inf) for optimizer.params index(es) {bad} of "
                f"shape {shape}; spectral denoising needs a finite noisy gradient (check the "
                "learning rate, loss scaling or mixed-precision overflow)"
            )
