"""One ``make_private`` call's options validated as a whole, before any hook.

* :func:`check_data_loader`: the loader Poisson sampling (and the accountant) can use: a
  map-style dataset of known size; a sampler Poisson sampling replaces is warned about.
* :func:`validate_options`: every option of a
  :class:`~opacus_rc.engine.options.MakePrivateOptions` checked (Opacus' own clipping or
  randomized clipping), and the same record returned with what is derived from the options:
  the public sizes (:func:`~opacus_rc.engine.schedule.public_sizes`), the post-processing
  (:func:`~opacus_rc.engine.post_processing.prepare_post_processing`) and, for randomized
  clipping, the one :class:`~opacus_rc.config.RandomizedClippingConfig` that configures the
  module and the optimizer. Nothing is attached: a call that raises leaves the model as it
  was.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import torch
from opacus.data_loader import DPDataLoader
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP  # noqa: N817
from opacus.utils.uniform_sampler import (
    DistributedUniformWithReplacementSampler,
    UniformWithReplacementSampler,
)
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from opacus_rc.config import DEFAULT_SKETCH, DEFAULT_SKETCH_DIM, RandomizedClippingConfig
from opacus_rc.engine.options import MakePrivateOptions
from opacus_rc.engine.post_processing import prepare_post_processing
from opacus_rc.engine.schedule import public_sizes
from opacus_rc.units.data_loader import UnitDataLoader

__all__ = ["check_data_loader", "check_per_rank_loader", "validate_options"]

#: ``poisson_sampling=False``: the accountant still assumes Poisson sampling at rate
#: ``1 / len(data_loader)``, which fixed or shuffled batches do not give (Chua et al., "How
#: Private are DP-SGD Implementations?", ICML 2024: shuffling can leak far more than the
#: Poisson epsilon). Opacus accepts it silently (meta-pytorch/opacus PR 745).
_NO_POISSON_WARNING = (
    "poisson_sampling=False: the data loader's batches are not Poisson samples, but the "
    "accountant's epsilon assumes Poisson sampling at rate 1/len(data_loader); for fixed or "
    "shuffled batches it is not a valid guarantee. Keep poisson_sampling=True for a private "
    "run (use BatchMemoryManager to bound the physical batch size)"
)
_ACCOUNTANT_ERROR = (
    "clipping='randomized' needs an accountant that can account for sketched norms; "
    "use accountant='rc'"
)
_RANDOMIZED_GRAD_SAMPLE_MODES = ("hooks", "ghost")


#: Samplers that draw every record uniformly: Opacus' Poisson sampler replaces them without a
#: change of what the loader's weighting means (a ``DistributedSampler`` shards uniformly too).
_UNIFORM_SAMPLERS = (SequentialSampler, RandomSampler, DistributedSampler)
#: Batch samplers Opacus replaces by Poisson sampling as the loader's own (``BatchSampler``) or
#: keeps as Poisson samplers already.
_KNOWN_BATCH_SAMPLERS = (
    BatchSampler,
    UniformWithReplacementSampler,
    DistributedUniformWithReplacementSampler,
)


def check_data_loader(data_loader: Any, *, poisson_sampling: bool) -> None:
    """Refuse a loader Poisson sampling (or the accountant) cannot use; warn on a replaced sampler.

    Poisson sampling includes every record independently with probability ``q`` (the
    accountant's model): it needs a map-style dataset of known size ``N`` (records by index,
    ``len(dataset)``), and it replaces the loader's sampler (Opacus does it silently).

    Raises:
        TypeError: If ``data_loader`` is not a ``DataLoader``.
        ValueError: If its dataset is an ``IterableDataset``, or has no ``len()``.
    """
    if not isinstance(data_loader, DataLoader):
        raise TypeError(
            f"data_loader must be a torch.utils.data.DataLoader, got {type(data_loader).__name__}"
        )
    dataset = data_loader.dataset
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            f"the data loader's dataset is an IterableDataset ({type(dataset).__name__}): "
            "Poisson sampling, which the privacy guarantee assumes, includes every record "
            "independently with probability q, so it needs a map-style dataset of known size "
            "(a torch.utils.data.Dataset with __len__ and __getitem__). Materialise the "
            "stream first (e.g. a Hugging Face datasets.Dataset instead of streaming=True / "
            "IterableDataset, or a list of its records)"
        )
    try:
        len(dataset)  # type: ignore[arg-type]
    except TypeError as err:
        raise ValueError(
            f"the data loader's dataset ({type(dataset).__name__}) has no len(): Poisson "
            "sampling and the sampling rate q need a map-style dataset of known size "
            "(define __len__)"
        ) from err
    if not poisson_sampling or isinstance(data_loader, (DPDataLoader, UnitDataLoader)):
        return
    batch_sampler = data_loader.batch_sampler
    if not isinstance(batch_sampler, _KNOWN_BATCH_SAMPLERS):
        replaced = f"batch_sampler {type(batch_sampler).__name__}"
    elif isinstance(batch_sampler, BatchSampler) and not isinstance(
        batch_sampler.sampler, _UNIFORM_SAMPLERS
    ):
        replaced = f"sampler {type(batch_sampler.sampler).__name__}"
    else:
        return
    warnings.warn(
        f"the data loader's {replaced} is replaced by Poisson sampling (every record "
        "included independently with the same probability q), which the privacy guarantee "
        "assumes: its weighting or order is not used. Sampling with unequal probabilities "
        "is not what the accountant analyses. To reweight records, weight each sample's loss "
        "instead (the per-sample gradient is clipped after weighting); pass a plain "
        "DataLoader(dataset, batch_size=B) to silence this warning",
        UserWarning,
        stacklevel=4,
    )


def check_per_rank_loader(
    data_loader: DataLoader, *, world_size: int, poisson_sampling: bool
) -> None:
    """Refuse a loader every rank would iterate whole under ``poisson_sampling=False``.

    With ``poisson_sampling=False`` each of the ``world_size`` processes iterates its own
    loader as it is. A loader over a ``SequentialSampler`` or ``RandomSampler`` (the default
    ``DataLoader(dataset, batch_size=B)``) gives every rank the whole dataset, so a record
    enters each step's sum once per rank: its influence is up to ``world_size * C`` where the
    accountant counts ``C`` (and the divisor, ``B * world_size``, would count the copies as
    records).

    Args:
        data_loader: The user's data loader.
        world_size: The number of data-parallel processes (1: not distributed).
        poisson_sampling: ``make_private``'s argument.

    Raises:
        ValueError: If ``world_size > 1``, ``poisson_sampling`` is False and the loader's
            sampler is a ``SequentialSampler`` or ``RandomSampler``.
    """
    if world_size <= 1 or poisson_sampling:
        return
    sampler = getattr(data_loader, "sampler", None)
    if isinstance(sampler, (SequentialSampler, RandomSampler)):
        raise ValueError(
            f"poisson_sampling=False with {world_size} processes: each process iterates its "
            f"loader as it is, and this loader's {type(sampler).__name__} gives every process "
            f"the whole dataset, so each record would enter a step's sum {world_size} times "
            f"(its influence up to {world_size} C, accounted as C). Shard the data with "
            "DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset)), or keep "
            "poisson_sampling=True (the engine then samples and shards the records itself)"
        )


def _data_parallel_world_size(module: Any) -> int:
    """The number of processes of a data-parallel ``module`` (1 for any other module).

    The model types Opacus' ``make_private`` treats as distributed: Opacus' DPDDP, torch DDP
    and FSDP2 (``FSDPModule``), whose process group is initialised (their constructors need it).
    """
    if isinstance(module, (DPDDP, DDP, FSDPModule)) and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def validate_options(
    options: MakePrivateOptions, *, accountant: Any, secure_mode: bool
) -> MakePrivateOptions:
    """Validate one call's options (attaching nothing) and derive what the call builds from.

    Args:
        options: The call's options, as the caller passed them.
        accountant: The engine's accountant (randomized clipping needs one whose class has
            ``supports_randomized_clipping``).
        secure_mode: The engine's secure mode (it enters the configuration).

    Returns:
        A copy of ``options`` with ``criterion`` defaulted to ``nn.CrossEntropyLoss()`` and the
        derived fields set (:data:`~opacus_rc.engine.options.DERIVED_FIELDS`). For randomized
        clipping, ``grad_sample_mode`` is ``"ghost"``: Opacus then builds the criterion and
        returns four values; the module itself is built by the engine's
        ``prepare_model_seam`` (:class:`~opacus_rc.engine.seams.RandomizedClippingSeams`).

    Raises:
        ValueError, TypeError, NotImplementedError: As ``PrivacyEngine.make_private``.
    """
    check = options.check_batch_independence
    if not isinstance(check, bool):
        raise TypeError(
            f"check_batch_independence must be True or False, got {type(check).__name__}"
        )
    module = options.module
    data_loader = options.data_loader
    poisson_sampling = options.poisson_sampling
    check_data_loader(data_loader, poisson_sampling=poisson_sampling)
    if options.dataset_size is not None and not poisson_sampling and data_loader.batch_size:
        # With a batch_size it sets the Poisson rate; without one (a DPDataLoader, a
        # UnitDataLoader, a custom batch_sampler) only the divisor, whatever the sampling.
        raise ValueError(
            "dataset_size sets the Poisson sampling rate of a loader with a batch_size; it "
            "needs poisson_sampling=True"
        )
    world_size = _data_parallel_world_size(module)
    check_per_rank_loader(data_loader, world_size=world_size, poisson_sampling=poisson_sampling)
    # refuses an empty loader
    sizes = public_sizes(
        data_loader,
        dataset_size=options.dataset_size,
        loss_reduction=options.loss_reduction,
        world_size=world_size,
        poisson_sampling=poisson_sampling,
    )
    denoiser, lora_guard = prepare_post_processing(
        module=module,
        grad_sample_mode=options.grad_sample_mode,
        denoise=options.denoise,
        denoise_kappa=options.denoise_kappa,
        denoise_options=options.denoise_options,
        check_lora_update=options.check_lora_update,
    )
    criterion = nn.CrossEntropyLoss() if options.criterion is None else options.criterion
    if not poisson_sampling and not isinstance(data_loader, (DPDataLoader, UnitDataLoader)):
        # An Opacus DPDataLoader (ours included) already draws Poisson batches; Opacus then
        # accounts at rate 1 / len(loader) = 1 / floor(1 / q) >= q, which is conservative.
        warnings.warn(_NO_POISSON_WARNING, UserWarning, stacklevel=3)
    clipping = options.clipping
    sketch_options = (
        options.sketch,
        options.sketch_dim,
        options.sketch_head_dim,
        options.sketch_generator,
    )
    if clipping != "randomized":
        if any(o is not None for o in sketch_options):
            raise ValueError(
                "sketch, sketch_dim, sketch_head_dim and sketch_generator only apply to "
                f"clipping='randomized' (got clipping={clipping!r})"
            )
        if options.bookkeeping is not True:
            raise ValueError(
                f"bookkeeping only applies to clipping='randomized' (got clipping={clipping!r})"
            )
        return replace(
            options,
            criterion=criterion,
            kwargs=dict(options.kwargs),
            sizes=sizes,
            denoiser=denoiser,
            lora_guard=lora_guard,
        )

    if options.kwargs:
        raise TypeError(
            f"unexpected keyword arguments for clipping='randomized': {sorted(options.kwargs)}"
        )
    if not getattr(type(accountant), "supports_randomized_clipping", False):
        raise ValueError(_ACCOUNTANT_ERROR)
    config = RandomizedClippingConfig(
        max_grad_norm=options.max_grad_norm,
        sketch=DEFAULT_SKETCH if options.sketch is None else options.sketch,
        sketch_dim=DEFAULT_SKETCH_DIM if options.sketch_dim is None else options.sketch_dim,
        sketch_head_dim=options.sketch_head_dim,
        sketch_generator=options.sketch_generator,
        secure_mode=secure_mode,
        batch_first=options.batch_first,
        loss_reduction=options.loss_reduction,
        bookkeeping=options.bookkeeping,
    )
    criterion_reduction = getattr(criterion, "reduction", None)
    if criterion_reduction is not None and criterion_reduction != config.loss_reduction:
        raise ValueError(
            f"the criterion has reduction={criterion_reduction!r} but "
            f"loss_reduction={config.loss_reduction!r}; they must match"
        )
    grad_sample_mode = options.grad_sample_mode
    if grad_sample_mode not in _RANDOMIZED_GRAD_SAMPLE_MODES:
        raise ValueError(
            f"clipping='randomized' uses its own grad-sample module; grad_sample_mode must "
            f"be one of {_RANDOMIZED_GRAD_SAMPLE_MODES}, got {grad_sample_mode!r}"
        )
    # Opacus builds the DP criterion (and returns four values) only for "ghost" modes.
    return replace(
        options,
        criterion=criterion,
        grad_sample_mode="ghost",
        kwargs={},
        config=config,
        sizes=sizes,
        denoiser=denoiser,
        lora_guard=lora_guard,
    )
