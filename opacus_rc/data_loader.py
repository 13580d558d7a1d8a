"""A distributed Poisson data loader that keeps empty batches (used by the engine under DDP).

Opacus' ``DistributedUniformWithReplacementSampler`` (opacus 1.6.0) skips a rank's batch when
its Poisson sample is empty, while the single-process ``UniformWithReplacementSampler`` yields
it. Under DDP the ranks then run different numbers of steps per epoch: their gradient
all-reduces fall out of step (summing gradients of different logical steps, or hanging), each
rank's accountant counts a different number of steps, and a missing step reveals that the
rank's batch was empty, i.e. that no record of its shard was sampled. Every step must be
taken, noised and accounted, empty or not (docs/privacy/mechanism.md#mechanism-reduction: an empty batch is a noise-only step).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from opacus.data_loader import DPDataLoader, dtype_safe, shape_safe, wrap_collate_with_empty
from opacus.utils.uniform_sampler import DistributedUniformWithReplacementSampler
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import default_collate

__all__ = ["DistributedDPDataLoader", "DistributedPoissonSampler"]

logger = logging.getLogger(__name__)


class DistributedPoissonSampler(DistributedUniformWithReplacementSampler):
    """Opacus' distributed Poisson sampler, but every one of ``num_batches`` batches is yielded
    (an empty index tensor when no record of this rank's shard is sampled), and the ranks'
    masks are independent when no generator is given.

    Poisson subsampling includes every record independently with probability ``q``
    (docs/privacy/mechanism.md). Opacus' sampler draws each rank's mask from the global RNG
    when ``generator`` is None, and ranks are usually seeded alike (identical initialisation):
    every rank then draws the *same* mask over its own shard, so record ``j`` of rank 0 is
    sampled exactly when record ``j`` of rank 1 is. Without a generator this sampler therefore
    draws one seed from the global RNG (reproducible under ``torch.manual_seed``) and derives
    the rank's own generator from it and the rank with :class:`numpy.random.SeedSequence`
    (independent streams per rank). A passed ``generator`` is used as given: it must differ
    between ranks (Opacus' secure-mode generator does).

    Args:
        total_size: Number of records in the dataset.
        sample_rate: ``q``.
        generator: Source of the masks on this rank, or None (see above).
        **kwargs: Opacus' ``DistributedUniformWithReplacementSampler`` arguments
            (``shuffle``, ``shuffle_seed``, ``steps``).
    """

    def __init__(
        self,
        *,
        total_size: int,
        sample_rate: float,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            total_size=total_size, sample_rate=sample_rate, generator=generator, **kwargs
        )
        if generator is None:
            base = int(torch.randint(0, 2**62, (), dtype=torch.int64))
            seed = np.random.SeedSequence(base, spawn_key=(self.rank,)).generate_state(1)[0]
            self.generator = torch.Generator().manual_seed(int(seed))

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.shuffle_seed + self.epoch)
            indices = torch.randperm(self.total_size, generator=g)
        else:
            indices = torch.arange(self.total_size)
        indices = indices[self.rank : self.total_size : self.num_replicas]
        for _ in range(self.num_batches):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            yield indices[mask.nonzero(as_tuple=False).reshape(-1)]


class DistributedDPDataLoader(DPDataLoader):
    """``DPDataLoader(distributed=True)`` with :class:`DistributedPoissonSampler`.

    Build it with ``DistributedDPDataLoader.from_data_loader(loader, distributed=True, ...)``,
    exactly as Opacus' ``DPDataLoader``; empty batches are collated by Opacus' wrapper.

    Raises:
        ValueError: If ``distributed`` is ``False`` (use Opacus' ``DPDataLoader``).
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        sample_rate: float,
        collate_fn: Any = None,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
        distributed: bool = True,
        batch_first: bool = True,
        rand_on_empty: bool = False,
        **kwargs: Any,
    ) -> None:
        if not distributed:
            raise ValueError("DistributedDPDataLoader is for distributed=True only")
        self.sample_rate = sample_rate
        self.distributed = True
        batch_sampler = DistributedPoissonSampler(
            total_size=len(dataset),  # type: ignore[arg-type]
            sample_rate=sample_rate,
            generator=generator,
        )
        if drop_last:
            logger.warning("Ignoring drop_last as it is not compatible with DPDataLoader.")
        DataLoader.__init__(
            self,
            dataset=dataset,
            batch_sampler=batch_sampler,
            collate_fn=wrap_collate_with_empty(
                collate_fn=default_collate if collate_fn is None else collate_fn,
                batch_first=batch_first,
                rand_on_empty=rand_on_empty,
                sample_empty_shapes=[(0, *shape_safe(x)) for x in dataset[0]],
                dtypes=[dtype_safe(x) for x in dataset[0]],
            ),
            generator=generator,
            **kwargs,
        )
