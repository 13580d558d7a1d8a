"""Making a DP trainer's model and optimizer private: one ``make_private`` call per run.

:func:`make_private_run` builds the engine (RC accountant), the generators, and, with
``PrivacyArguments.target_epsilon``, the noise multiplier searched for the Trainer's number of
optimizer steps at the rate the accountant records
(:func:`~opacus_rc.integrations.train_data.trainer_schedule`, the engine's own
:func:`~opacus_rc.engine.schedule.public_sizes`), then makes the model private with
``clipping="randomized"`` (hooks on the model's own modules, no wrapper) and checks that the
engine's mechanism (``engine.mechanism``) has the schedule and sketch the trainer sampled and
searched for. The result is one :class:`PrivateRun`. :func:`run_seeds` gives the seeds of the
run's sampler and noise generator; :func:`causal_lm` and :func:`takes_position_ids` say how the
per-example loss reads the model.
"""

from __future__ import annotations

import inspect
import logging
import secrets
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel
from torch import nn
from torch.distributed.fsdp import FSDPModule

from opacus_rc._compat.transformers import loss_shifts_labels
from opacus_rc.accountants import get_noise_multiplier
from opacus_rc.config import RandomizedClippingConfig
from opacus_rc.integrations.logical_batches import UNITS_KEY, seeded_generator
from opacus_rc.integrations.privacy_arguments import BOOKKEEPING
from opacus_rc.integrations.train_data import trainer_schedule
from opacus_rc.privacy_engine import PrivacyEngine
from opacus_rc.units.record import UnitBatchRecord

__all__ = [
    "PrivateRun",
    "causal_lm",
    "make_private_run",
    "run_seeds",
    "takes_position_ids",
    "unwrap",
]

logger = logging.getLogger("opacus_rc.integrations.transformers")

#: The engine's accepted shortfall of epsilon below the target (``epsilon_tolerance``).
_EPSILON_TOLERANCE = 0.01


@dataclass
class PrivateRun:
    """What ``make_private`` returned, and the generators the run draws from.

    Attributes:
        engine: The :class:`~opacus_rc.PrivacyEngine`.
        module: The hooks object (the model itself is not wrapped).
        optimizer: The :class:`~opacus_rc.optimizers.RandomizedClipOptimizer`.
        criterion: The DP loss.
        sample_rate: ``q`` the accountant records.
        planned_steps: Steps the noise was searched for (None with a given noise multiplier).
        noise_generator: The noise generator.
        sketch_generator: The sketch generator if seeded, else None.
        fresh_resumes: The nonces of the fresh resumes of this run's lineage, oldest first
            (:func:`~opacus_rc.integrations.privacy_state.restore_privacy_state`); empty for a
            run that was never resumed, or only resumed with ``resume_exact=True``.
    """

    engine: PrivacyEngine
    module: Any
    optimizer: Any
    criterion: Any
    sample_rate: float
    planned_steps: int | None
    noise_generator: torch.Generator
    sketch_generator: torch.Generator | None
    fresh_resumes: list[int] = field(default_factory=list)


def run_seeds(seed: int | None, *, world_size: int) -> tuple[int, int]:
    """The seeds of the run's Poisson sampler and noise generator.

    From ``PrivacyArguments.seed`` (two independent streams of a ``numpy`` ``SeedSequence``)
    if given, else from the operating system. Under DDP every rank takes rank 0's (a
    collective: every rank calls it): every rank draws the same Poisson mask and splits it by
    shard, and only rank 0 adds noise, so a checkpoint's noise state is its.

    Args:
        seed: ``PrivacyArguments.seed``, or None.
        world_size: The number of processes.

    Returns:
        ``(sampler_seed, noise_seed)``.
    """
    if seed is not None:
        sampler_seed = int(
            np.random.SeedSequence(seed, spawn_key=(0,)).generate_state(1, np.uint64)[0]
        )
        noise_seed = int(
            np.random.SeedSequence(seed, spawn_key=(1,)).generate_state(1, np.uint64)[0]
        )
    else:
        sampler_seed = secrets.randbits(63)
        noise_seed = secrets.randbits(63)
    if world_size > 1:
        # One Poisson batch of the whole dataset per step, split by shard: every rank draws
        # the same mask, from rank 0's seed (each rank drew its own above). The noise seed
        # is rank 0's too (only rank 0 adds noise), so a checkpoint's noise state is its.
        seeds = [sampler_seed, noise_seed]
        dist.broadcast_object_list(seeds, src=0)
        sampler_seed, noise_seed = (int(x) for x in seeds)
    return sampler_seed, noise_seed


