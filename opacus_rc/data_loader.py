"""A distributed Poisson data loader that keeps empty batches (used by the engine under DDP).

Opacus' ``DistributedUniformWithReplacementSampler`` (opacus 1.6.0) skips a rank's batch when
its Poisson sample is empty, while the single-process ``UniformWithReplacementSampler`` yields
it. Under DDP the ranks then run different numbers of steps per epoch: their gradient
all-reduces fall out of step (summing gradients of different logical steps, or hanging), each
rank's accountant counts a different number of steps, and a missing step reveals that the
rank's batch was empty, i.e. that no record of its shard was sampled. Every step must be
taken, noised and accounted, empty or not (docs/privacy/mechanism.md#mechanism-reduction: an empty
batch is a noise-only step).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from opacus.data_loader import CollateFnWithEmpty, DPDataLoader, dtype_safe, shape_safe
from opacus.utils.uniform_sampler import DistributedUniformWithReplacementSampler
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import default_collate

from opacus_rc._compat.opacus import make_empty_batch

__all__ = ["DistributedDPDataLoader", "DistributedPoissonSampler", "RandomOnEmptyCollate"]

logger = logging.getLogger(__name__)


def worker_options(data_loader: DataLoader) -> dict[str, Any]:
    """The options of ``data_loader`` that a loader rebuilt around it with another sampler keeps.

    Its workers (``num_workers``, ``worker_init_fn``, ``multiprocessing_context``,
    ``prefetch_factor``, ``persistent_workers``, ``timeout``), ``collate_fn`` and
    ``pin_memory``, as Opacus' ``DPDataLoader.from_data_loader`` and ``BatchMemoryManager``
    carry them over; the sampler, batch size, ``drop_last`` and generator are the new
    loader's concern.

    Args:
        data_loader: The loader to take them from.

    Returns:
        Keyword arguments of :class:`torch.utils.data.DataLoader`.
    """
    return {
        "num_workers": data_loader.num_workers,
        "collate_fn": data_loader.collate_fn,
        "pin_memory": data_loader.pin_memory,
        "timeout": data_loader.timeout,
        "worker_init_fn": data_loader.worker_init_fn,
        "multiprocessing_context": data_loader.multiprocessing_context,
        "prefetch_factor": data_loader.prefetch_factor,
        "persistent_workers": data_loader.persistent_workers,
    }


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


class RandomOnEmptyCollate(CollateFnWithEmpty):
    """Opacus' ``CollateFnWithEmpty``, with ``rand_on_empty`` honoured from the first batch on.

    Opacus' wrapper learns a batch's structure from the first non-empty batch; an empty batch
    *before* it is returned with a zero-length batch dimension even when ``rand_on_empty=True``.
    One process rarely meets that (``P = (1 - q)^N``), but a rank Poisson-samples only its shard
    of ``N / world_size`` records, so with a small ``q`` its first batch is often empty: a model
    that cannot take ``B = 0`` (an HF Llama) then crashes on the very batch ``rand_on_empty``
    was asked to replace. This wrapper learns the structure instead from ``collate_fn`` applied
    to the dataset's first record, and replaces it as Opacus replaces an empty batch: every
    tensor with batch size 1 (dimension 0, or 1 if not ``batch_first``), filled with random
    0/1 values of its dtype (``torch.randint(0, 2)``). Only the structure, shapes and dtypes of
    that record are used (as Opacus' own first-batch fallback uses ``dataset[0]``'s shapes), not
    its values.

    Privacy: the random batch depends on no record (only on the public parameters through its
    gradient), so the released step is still the Poisson-subsampled Gaussian mechanism and is
    accounted as one: a data-independent term changes no sensitivity. It is a bias, not a
    leak: the noise-only step of an empty batch becomes the noisy clipped gradient of one
    random input (Opacus' ``rand_on_empty``).

    Args:
        collate_fn: The loader's collate function.
        dataset: The dataset (its first record gives the structure of a random batch).
        batch_first: Batch dimension 0 (else 1).
        rand_on_empty: Opacus' flag; False behaves exactly as Opacus' wrapper.
    """

    def __init__(
        self, *, collate_fn: Any, dataset: Dataset, batch_first: bool, rand_on_empty: bool
    ) -> None:
        super().__init__(
            collate_fn,
            batch_first=batch_first,
            rand_on_empty=rand_on_empty,
            sample_empty_shapes=[(0, *shape_safe(x)) for x in dataset[0]],
            dtypes=[dtype_safe(x) for x in dataset[0]],
        )
        self._dataset = dataset

    def __call__(self, batch: list[Any]) -> Any:
        if not batch and self.rand_on_empty and self.first_batch is None:
            template = self.wrapped_collator_fn([self._dataset[0]])
            return make_empty_batch(self, template)  # random, batch size 1 (Opacus)
        return super().__call__(batch)


class DistributedDPDataLoader(DPDataLoader):
    """``DPDataLoader(distributed=True)`` with :class:`DistributedPoissonSampler`.

    Build it with ``DistributedDPDataLoader.from_data_loader(loader, distributed=True, ...)``,
    exactly as Opacus' ``DPDataLoader``. Empty batches are collated by Opacus' wrapper; with
    ``rand_on_empty=True`` an empty batch is replaced by a random batch of size 1 as in Opacus,
    the first batch included (:class:`RandomOnEmptyCollate`; the random input is
    data-independent, so the guarantee is unchanged).

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
            collate_fn=RandomOnEmptyCollate(
                collate_fn=default_collate if collate_fn is None else collate_fn,
                dataset=dataset,
                batch_first=batch_first,
                rand_on_empty=rand_on_empty,
            ),
            generator=generator,
            **kwargs,
        )
