"""What the denoiser did: one record per parameter, the report of a call, and the pending
report whose numbers are still on the device (post-processing: functions of the released noisy
gradient and public constants only, docs/denoising.md#denoising-post-processing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DenoiseRecord", "DenoiseReport"]


@dataclass(frozen=True)
class DenoiseRecord:
    r"""What the denoiser did to one parameter at its last call.

    All numbers are functions of the released noisy gradient and public constants, so recording
    them is post-processing too.

    Attributes:
        index: Position of the parameter in ``optimizer.params``.
        shape: Shape of its gradient.
        status: ``"denoised"`` (threshold met, gradient replaced), ``"below_threshold"`` (left
            unchanged by the rule), ``"skipped_not_2d"``, ``"skipped_min_dim"`` or ``"no_grad"``.
        top_singular_value: :math:`s_1` of the noisy gradient (``None`` if skipped).
        threshold: :math:`\kappa\sigma_e(\sqrt m + \sqrt n)` (``None`` if skipped).
        kept_rank: Number of singular values the shrinker kept non-zero (``None`` if skipped).
        svd_rank: Singular triplets computed: ``min(m, n)`` for the exact SVD, less for a
            randomized one that stopped early (``None`` if skipped).
    """

    index: int
    shape: tuple[int, ...]
    status: str
    top_singular_value: float | None = None
    threshold: float | None = None
    kept_rank: int | None = None
    svd_rank: int | None = None


@dataclass(frozen=True)
class DenoiseReport:
    r"""Summary of one :class:`~opacus_rc.denoising.SpectralDenoiser` call.

    Attributes:
        noise_std: :math:`\sigma_e` used for every matrix
            (:func:`~opacus_rc.denoising.noise_std_from_optimizer`).
        records: One :class:`DenoiseRecord` per parameter of ``optimizer.params``, in order.
    """

    noise_std: float
    records: tuple[DenoiseRecord, ...]

    @property
    def num_denoised(self) -> int:
        """Number of parameters whose gradient was replaced."""
        return sum(r.status == "denoised" for r in self.records)


@dataclass(frozen=True)
class _PendingReport:
    """A :class:`DenoiseReport` whose per-matrix numbers are still on the device.

    ``records`` holds the final record of every skipped parameter and, for a denoised-or-not one,
    a record with ``status=""`` whose three device-held numbers are column ``j`` of a ``(3, b)``
    float64 tensor ``(s_1, applied, kept_rank)`` in ``stats``: ``(record positions, tensor)``
    per group. :meth:`resolve` reads them in one transfer per device. float64 holds every value
    exactly (float32 or float64 singular values, 0/1, ranks below 2^53), and no tensor here
    aliases a gradient, so the report equals a read at call time.
    """

    noise_std: float
    records: tuple[DenoiseRecord, ...]
    stats: tuple[tuple[tuple[int, ...], Tensor], ...]

    def resolve(self) -> DenoiseReport:
        """The :class:`DenoiseReport`, reading the device once per device."""
        records = list(self.records)
        by_device: dict[torch.device, list[tuple[tuple[int, ...], Tensor]]] = {}
        for positions, stats in self.stats:
            by_device.setdefault(stats.device, []).append((positions, stats))
        for groups in by_device.values():
            columns = torch.cat([stats for _, stats in groups], dim=1).tolist()
            positions = [i for group_positions, _ in groups for i in group_positions]
            for j, i in enumerate(positions):
                top, applied, kept = columns[0][j], columns[1][j], columns[2][j]
                records[i] = dataclasses.replace(
                    records[i],
                    status="denoised" if applied else "below_threshold",
                    top_singular_value=top,
                    kept_rank=int(kept),
                )
        return DenoiseReport(noise_std=self.noise_std, records=tuple(records))