def _sketch_generator(sketch_seed: int | None, *, rank: int, world_size: int) -> Any:
    """The seeded sketch generator (each rank its own probes), or None for a secret sketch."""
    if sketch_seed is None:
        return None
    seed = int(sketch_seed)
    if world_size > 1:  # each rank its own probes, as the DDP path's sketches
        seed = int(np.random.SeedSequence(seed, spawn_key=(rank,)).generate_state(1, np.uint64)[0])
    return torch.Generator().manual_seed(seed)


def make_private_run(trainer: Any, optimizer: torch.optim.Optimizer) -> PrivateRun:
    """Make ``trainer``'s model and ``optimizer`` private (see the module docstring).

    Reads the trainer's ``privacy_args``, ``args``, ``state.max_steps``, ``model``, its Poisson
    sampler, number of records, seeds, rank and world size; changes nothing of the trainer
    (the caller keeps the result).

    Args:
        trainer: The DP trainer, after ``get_train_dataloader()``.
        optimizer: The Trainer's optimizer over the model's parameters.

    Returns:
        The private run.

    Raises:
        RuntimeError: The Poisson loader was not built first; the engine's schedule or sketch
            differs from the trainer's (an internal error).
        ValueError: A run of no optimizer step with ``target_epsilon``; the engine's errors.
    """
    pa = trainer.privacy_args
    if trainer._poisson_sampler is None:
        raise RuntimeError("get_train_dataloader() must run before the optimizer is created")
    sampler = trainer._poisson_sampler
    world_size = trainer._world_size
    model = trainer.model
    model.train()
    engine = PrivacyEngine(accountant="rc")
    sketch_generator = _sketch_generator(pa.sketch_seed, rank=trainer._rank, world_size=world_size)
    noise_generator = seeded_generator(trainer._noise_seed, device=trainer.args.device)
    schedule = trainer_schedule(
        trainer._num_records,
        expected_batch_size=pa.expected_batch_size,
        dataset_size=pa.dataset_size,
        world_size=world_size,
    )
    planned = None
    if pa.target_epsilon is not None:
        planned = int(trainer.state.max_steps)
        if planned < 1:
            raise ValueError(f"the run has {planned} optimizer steps; nothing to train")
        spec = RandomizedClippingConfig(  # validates; max_grad_norm does not enter the spec
            max_grad_norm=1.0,
            sketch=pa.sketch,
            sketch_dim=pa.sketch_dim,
            sketch_head_dim=pa.sketch_head_dim,
            sketch_generator=sketch_generator,
        ).sketch_spec
        noise_multiplier = get_noise_multiplier(
            target_epsilon=pa.target_epsilon,
            target_delta=pa.target_delta,
            # The rate the accountant records: Opacus' 1 / len(loader), where len is
            # int(1 / q), one step short of 1 / q for some q (q = 1/93: 92 steps, 1/92
            # recorded). Searched at the sampling rate q, the run would pass the target.
            sample_rate=schedule.sizes.accounted_rate,
            steps=planned,
            sketch_spec=spec,
            accountant=engine.accountant,
            epsilon_tolerance=_EPSILON_TOLERANCE,
        )
    else:
        spec = None
        noise_multiplier = pa.noise_multiplier
    criterion = nn.CrossEntropyLoss(
        ignore_index=-100, label_smoothing=float(trainer.args.label_smoothing_factor)
    )
    with warnings.catch_warnings():
        # The engine warns about a seeded sketch (accounted as revealed): PrivacyArguments
        # documents it and the user asked for it; everything else is passed on.
        if sketch_generator is not None:
            warnings.filterwarnings("ignore", message="a sketch_generator was passed")
        module, dp_optimizer, dp_criterion, dp_loader = engine.make_private(
            # Several processes: the engine's DDP path (each rank clips its own examples,
            # rank 0 adds the noise, the optimizer all-reduces the noisy clipped sum). The
            # engine takes the path for a data-parallel model; Opacus' DPDDP wrapper (which
            # broadcasts rank 0's parameters and adds no gradient hook) is that model here,
            # for this call only: the hooks go on the model's own modules, and the
            # Trainer keeps the plain model (accelerate wraps it in DDP afterwards, and
            # training_step runs the forward past that wrapper, see there).
            # FSDP2 (the trainer sharded the model, integrations/fsdp.py): the engine's
            # FSDP path, on the sharded model itself.
            module=model
            if world_size == 1 or isinstance(model, FSDPModule)
            else DifferentiallyPrivateDistributedDataParallel(model),
            optimizer=optimizer,
            criterion=criterion,
            # Only its length and batch size matter (the rate); the batches are the trainer's.
            # The records are the examples, or the units with privacy_unit.
            data_loader=schedule.rate_loader,
            dataset_size=pa.dataset_size,  # public: the rate from it, as trainer_schedule
            noise_multiplier=noise_multiplier,
            max_grad_norm=pa.max_grad_norm,
            poisson_sampling=True,
            clipping="randomized",
            noise_generator=noise_generator,
            wrap_model=False,
            sketch=pa.sketch,
            sketch_dim=pa.sketch_dim,
            sketch_head_dim=pa.sketch_head_dim,
            sketch_generator=sketch_generator,
            denoise=pa.denoise,
            denoise_kappa=pa.denoise_kappa,
            bookkeeping=BOOKKEEPING[pa.bookkeeping],
            # The trainer checks its first batch itself (integrations/batch_check.py), with
            # its collator and its per-example loss.
            check_batch_independence=False,
        )
    if sketch_generator is not None:
        warnings.warn(
            f"PrivacyArguments.sketch_seed={pa.sketch_seed}: the sketch is not secret, so "
            "every step is accounted under the 'revealed' threat model (a larger epsilon)",
            UserWarning,
            stacklevel=4,
        )
    mechanism = engine.mechanism
    sample_rate = mechanism.accounted_rate
    # The engine's mechanism and the trainer's schedule come from one function (public_sizes
    # of the same loader); the trainer's sampler was built from that schedule and the engine's
    # loader from the mechanism (one check that they cannot drift apart).
    if mechanism.sizes != schedule.sizes or (dp_loader.sample_rate, len(dp_loader)) != (
        sampler.sample_rate,
        sampler.steps,
    ):
        module.cleanup()
        raise RuntimeError(
            f"internal: the engine's mechanism is {mechanism.sizes} (its loader samples at "
            f"q={dp_loader.sample_rate} with {len(dp_loader)} batches per epoch), the "
            f"trainer's schedule {schedule.sizes} (its sampler at q={sampler.sample_rate} "
            f"with {sampler.steps})"
        )
    if spec is not None and mechanism.sketch_spec != spec:
        module.cleanup()
        raise RuntimeError(
            f"internal: the noise was searched for {spec}, the mechanism has "
            f"{mechanism.sketch_spec}"
        )
    logger.info(
        "DP trainer: q=%.6g (%d logical batches per epoch, expected %d examples), "
        "noise multiplier %.6g, C=%g, %s%s",
        sample_rate,
        sampler.steps,
        dp_optimizer.expected_batch_size,
        dp_optimizer.noise_multiplier,
        pa.max_grad_norm,
        module.sketch_spec,
        "" if planned is None else f", searched for {planned} steps",
    )
    # The engine was given the rate loader (per-example batches), but with privacy_unit the
    # records are units: each micro-batch's units are recorded by logical_batch_step and the
    # criterion's units= is checked against them (units/record.py).
    module.unit_batch_record = UnitBatchRecord(
        per_unit=pa.privacy_unit is not None,
        where=f'units=inputs["{UNITS_KEY}"]: an override of compute_private_loss must pass '
        f'the micro-batch\'s inputs["{UNITS_KEY}"] to the criterion as units=',
    )
    return PrivateRun(
        engine=engine,
        module=module,
        optimizer=dp_optimizer,
        criterion=dp_criterion,
        sample_rate=sample_rate,
        planned_steps=planned,
        noise_generator=noise_generator,
        sketch_generator=sketch_generator,
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under an accelerate or peft wrapper."""
    inner = getattr(model, "module", model)
    get_base = getattr(inner, "get_base_model", None)
    return get_base() if callable(get_base) else inner


def causal_lm(trainer: Any) -> bool:
    """Whether targets are the next tokens: the Trainer's own test (the model's loss type
    routes to ``ForCausalLMLoss``), or a causal-LM class that computes its loss itself
    (GPT-2 has no ``loss_type``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if loss_shifts_labels(trainer):
        return True
    inner = unwrap(trainer.model)
    if getattr(getattr(inner, "config", None), "is_encoder_decoder", False):
        return False
    return type(inner).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def takes_position_ids(model: nn.Module) -> bool:
    """Whether the (unwrapped) model's ``forward`` takes ``position_ids``."""
    try:
        params = inspect.signature(unwrap(model).forward).parameters
    except (TypeError, ValueError):
        return False
    return "position_ids" in params
