"""DP fine-tuning with randomized clipping through ``transformers.Trainer``.

:class:`DPTrainer` is a ``transformers.Trainer`` whose model and optimizer are made private by
:class:`opacus_rc.PrivacyEngine` (``clipping="randomized"``) when training starts, and
:class:`PrivacyArguments` holds the privacy options (a dataclass that
``transformers.HfArgumentParser`` parses beside ``TrainingArguments``). What the Trainer does
differently:

* **Batches.** Each optimizer step is one *logical* batch, Poisson-sampled: every training
  example is in it independently with probability ``q = 1 / ceil(N / expected_batch_size)``
  (Opacus' rate for a loader of batch size ``expected_batch_size``; ``expected_batch_size / N``
  when it divides ``N``), from a generator of the trainer's own, and ``ceil(N /
  expected_batch_size)`` such batches make an epoch. A logical batch is split into physical
  micro-batches of at most ``per_device_train_batch_size`` examples (the memory limit), each
  collated by the Trainer's data collator; their clipped per-sample gradients are summed
  (Opacus' virtual steps: ``signal_skip_step``) and the sum is noised, the optimizer steps and
  the accountant counts one step, once per logical batch. An empty Poisson batch is a
  noise-only step (noised and accounted, no forward pass). ``gradient_accumulation_steps > 1``
  is refused: the logical batch is ``expected_batch_size``.
* **Loss.** The training loss is computed per example (:meth:`DPTrainerMixin.compute_private_loss`):
  for a causal LM, the next-token cross-entropy of the model's logits (labels shifted by one,
  positions labelled ``-100`` left out), averaged over each example's own labelled positions,
  so padding changes nothing; for a sequence classifier, one cross-entropy per example. The
  Trainer's ``label_smoothing_factor`` is honoured. Each example is one privacy unit: a row of
  the batch must be one record (padding-free or packing collators, which put several records in
  one row, are refused where they can be seen).
* **Privacy unit.** With ``PrivacyArguments.privacy_unit`` (a column naming each row's
  document or user) the records are the units: the ``U`` units are Poisson-sampled at ``q = 1 /
  ceil(U / expected_batch_size)`` (``expected_batch_size`` counts units), a sampled unit brings
  all of its rows (at most ``max_sequences_per_unit``, its first), micro-batches hold whole
  units, the criterion gets ``units=`` and clips each unit's summed gradient once
  (docs/privacy/units.md). Under several processes each sampled unit is trained on rank
  ``u % N`` (a unit is never split between ranks). A unit larger than
  ``per_device_train_batch_size`` is refused.
* **Privacy budget.** With ``target_epsilon`` the noise multiplier is searched (with
  :func:`opacus_rc.accountants.get_noise_multiplier`, the engine's own search) for the
  Trainer's number of optimizer steps (``max_steps``, or ``num_train_epochs`` epochs), so that
  epsilon after the run is at most the target and within 0.01 of it; a step beyond that
  schedule is refused. Epsilon (RC accountant, at ``target_delta``) is added to every
  ``log`` call (``log_history``, the progress bar, TensorBoard / W&B) and to the metrics that
  ``train()`` returns.
* **Checkpoints.** Every checkpoint also holds ``privacy_state.pt``: the accountant's history,
  the sampler's seed, the noise generator's state (and the sketch generator's, if seeded).
  ``train(resume_from_checkpoint=...)`` restores them, so the resumed run draws the same
  batches and noise as an uninterrupted one and its epsilon equals it exactly (the sketch,
  unless seeded, is fresh). Keep checkpoints as private as the training data: the sampler seed
  reveals which examples were in which batch, and the noise state the noise. The saved model is
  the plain model (the hooks are attached without a wrapper): ``from_pretrained`` loads it.
* **Refused, with what to do:** ``gradient_accumulation_steps > 1``, a training sampler of the
  Trainer's (``train_sampling_strategy`` other than ``"random"``, ``group_by_length``, an
  overridden ``_get_train_sampler``), ``fp16`` or any loss scaler (``bf16`` works: autocast
  needs no loss scaler), ``compute_loss_func``, ``model_init`` (hyperparameter search spends
  privacy), ``auto_find_batch_size``, ``torch_compile``, Liger kernels, LOMO optimizers,
  DeepSpeed, FSDP and tensor parallelism through the Trainer, ``torch.nn.DataParallel``
  (several devices in one process), ``denoise`` with several processes, iterable datasets.
* **Several processes** (``torchrun --nproc-per-node N script.py``, or ``accelerate launch``
  with a multi-CPU / multi-GPU config) run as the engine's DDP path (docs/distributed.md):
  every rank draws the same Poisson mask over the whole dataset (rank 0's seed) and trains on
  its shard of it (examples ``i`` with ``i % N == rank``), so the ranks' shares partition the
  logical batch one process would draw with that seed; each rank clips its own examples, in as
  many micro-batches as its share needs (an empty share is a noise-only share), the clipped
  sums are all-reduced once per logical batch, rank 0 adds the noise once, and the sum is
  divided by the expected global batch size. Every rank's accountant counts the same steps at
  the global rate, so epsilon is the single-process run's, and the weights stay identical on
  every rank. The model the Trainer wraps in ``DistributedDataParallel`` is run past that
  wrapper (its reducer would all-reduce unclipped gradients). Checkpoints are written by rank 0
  and hold every rank's sketch-generator state (a seeded sketch); resume with the same number
  of processes.
* **Not applied:** the Trainer's ``max_grad_norm`` (its clipping of the summed gradient; the
  per-example bound is ``PrivacyArguments.max_grad_norm``; a warning says so unless it is 0)
  and its ``grad_norm`` log entry (the norm of the gradient before noise is not private).

What the guarantee covers: the trained weights (and everything computed from them). The
training *loss* in the logs is computed from the private examples without noise and is not
covered; do not publish it, or log only evaluation on public data.

Example::

    from transformers import HfArgumentParser, TrainingArguments
    from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments

    parser = HfArgumentParser((TrainingArguments, PrivacyArguments))
    args, privacy = parser.parse_args_into_dataclasses()
    trainer = DPTrainer(model=model, args=args, train_dataset=train, data_collator=collator,
                        privacy_args=privacy)
    trainer.train()
    print(trainer.get_epsilon())
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import secrets
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import transformers
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from opacus_rc._compat.transformers import (
    TrainerSeams,
    collator_with_removed_columns,
    loss_shifts_labels,
    output_dir,
    prepare_inputs,
    remove_unused_columns,
    train_batch_size,
)
from opacus_rc.accountants import AccountingError, get_noise_multiplier
from opacus_rc.config import RandomizedClippingConfig
from opacus_rc.integrations.logical_batches import (
    UNITS_KEY,
    IndexDataset,
    LogicalBatch,
    LogicalBatchCollator,
    LogicalBatchLoader,
    PoissonLogicalBatchSampler,
    UnitLogicalBatchCollator,
    UnitLogicalBatchSampler,
    UnitRows,
    seeded_generator,
)
from opacus_rc.integrations.per_sample_loss import per_sample_cross_entropy
from opacus_rc.integrations.privacy_arguments import BOOKKEEPING, PrivacyArguments
from opacus_rc.integrations.refusals import check_train_dataset, refuse_unsupported
from opacus_rc.privacy_engine import PrivacyEngine
from opacus_rc.unit_data_loader import select_unit_members

__all__ = [
    "PRIVACY_STATE_NAME",
    "DPTrainer",
    "DPTrainerMixin",
    "LogicalBatch",
    "LogicalBatchCollator",
    "PoissonLogicalBatchSampler",
    "PrivacyArguments",
    "per_sample_cross_entropy",
]

logger = logging.getLogger(__name__)

#: File of a checkpoint folder that holds the privacy state (see :class:`DPTrainerMixin`).
PRIVACY_STATE_NAME = "privacy_state.pt"
#: Version of the privacy-state format written by this module.
_STATE_VERSION = 1
#: The engine's accepted shortfall of epsilon below the target (``epsilon_tolerance``).
_EPSILON_TOLERANCE = 0.01


# ----------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------


@dataclass
class _Private:
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
    """

    engine: PrivacyEngine
    module: Any
    optimizer: Any
    criterion: Any
    sample_rate: float
    planned_steps: int | None
    noise_generator: torch.Generator
    sketch_generator: torch.Generator | None


class DPTrainerMixin(TrainerSeams):
    """The behaviour of :class:`DPTrainer`, for any ``transformers.Trainer`` subclass.

    Put it first in the bases (``class MyTrainer(DPTrainerMixin, SomeTrainer)``); see the module
    docstring for what changes. After ``train()``: :attr:`privacy_engine`,
    :attr:`dp_optimizer` (its ``noise_multiplier``), :attr:`dp_module` (the hooks;
    ``per_sample_gradient_norms`` of the last micro-batch) and :meth:`get_epsilon`.

    Args:
        *args: The trainer's positional arguments.
        privacy_args: The :class:`PrivacyArguments`.
        **kwargs: The trainer's keyword arguments.

    Raises:
        ValueError: A refused configuration (module docstring), with what to do.
        NotImplementedError: DeepSpeed, FSDP or tensor parallelism through the Trainer,
            ``torch.nn.DataParallel``, or a multi-process launch other than DDP.
        TypeError: ``privacy_args`` is not a :class:`PrivacyArguments`.
    """

    def __init__(self, *args: Any, privacy_args: PrivacyArguments, **kwargs: Any) -> None:
        if not isinstance(privacy_args, PrivacyArguments):
            raise TypeError(
                f"privacy_args must be a PrivacyArguments, got {type(privacy_args).__name__}"
            )
        self.privacy_args = privacy_args
        self._private: _Private | None = None
        self._poisson_sampler: PoissonLogicalBatchSampler | None = None
        self._sampler_seed: int | None = None
        self._noise_seed: int | None = None
        self._epsilon_cache: tuple[int, float] | None = None
        self._dp_trained = False
        self._warned_no_epsilon = False
        self._rank, self._world_size = 0, 1
        self._num_records: int | None = None
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()
        if privacy_args.seed is not None:
            warnings.warn(
                f"PrivacyArguments.seed={privacy_args.seed}: the Poisson batches and the noise are "
                "reproducible from this seed, so the privacy guarantee holds only while the seed "
                "stays secret; leave seed=None for generators seeded from the operating system",
                UserWarning,
                stacklevel=2,
            )
            self._sampler_seed = int(
                np.random.SeedSequence(privacy_args.seed, spawn_key=(0,)).generate_state(
                    1, np.uint64
                )[0]
            )
            self._noise_seed = int(
                np.random.SeedSequence(privacy_args.seed, spawn_key=(1,)).generate_state(
                    1, np.uint64
                )[0]
            )
        else:
            self._sampler_seed = secrets.randbits(63)
            self._noise_seed = secrets.randbits(63)
        if self._world_size > 1:
            # One Poisson batch of the whole dataset per step, split by shard: every rank draws
            # the same mask, from rank 0's seed (each rank drew its own above). The noise seed
            # is rank 0's too (only rank 0 adds noise), so a checkpoint's noise state is its.
            seeds = [self._sampler_seed, self._noise_seed]
            dist.broadcast_object_list(seeds, src=0)
            self._sampler_seed, self._noise_seed = (int(x) for x in seeds)
        max_grad_norm = getattr(self.args, "max_grad_norm", None)
        if max_grad_norm:
            warnings.warn(
                f"TrainingArguments.max_grad_norm={max_grad_norm} (the Trainer's clipping of the "
                "summed gradient) is not applied by a DP trainer: each example's gradient is "
                f"clipped at PrivacyArguments.max_grad_norm={privacy_args.max_grad_norm} and the "
                "sum is noised instead. Set TrainingArguments.max_grad_norm=0 to silence this",
                UserWarning,
                stacklevel=2,
            )
        if getattr(self.args, "dataloader_drop_last", False):
            warnings.warn(
                "dataloader_drop_last=True has no effect on Poisson-sampled batches (there is no "
                "last partial batch); every sampled example is used",
                UserWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------------------------------
    # Public read-outs
    # ------------------------------------------------------------------------------------------

    @property
    def privacy_engine(self) -> PrivacyEngine:
        """The engine (its accountant), once training has started."""
        return self._require_private().engine

    @property
    def dp_optimizer(self) -> Any:
        """The :class:`~opacus_rc.optimizers.RandomizedClipOptimizer` (``noise_multiplier``)."""
        return self._require_private().optimizer

    @property
    def dp_module(self) -> Any:
        """The randomized-clipping hooks attached to the model."""
        return self._require_private().module

    def get_epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far (RC accountant, both adjacency directions, upper bound).

        Args:
            delta: Delta (default ``privacy_args.target_delta``).

        Returns:
            Epsilon; 0 before the first step.
        """
        private = self._require_private()
        delta = self.privacy_args.target_delta if delta is None else delta
        steps = len(private.engine.accountant)
        if steps == 0:
            return 0.0
        if delta == self.privacy_args.target_delta and self._epsilon_cache is not None:
            cached_steps, epsilon = self._epsilon_cache
            if cached_steps == steps:
                return epsilon
        epsilon = float(private.engine.get_epsilon(delta))
        if delta == self.privacy_args.target_delta:
            self._epsilon_cache = (steps, epsilon)
        return epsilon

    def remove_privacy_hooks(self) -> None:
        """Detach the randomized-clipping hooks from the model (no more private training)."""
        if self._private is not None:
            self._private.module.cleanup()

    def _require_private(self) -> _Private:
        if self._private is None:
            raise RuntimeError("the model is made private when training starts; call train() first")
        return self._private

    # ------------------------------------------------------------------------------------------
    # Refusals
    # ------------------------------------------------------------------------------------------

    def _refuse_unsupported(self) -> None:
        """Refuse every configuration that would break the guarantee (:mod:`.refusals`); sets
        the rank and world size (DDP) the run trains with."""
        self._rank, self._world_size = refuse_unsupported(self, mixin=DPTrainerMixin)

    @staticmethod
    def _check_train_dataset(dataset: Any) -> None:
        check_train_dataset(dataset)

    # ------------------------------------------------------------------------------------------
    # Data
    # ------------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        """The loader of Poisson logical batches (:class:`LogicalBatch`, one per step).

        Raises:
            ValueError: No training dataset, an iterable or empty one, or ``target_delta``
                not below ``1 / N``.
        """
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        self._check_train_dataset(self.train_dataset)
        dataset, collator = self._train_dataset_and_collator()
        if self.privacy_args.privacy_unit is not None:
            return self._unit_train_dataloader(dataset, collator)
        n = len(dataset)
        self._num_records = n
        self._check_delta(n, "training examples")
        rate_loader = self._rate_loader(n)
        if self._poisson_sampler is None:
            self._poisson_sampler = PoissonLogicalBatchSampler(
                num_samples=n,
                sample_rate=rate_loader.sample_rate,
                steps=len(rate_loader),
                seed=self._sampler_seed,
                rank=self._rank,
                world_size=self._world_size,
            )
        return LogicalBatchLoader(
            dataset,
            batch_sampler=self._poisson_sampler,
            collate_fn=LogicalBatchCollator(
                collate_fn=collator, max_physical_batch_size=train_batch_size(self)
            ),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers,
            prefetch_factor=self.args.dataloader_prefetch_factor,
        )

    def _check_delta(self, n: int, what: str) -> None:
        if self.privacy_args.target_delta >= 1 / n:
            raise ValueError(
                f"target_delta={self.privacy_args.target_delta} is not below 1 / N = {1 / n:.3g} "
                f"(N = {n} {what}): such a delta allows releasing a record; choose "
                "target_delta well below 1 / N"
            )

    def _unit_train_dataloader(self, dataset: Dataset, collator: Any) -> DataLoader:
        """The Poisson loader of *units* (``PrivacyArguments.privacy_unit``): every unit is in
        a logical batch independently with probability ``q = 1 / ceil(U / expected_batch_size)``
        (the per-example rule with the ``U`` units as the records), with all of its selected
        rows, in micro-batches of whole units.

        Raises:
            ValueError: The unit column is missing, or a unit has more selected rows than
                ``per_device_train_batch_size`` (it could not be clipped in one micro-batch).
        """
        pa = self.privacy_args
        column = pa.privacy_unit
        ids = self._unit_column(column)
        # Hashable values to 0..U-1 in order of first appearance (the "first" selection below
        # depends only on each unit's own rows, in dataset order).
        index_of: dict[Any, int] = {}
        unit_of = [index_of.setdefault(v, len(index_of)) for v in ids]
        _, members = select_unit_members(unit_of, max_sequences_per_unit=pa.max_sequences_per_unit)
        num_units = len(members)
        self._num_records = num_units
        self._check_delta(num_units, f"units of {column!r}")
        physical = train_batch_size(self)
        too_big = [len(m) for m in members if len(m) > physical]
        if too_big:
            raise ValueError(
                f"{len(too_big)} of the {num_units} units of {column!r} have more rows than "
                f"per_device_train_batch_size={physical} (the largest has {max(too_big)}): a "
                "unit's rows are clipped together, in one micro-batch. Raise "
                f"per_device_train_batch_size to at least {max(too_big)}, or set "
                f"PrivacyArguments.max_sequences_per_unit <= {physical}"
            )
        rate_loader = self._rate_loader(num_units)
        if self._poisson_sampler is None:
            self._poisson_sampler = UnitLogicalBatchSampler(
                members=members,
                sample_rate=rate_loader.sample_rate,
                steps=len(rate_loader),
                seed=self._sampler_seed,
                rank=self._rank,  # DDP: each sampled unit on rank u % world_size
                world_size=self._world_size,
            )
        return LogicalBatchLoader(
            UnitRows(dataset, unit_of, column),
            batch_sampler=self._poisson_sampler,
            collate_fn=UnitLogicalBatchCollator(
                collate_fn=collator, max_physical_batch_size=physical
            ),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers,
            prefetch_factor=self.args.dataloader_prefetch_factor,
        )

    def _unit_column(self, column: str) -> list[Any]:
        """The values of the unit column of the (unfiltered) training dataset."""
        dataset = self.train_dataset
        names = getattr(dataset, "column_names", None)
        if names is not None:
            if column not in names:
                raise ValueError(
                    f"PrivacyArguments.privacy_unit={column!r} is not a column of the training "
                    f"dataset (columns: {names})"
                )
            return list(dataset[column])
        values = []
        for i in range(len(dataset)):
            row = dataset[i]
            if not isinstance(row, Mapping) or column not in row:
                raise ValueError(
                    f"PrivacyArguments.privacy_unit={column!r}: row {i} of the training dataset "
                    "has no such key; every row must name its unit"
                )
            values.append(row[column])
        return values

    def _train_dataset_and_collator(self) -> tuple[Dataset, Any]:
        """The training dataset and collator, with unused columns removed as the Trainer does."""
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets
        except ImportError:  # pragma: no cover - datasets is a transformers dependency
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = remove_unused_columns(self, dataset, description="Training")
        else:
            collator = collator_with_removed_columns(self, collator, description="Training")
        return dataset, collator

    def _rate_loader(self, n: int) -> Any:
        """Opacus' Poisson loader for a plain loader of batch size ``expected_batch_size`` over
        ``n`` records (examples, or units): its ``sample_rate`` and length are the engine's
        (what the accountant records)."""
        from opacus.data_loader import DPDataLoader

        return DPDataLoader.from_data_loader(
            DataLoader(IndexDataset(n), batch_size=self.privacy_args.expected_batch_size)
        )

    # ------------------------------------------------------------------------------------------
    # Making the model and optimizer private
    # ------------------------------------------------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> Any:
        """The Trainer's optimizer, made private with the model (once per run).

        Raises:
            RuntimeError: If the Poisson loader was not built first (``train()`` builds it).
        """
        optimizer = super().create_optimizer(model)
        if self._private is None:
            self._make_private(optimizer)
        return self.optimizer

    def _make_private(self, optimizer: torch.optim.Optimizer) -> None:
        pa = self.privacy_args
        if self._poisson_sampler is None:
            raise RuntimeError("get_train_dataloader() must run before the optimizer is created")
        sampler = self._poisson_sampler
        model = self.model
        model.train()
        engine = PrivacyEngine(accountant="rc")
        sketch_generator = None
        if pa.sketch_seed is not None:
            sketch_seed = int(pa.sketch_seed)
            if self._world_size > 1:  # each rank its own probes, as the DDP path's sketches
                sketch_seed = int(
                    np.random.SeedSequence(sketch_seed, spawn_key=(self._rank,)).generate_state(
                        1, np.uint64
                    )[0]
                )
            sketch_generator = torch.Generator().manual_seed(sketch_seed)
        noise_generator = seeded_generator(self._noise_seed, device=self.args.device)
        planned = None
        if pa.target_epsilon is not None:
            planned = int(self.state.max_steps)
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
                sample_rate=1 / sampler.steps,
                steps=planned,
                sketch_spec=spec,
                accountant=engine.accountant,
                epsilon_tolerance=_EPSILON_TOLERANCE,
            )
        else:
            spec = None
            noise_multiplier = pa.noise_multiplier
        criterion = nn.CrossEntropyLoss(
            ignore_index=-100, label_smoothing=float(self.args.label_smoothing_factor)
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
                module=model
                if self._world_size == 1
                else DifferentiallyPrivateDistributedDataParallel(model),
                optimizer=optimizer,
                criterion=criterion,
                # Only its length and batch size matter (the rate); the batches are the trainer's.
                # The records are the examples, or the units with privacy_unit.
                data_loader=DataLoader(
                    IndexDataset(self._num_records), batch_size=pa.expected_batch_size
                ),
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
            )
        if sketch_generator is not None:
            warnings.warn(
                f"PrivacyArguments.sketch_seed={pa.sketch_seed}: the sketch is not secret, so "
                "every step is accounted under the 'revealed' threat model (a larger epsilon)",
                UserWarning,
                stacklevel=3,
            )
        sample_rate = 1 / len(dp_loader)
        # The accountant's rate and the loader's batches per epoch are the engine's; the trainer's
        # sampler was built from the same rule (one check that they cannot drift apart).
        if (dp_loader.sample_rate, len(dp_loader)) != (sampler.sample_rate, sampler.steps):
            module.cleanup()
            raise RuntimeError(
                f"internal: the engine samples at q={dp_loader.sample_rate} with "
                f"{len(dp_loader)} batches per epoch, the trainer at q={sampler.sample_rate} "
                f"with {sampler.steps}"
            )
        if spec is not None and module.sketch_spec != spec:
            module.cleanup()
            raise RuntimeError(
                f"internal: the noise was searched for {spec}, the module uses {module.sketch_spec}"
            )
        self.optimizer = dp_optimizer
        self._private = _Private(
            engine=engine,
            module=module,
            optimizer=dp_optimizer,
            criterion=dp_criterion,
            sample_rate=sample_rate,
            planned_steps=planned,
            noise_generator=noise_generator,
            sketch_generator=sketch_generator,
        )
        self._shift_labels = self._causal_lm()
        self._positions = self._takes_position_ids(model)
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

    def _causal_lm(self) -> bool:
        """Whether targets are the next tokens: the Trainer's own test (the model's loss type
        routes to ``ForCausalLMLoss``), or a causal-LM class that computes its loss itself
        (GPT-2 has no ``loss_type``)."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if loss_shifts_labels(self):
            return True
        inner = _unwrap(self.model)
        if getattr(getattr(inner, "config", None), "is_encoder_decoder", False):
            return False
        return type(inner).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()

    @staticmethod
    def _takes_position_ids(model: nn.Module) -> bool:
        try:
            params = inspect.signature(_unwrap(model).forward).parameters
        except (TypeError, ValueError):
            return False
        return "position_ids" in params

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, once per trainer.

        Raises:
            RuntimeError: If this trainer has already trained: its noise was chosen for one
                run and its accountant holds that run; build a new trainer (to continue, from
                a checkpoint: ``train(resume_from_checkpoint=...)``).
        """
        if self._dp_trained:
            raise RuntimeError(
                "this DP trainer has already trained: its noise multiplier was chosen for one "
                "run and its accountant holds it. Build a new trainer, and pass "
                "resume_from_checkpoint=... to continue from a checkpoint"
            )
        self._dp_trained = True
        return super().train(*args, **kwargs)

    def training_step(
        self,
        model: nn.Module,
        inputs: Any,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """One logical batch: the private backward of each micro-batch, accumulated.

        The clipped per-example gradients of all micro-batches are summed (every micro-batch
        but the last is a skipped Opacus step, ``signal_skip_step(True)``: accumulated, not
        noised, not accounted); the Trainer's ``optimizer.step()`` then noises the sum, steps
        and accounts one step. An empty Poisson batch runs nothing and makes that step a
        noise-only step.

        Under DDP (several processes) each rank runs its own share of the logical batch, in as
        many micro-batches as it needs, and the forward goes to the model inside accelerate's
        ``DistributedDataParallel`` wrapper: DDP's reducer would all-reduce every micro-batch's
        unclipped first-pass gradients (and its forward broadcasts buffers), collectives that
        ranks with different numbers of micro-batches would not reach alike. The only
        collectives of a step are the DP optimizer's, one per logical batch on every rank: the
        agreement that every rank's backward succeeded (issued by the last micro-batch's
        backward, or here for a rank whose share is empty), then in ``optimizer.step()`` the
        step check and the all-reduce of the clipped sums, noised once on rank 0.

        Args:
            model: The model (prepared by the accelerator).
            inputs: A :class:`LogicalBatch`.
            num_items_in_batch: Unused (the loss is a mean per example).

        Returns:
            The mean per-example loss of the logical batch (detached; NaN for an empty batch
            when ``logging_nan_inf_filter`` is on, so that the Trainer's log skips it, else 0).

        Raises:
            TypeError: If ``inputs`` is not a :class:`LogicalBatch`.
            RuntimeError: A step beyond the schedule the noise was searched for.
        """
        private = self._require_private()
        if not isinstance(inputs, LogicalBatch):
            raise TypeError(
                f"a DP trainer's training batches come from its Poisson loader (LogicalBatch), "
                f"got {type(inputs).__name__}; do not override get_train_dataloader"
            )
        if (
            private.planned_steps is not None
            and len(private.engine.accountant) >= private.planned_steps
        ):
            raise RuntimeError(
                f"the noise multiplier was chosen so that {private.planned_steps} steps reach "
                f"epsilon={self.privacy_args.target_epsilon}; another step would pass it"
            )
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        optimizer = private.optimizer
        if isinstance(model, DistributedDataParallel):
            model = model.module  # see the docstring: DDP's reducer is not used
        # Ends the last logical step (its noisy sum): the Trainer only zeroes the model's grads.
        optimizer.zero_grad()
        if inputs.num_examples == 0:
            # No record is in the batch: the step is the noise alone, noised and accounted by
            # the Trainer's optimizer.step() (RandomizedClipOptimizer.noise_only_step, split).
            private.module.step_state.mark_empty_batch()
            optimizer.discard_gradients()
            # Under DDP: this rank's part of the agreement the other ranks' last backward
            # issues (in one process, no collective).
            if not optimizer.all_ranks_ok(True):
                raise RuntimeError(
                    "the randomized-clipping backward failed on another rank; no rank takes "
                    "this step"
                )
            fill = math.nan if self.args.logging_nan_inf_filter else 0.0
            return torch.tensor(fill, device=self.args.device)
        total = torch.zeros((), device=self.args.device, dtype=torch.float64)
        records = 0  # examples, or units with privacy_unit
        last = len(inputs.micro_batches) - 1
        context = (
            getattr(self, "maybe_activation_offload_context", None) or contextlib.nullcontext()
        )
        with context:
            for i, micro in enumerate(inputs.micro_batches):
                micro = prepare_inputs(self, micro)
                with self.compute_loss_context_manager():
                    loss = self.compute_private_loss(model, micro)
                if i < last:
                    # Said before the backward, so that under DDP only the last micro-batch's
                    # backward issues the ranks' agreement (the ranks' counts differ).
                    optimizer.signal_skip_step(do_skip=True)
                loss.backward()
                total += loss.loss_per_sample.detach().to(total.device, torch.float64).sum()
                records += loss.loss_per_sample.numel()
                if i < last:
                    optimizer.step()  # accumulates the clipped sum only
                    optimizer.zero_grad()
        return (total / max(records, 1)).float().detach()

    def compute_private_loss(self, model: nn.Module, inputs: dict[str, Any]) -> Any:
        """The DP loss of one micro-batch: per-example losses ``(B,)`` through the criterion.

        Override to train on another loss: return ``self.dp_criterion_call(...)``-style output,
        i.e. what the engine's criterion returns (``self._private.criterion(..., shape=)``).

        Args:
            model: The model.
            inputs: One collated micro-batch with ``labels``.

        Returns:
            The DP loss (see :func:`per_sample_cross_entropy`).

        Raises:
            ValueError: No ``labels`` in the batch.
        """
        inputs = dict(inputs)
        units = inputs.pop(UNITS_KEY, None)  # (B,) units 0..U-1, with privacy_unit
        labels = inputs.pop("labels", None)
        shift_labels = inputs.pop("shift_labels", None)
        if labels is None:
            raise ValueError(
                "a DP trainer computes each example's loss from the batch's 'labels' (-100 where "
                "ignored); the data collator returned none (for a causal LM use a collator that "
                "copies input_ids to labels, e.g. DataCollatorForLanguageModeling(mlm=False))"
            )
        if self._positions and "position_ids" not in inputs and "input_ids" in inputs:
            # Batch-broadcast position ids ([1, T], the model's default) would give a trainable
            # position embedding one norm for the whole batch (Opacus issue 841); the expanded
            # ids are the same values, one row per example.
            b, t = inputs["input_ids"].shape[:2]
            positions = torch.arange(t, device=inputs["input_ids"].device)
            inputs["position_ids"] = positions.unsqueeze(0).expand(b, -1)
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        return per_sample_cross_entropy(
            self._private.criterion,
            logits,
            labels,
            shift=self._shift_labels,
            shift_labels=shift_labels,
            units=units,
        )

    # The Trainer's clipping of the summed gradient is replaced by per-example clipping, and the
    # norm of the gradient before noise is not private: neither is computed or logged.
    def clip_grad_norm_seam(self, model: nn.Module) -> None:
        return None

    def get_grad_norm_seam(self, model: nn.Module, grad_norm: Any = None) -> None:
        return None

    def num_items_in_batch_seam(self, batch_samples: list, device: torch.device) -> None:
        return None  # the private loss is a mean per example; no token count is needed

    def floating_point_ops(self, inputs: Any) -> int:
        if not isinstance(inputs, LogicalBatch):
            return super().floating_point_ops(inputs)
        flops = 0
        for micro in inputs.micro_batches:
            flops += super().floating_point_ops(micro)
        return flops

    def track_num_input_tokens_seam(self, inputs: Any) -> None:
        if isinstance(inputs, LogicalBatch):
            for micro in inputs.micro_batches:
                super().track_num_input_tokens_seam(micro)
            return
        super().track_num_input_tokens_seam(inputs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's ``log``, with ``epsilon`` (at ``target_delta``) added once training
        has started (in place, so the metrics ``train()`` returns hold it too)."""
        if self._private is not None:
            try:
                logs["epsilon"] = self.get_epsilon()
            except AccountingError as err:
                # No finite epsilon is certified (e.g. a noise multiplier below the analysis'
                # range): inf is what the run can claim. Said once, then logged as inf.
                if not self._warned_no_epsilon:
                    self._warned_no_epsilon = True
                    warnings.warn(
                        f"epsilon cannot be computed for this run ({err}); it is logged as inf",
                        UserWarning,
                        stacklevel=2,
                    )
                logs["epsilon"] = math.inf
        super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------

    def save_checkpoint_seam(self, model: nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint, plus :data:`PRIVACY_STATE_NAME` (see the module docstring)."""
        super().save_checkpoint_seam(model, trial)
        if self._private is None:
            return
        state = self._privacy_state()  # under DDP a collective: every rank calls it
        if not self.args.should_save:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(
            output_dir(self, trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        os.makedirs(folder, exist_ok=True)
        torch.save(state, os.path.join(folder, PRIVACY_STATE_NAME))

    def _privacy_state(self) -> dict[str, Any]:
        """The privacy state; under DDP the sketch generators' states of every rank are
        gathered (each rank draws its own probes), so every rank must call it."""
        private = self._require_private()
        sketch_states = None
        if private.sketch_generator is not None:
            sketch_states = [private.sketch_generator.get_state()]
            if self._world_size > 1:
                sketch_states = [None] * self._world_size
                dist.all_gather_object(sketch_states, private.sketch_generator.get_state())
        return {
            "version": _STATE_VERSION,
            "accountant": private.engine.accountant.state_dict(),
            "noise_multiplier": float(private.optimizer.noise_multiplier),
            "sample_rate": float(private.sample_rate),
            "expected_batch_size": int(private.optimizer.expected_batch_size),
            "max_grad_norm": float(private.optimizer.max_grad_norm),
            "sketch_spec": repr(private.module.sketch_spec),
            "planned_steps": private.planned_steps,
            "world_size": self._world_size,
            "sampler_seed": int(self._poisson_sampler.seed),
            # Under DDP only rank 0 draws noise; this is its generator (rank 0 saves).
            "noise_generator": private.noise_generator.get_state(),
            "sketch_generator": None if sketch_states is None else sketch_states[0],
            "sketch_generators_by_rank": sketch_states,
        }

    def load_optimizer_and_scheduler_seam(self, checkpoint: str | None) -> None:
        """The Trainer's optimizer and scheduler states, then the privacy state.

        Raises:
            FileNotFoundError: The checkpoint has no privacy state (resuming would restart
                epsilon from zero).
            ValueError: The checkpoint was trained with other privacy settings.
        """
        super().load_optimizer_and_scheduler_seam(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, PRIVACY_STATE_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} does not exist: the checkpoint holds no privacy state (accountant "
                "history, sampler and noise generators), so resuming would report epsilon from "
                "zero. Resume only from checkpoints written by a DP trainer"
            )
        state = torch.load(path, weights_only=False)
        self._restore_privacy_state(state)

    def _restore_privacy_state(self, state: dict[str, Any]) -> None:
        private = self._require_private()
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unknown privacy-state version {state.get('version')!r}")
        mine = {
            "noise_multiplier": float(private.optimizer.noise_multiplier),
            "sample_rate": float(private.sample_rate),
            "expected_batch_size": int(private.optimizer.expected_batch_size),
            "max_grad_norm": float(private.optimizer.max_grad_norm),
            "sketch_spec": repr(private.module.sketch_spec),
            "planned_steps": private.planned_steps,
            "world_size": self._world_size,
        }
        # A checkpoint written before DDP support has no world size: one process.
        differ = {k: (state.get(k, 1), v) for k, v in mine.items() if state.get(k, 1) != v}
        if differ:
            details = ", ".join(
                f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in differ.items()
            )
            raise ValueError(
                "the checkpoint was trained with other privacy settings than this run "
                f"({details}); resume with the same PrivacyArguments, dataset size, "
                "num_train_epochs / max_steps and number of processes"
            )
        private.engine.accountant.load_state_dict(state["accountant"])
        self._epsilon_cache = None
        self._poisson_sampler.seed = int(state["sampler_seed"])
        self._sampler_seed = int(state["sampler_seed"])
        private.noise_generator.set_state(state["noise_generator"])
        by_rank = state.get("sketch_generators_by_rank") or [state["sketch_generator"]]
        if private.sketch_generator is not None and by_rank[self._rank] is not None:
            private.sketch_generator.set_state(by_rank[self._rank])


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under an accelerate or peft wrapper."""
    inner = getattr(model, "module", model)
    get_base = getattr(inner, "get_base_model", None)
    return get_base() if callable(get_base) else inner


class DPTrainer(DPTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with DP-SGD-RC: see the module docstring.

    Args:
        *args: ``transformers.Trainer``'s arguments (``model``, ``args``, ``data_collator``,
            ``train_dataset``, ``eval_dataset``, ``processing_class``, ``callbacks``,
            ``optimizers``, ...).
        privacy_args: The :class:`PrivacyArguments` (keyword only).
        **kwargs: As ``*args``.

    Raises:
        ValueError, NotImplementedError, TypeError: As :class:`DPTrainerMixin`.
    """
