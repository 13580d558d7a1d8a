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
  positions labelled ``-100`` left out, and no token predicted from a padding position),
  averaged over each example's own labelled positions, with each row's position ids from its
  attention mask (:func:`opacus_rc.position_ids_from_attention_mask`), so that an example's
  loss is its loss alone on either padding side; for a sequence classifier, one cross-entropy
  per example. The
  Trainer's ``label_smoothing_factor`` is honoured. Each example is one privacy unit: a row of
  the batch must be one record (padding-free or packing collators, which put several records in
  one row, are refused where they can be seen), except with
  :class:`~opacus_rc.packing.PackingCollator` as ``data_collator``: each logical batch's
  sampled records are then packed into rows after sampling and clipped per record
  (:mod:`~opacus_rc.integrations.packed_batches`, docs/packing.md#packing-trainer).
* **Batch independence.** Before anything is noised or accounted, micro-batches are checked
  until one of two or more examples and one with padding have been: every row of a checked
  micro-batch is its example's own, and up to three examples' outputs and losses alone equal
  theirs in the batch
  (:mod:`~opacus_rc.integrations.batch_check`; ``PrivacyArguments.check_batch_independence``
  turns it off): a collator that mixes rows, NEFTune or a batch statistic is refused with a
  :class:`~opacus_rc.batch_independence.BatchIndependenceError`.
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
  ``train(resume_from_checkpoint=...)`` restores the accountant, so the resumed run's epsilon
  equals the uninterrupted run's exactly, and by default draws *fresh* Poisson masks and noise
  (reseeded from the checkpoint's seed and a new OS nonce): no mask already trained and
  accounted is trained again, ``ignore_data_skip=True`` included, and two continuations of one
  checkpoint are independent releases. ``PrivacyArguments.resume_exact=True`` restores the
  generators instead (a resume equal to the uninterrupted run bit for bit; unsafe when two
  continuations of one checkpoint are published; refused with ``ignore_data_skip=True``).
  Keep checkpoints as private as the training data: the sampler seed reveals which examples
  were in which batch, and the noise state the noise. The saved model is the plain model (the
  hooks are attached without a wrapper): ``from_pretrained`` loads it.
* **Refused, with what to do:** ``gradient_accumulation_steps > 1``, a training sampler of the
  Trainer's (``train_sampling_strategy`` other than ``"random"``, ``group_by_length``, an
  overridden ``_get_train_sampler``), ``fp16`` or any loss scaler (``bf16`` works: autocast
  needs no loss scaler), ``compute_loss_func``, a ``compute_loss`` override that training would
  not use (override :meth:`~DPTrainerMixin.compute_private_loss`, the per-example loss training
  calls; ``compute_loss``, which ``evaluate()`` calls, is accepted beside it),
  ``include_num_input_tokens_seen`` (see *Logs*), ``model_init`` (hyperparameter search spends
  privacy), ``auto_find_batch_size``, ``torch_compile``, Liger kernels, LOMO optimizers,
  DeepSpeed (its engine reduces and partitions the gradients before per-example clipping could
  see them), FSDP version 1 and the FSDP2 options :mod:`~opacus_rc.integrations.fsdp` lists,
  tensor parallelism through the Trainer, ``torch.nn.DataParallel`` (several devices in one
  process), ``denoise`` with several processes, iterable datasets.
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
* **FSDP2** (``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2})`` under the same
  launch, or ``accelerate launch`` with an FSDP2 config): as under DDP (the same Poisson shares,
  one noisy step and one accounted step per logical batch on every rank, epsilon the
  single-process run's), on a model the trainer shards itself before making it private
  (accelerate's auto-wrap policy: each decoder layer, then the root, which keeps a tied
  embedding / LM head) and the engine's FSDP2 optimizer (each rank noises its shard with the
  global draw). Every rank runs as many micro-batches as the rank whose share needs the most
  (zero-gradient fillers), checkpoints hold the sharded (``SHARDED_STATE_DICT``) or full model
  and optimizer beside the privacy state, and ``save_model`` writes the full model
  (:mod:`~opacus_rc.integrations.fsdp`). On CPU (gloo) accelerate has no FSDP; the trainer gives
  the launch accelerate's FSDP2 path.
* **Not applied:** the Trainer's ``max_grad_norm`` (its clipping of the summed gradient; the
  per-example bound is ``PrivacyArguments.max_grad_norm``; a warning says so unless it is 0)
  and its ``grad_norm`` log entry (the norm of the gradient before noise is not private).

* **After training** (also when ``train()`` raises) the privacy hooks are removed
  (:meth:`~DPTrainerMixin.remove_privacy_hooks`): the model is the plain model, so
  ``evaluate()``, ``predict()``, ``save_model()``, ``copy.deepcopy``, plain training and a
  second DP trainer on the same model work, each trainer accounting its own run.
* **Logs.** ``epsilon``, ``step``, ``epoch`` and ``learning_rate`` are public. Every value
  computed from the private batches without noise is renamed with the prefix
  :data:`NON_PRIVATE_LOG_PREFIX` (``non_private/loss``, ``non_private/train_loss``,
  ``non_private/train_runtime`` and the other ``train_*`` metrics, ``non_private/total_flos``;
  ``non_private/num_input_tokens_seen`` with ``PrivacyArguments.log_non_private_token_counts``):
  neighbouring datasets log different values for them beside the same epsilon.

What the guarantee covers: the trained weights (and everything computed from them). The
``non_private/`` values in the logs (and the ``training_loss`` of the ``TrainOutput`` that
``train()`` returns) are not covered; do not publish them, or log only evaluation on public
data.

Example::

    from transformers import HfArgumentParser, TrainingArguments
    from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments

    parser = HfArgumentParser((TrainingArguments, PrivacyArguments))
    args, privacy = parser.parse_args_into_dataclasses()
    trainer = DPTrainer(model=model, args=args, train_dataset=train, data_collator=collator,
                        privacy_args=privacy)
    trainer.train()
    print(trainer.get_epsilon())

This module holds the trainer's methods (the Trainer's hooks it overrides, each short) and this
overview, which is the trainer's user documentation; every step lives in a module of its own
concept (listed in :mod:`opacus_rc.integrations` and docs/architecture.md#architecture-layers),
which is why the module stays near 500 lines rather than under it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from typing import Any

import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader

from opacus_rc._compat.transformers import (
    TrainerSeams,
    accelerator_state_initialised,
    enable_fsdp2_on_cpu,
    output_dir,
    save_model_state,
)
from opacus_rc.accountants import AccountingError
from opacus_rc.integrations.batch_check import BatchCheckState
from opacus_rc.integrations.fsdp import (
    accelerate_wrap_policy,
    filler_micro_batch,
    fsdp2_plugin,
    plain_optimizer,
    refuse_fsdp_version,
    shard_for_randomized_clipping,
)
from opacus_rc.integrations.logical_batch_step import logical_batch_step, micro_batch_loss
from opacus_rc.integrations.logical_batches import (
    LogicalBatch,
    LogicalBatchCollator,
    PoissonLogicalBatchSampler,
)
from opacus_rc.integrations.per_sample_loss import per_sample_cross_entropy
from opacus_rc.integrations.privacy_arguments import PrivacyArguments
from opacus_rc.integrations.privacy_state import (
    PRIVACY_STATE_NAME,
    load_privacy_state,
    privacy_state,
    restore_privacy_state,
)
from opacus_rc.integrations.private_run import (
    PrivateRun,
    causal_lm,
    make_private_run,
    run_seeds,
    takes_position_ids,
)
from opacus_rc.integrations.refusals import (
    check_train_dataset,
    refuse_ignored_compute_loss,
    refuse_unsupported,
)
from opacus_rc.integrations.train_data import (
    example_train_loader,
    train_dataset_and_collator,
    unit_train_loader,
)
from opacus_rc.packing import PackingCollator
from opacus_rc.privacy_engine import PrivacyEngine

__all__ = [
    "NON_PRIVATE_LOG_PREFIX",
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

#: The prefix of every value a DP trainer logs that is computed from the private batches without
#: noise (``non_private/loss``, ``non_private/train_loss``, ``non_private/train_runtime``...):
#: no epsilon covers them. The others (``epsilon``, ``step``, ``epoch``, ``learning_rate``) are
#: public: functions of the schedule and the privacy settings only.
NON_PRIVATE_LOG_PREFIX = "non_private/"

#: The Trainer's log keys computed from the private batches, besides every ``train_*`` key (the
#: final metrics: ``train_loss``, the run time and speeds, the memory tracker's).
_NON_PRIVATE_LOG_KEYS = ("loss", "total_flos", "num_input_tokens_seen")

# ----------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------


class DPTrainerMixin(TrainerSeams):
    """The behaviour of :class:`DPTrainer`, for any ``transformers.Trainer`` subclass.

    Put it first in the bases (``class MyTrainer(DPTrainerMixin, SomeTrainer)``); see the module
    docstring for what changes. After ``train()``: :attr:`privacy_engine`,
    :attr:`dp_optimizer` (its ``noise_multiplier``), :attr:`dp_module` (the hooks, detached from
    the model when ``train()`` ends; ``per_sample_gradient_norms`` of the last micro-batch) and
    :meth:`get_epsilon`.

    Args:
        *args: The trainer's positional arguments.
        privacy_args: The :class:`PrivacyArguments`.
        **kwargs: The trainer's keyword arguments.

    Raises:
        ValueError: A refused configuration (module docstring), with what to do.
        NotImplementedError: DeepSpeed, FSDP version 1 or a refused FSDP2 option
            (:func:`~opacus_rc.integrations.fsdp.refuse_unsupported_fsdp`) or tensor
            parallelism through the Trainer, ``torch.nn.DataParallel``, or a multi-process
            launch other than DDP or FSDP2.
        TypeError: ``privacy_args`` is not a :class:`PrivacyArguments`.
    """

    #: The library trainers' ``compute_loss`` that :meth:`compute_private_loss` computes per
    #: example (a subclass's own ``compute_loss`` is refused unless it also overrides
    #: :meth:`compute_private_loss`: :func:`~.refusals.refuse_ignored_compute_loss`).
    library_compute_losses: tuple[Any, ...] = (transformers.Trainer.compute_loss,)

    def __init__(self, *args: Any, privacy_args: PrivacyArguments, **kwargs: Any) -> None:
        if not isinstance(privacy_args, PrivacyArguments):
            raise TypeError(
                f"privacy_args must be a PrivacyArguments, got {type(privacy_args).__name__}"
            )
        # Before the Trainer (and TRL's dataset preparation) runs: it needs only the class.
        refuse_ignored_compute_loss(type(self), mixin=DPTrainerMixin)
        self.privacy_args = privacy_args
        self._private: PrivateRun | None = None
        self._poisson_sampler: PoissonLogicalBatchSampler | None = None
        self._sampler_seed: int | None = None
        self._noise_seed: int | None = None
        self._epsilon_cache: tuple[int, float] | None = None
        self._dp_trained = False
        self._warned_no_epsilon = False
        self._rank, self._world_size = 0, 1
        self._num_records: int | None = None
        self._hooks_removed = False
        self._non_private_tokens_seen = 0
        self._train_collate: Any = None
        self._batch_independence_checked = False
        self._batch_check_state = BatchCheckState()
        self._fsdp_plugin: Any = None  # accelerate's FSDP2 plugin (integrations/fsdp.py)
        self._fsdp_filler: dict[str, Any] | None = None
        self._fsdp_reshard = True  # the groups' reshard_after_forward (the plugin's)
        self._dp_packing: PackingCollator | None = None
        super().__init__(*args, **kwargs)
        if isinstance(self.data_collator, PackingCollator):
            # Training packs each logical batch's records (packed_batches); evaluation gets the
            # same packed rows without the criterion's keys.
            self._dp_packing = self.data_collator
            self.data_collator = self._dp_packing.evaluation_collator()
        self._refuse_unsupported()
        if privacy_args.seed is not None:
            warnings.warn(
                f"PrivacyArguments.seed={privacy_args.seed}: the Poisson batches and the noise are "
                "reproducible from this seed, so the privacy guarantee holds only while the seed "
                "stays secret; leave seed=None for generators seeded from the operating system",
                UserWarning,
                stacklevel=2,
            )
        self._sampler_seed, self._noise_seed = run_seeds(
            privacy_args.seed, world_size=self._world_size
        )
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
        """The randomized-clipping hooks of the model (detached when ``train()`` has ended;
        ``per_sample_gradient_norms`` of the last micro-batch stays readable)."""
        return self._require_private().module

    @property
    def dp_criterion(self) -> Any:
        """The DP criterion (:class:`~opacus_rc.optimizers.DPLossRandomizedClipping`, wrapping
        ``nn.CrossEntropyLoss(ignore_index=-100)``) that :meth:`compute_private_loss` returns
        the output of."""
        return self._require_private().criterion

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
        """Detach the randomized-clipping hooks and their state from the model.

        ``train()`` calls it when it ends (also when it raises), so that afterwards the model
        is the plain model again: a plain ``loss.backward()`` runs no privacy hook and leaves
        no per-sample state on the parameters, ``copy.deepcopy(model)`` works, and another DP
        trainer (or ``PrivacyEngine.make_private``) can take the same model. The trainer's
        accountant, :meth:`get_epsilon` and the last micro-batch's
        ``dp_module.per_sample_gradient_norms`` stay. Calling it again does nothing.
        """
        if self._private is None or self._hooks_removed:
            return
        self._hooks_removed = True
        self._private.module.cleanup()
        for group in self._private.optimizer.param_groups:
            for p in group["params"]:
                if hasattr(p, "summed_grad"):  # the DP optimizer's clipped sum
                    del p.summed_grad

    def _require_private(self) -> PrivateRun:
        if self._private is None:
            raise RuntimeError("the model is made private when training starts; call train() first")
        return self._private

    # ------------------------------------------------------------------------------------------
    # Refusals
    # ------------------------------------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator; on a multi-CPU (gloo) launch asking for FSDP2 (with a
        fresh accelerate state) with accelerate's FSDP2 path, which accelerate enables on
        accelerator devices only (:func:`~opacus_rc._compat.transformers.enable_fsdp2_on_cpu`):
        CPU runs take the path GPU runs take."""
        refuse_fsdp_version(self.args)  # before accelerate builds a version 1 plugin
        earlier = accelerator_state_initialised()
        super().create_accelerator_and_postprocess()
        if not earlier:
            enable_fsdp2_on_cpu(self)

    def _refuse_unsupported(self) -> None:
        """Refuse every configuration that would break the guarantee (:mod:`.refusals`); sets
        the rank and world size (DDP) the run trains with."""
        self._rank, self._world_size = refuse_unsupported(self, mixin=DPTrainerMixin)
        self._fsdp_plugin = fsdp2_plugin(self)

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
        dataset, collator = train_dataset_and_collator(self)
        self._train_collate = collator  # also collates single examples for the batch check
        if self._fsdp_plugin is not None and self._fsdp_filler is None and len(dataset):
            # What a rank runs when its share needs fewer micro-batches than another's
            # (integrations/fsdp.py): one example, every label -100 (a zero gradient).
            self._fsdp_filler = filler_micro_batch(collator([dataset[0]]))
        if self.privacy_args.privacy_unit is not None:
            return unit_train_loader(self, dataset, collator)
        return example_train_loader(self, dataset, collator)

    # ------------------------------------------------------------------------------------------
    # Making the model and optimizer private
    # ------------------------------------------------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> Any:
        """The Trainer's optimizer, made private with the model (once per run).

        Under FSDP2 the model is first sharded the way randomized clipping needs
        (:func:`~opacus_rc.integrations.fsdp.shard_for_randomized_clipping`, with the plugin's
        auto-wrap policy, ``reshard_after_forward`` and device mesh); accelerate then leaves it
        as it is.

        Raises:
            RuntimeError: If the Poisson loader was not built first (``train()`` builds it).
        """
        if self._fsdp_plugin is not None and self._private is None:
            self._shard_model()
        optimizer = super().create_optimizer(model)
        if self._private is None:
            self._make_private(optimizer)
        return self.optimizer

    def _shard_model(self) -> None:
        """FSDP2: shard ``self.model`` in place (see :meth:`create_optimizer`)."""
        plugin = self._fsdp_plugin
        mesh = getattr(self.accelerator, "torch_device_mesh", None)
        if mesh is not None:
            mesh = mesh[tuple(self.accelerator.parallelism_config.fsdp_dim_names)]
        self._fsdp_reshard = bool(plugin.reshard_after_forward)
        shard_for_randomized_clipping(
            self.model,
            wrap=accelerate_wrap_policy(plugin, self.model),
            reshard_after_forward=self._fsdp_reshard,
            mesh=mesh,
        )

    def _make_private(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the model and ``optimizer`` private
        (:func:`~opacus_rc.integrations.private_run.make_private_run`)."""
        self._private = make_private_run(self, optimizer)
        self.optimizer = self._private.optimizer
        self._shift_labels = causal_lm(self)
        self._positions = takes_position_ids(self.model)
        # Whether each example's loss is the mixin's own (the batch check compares losses then).
        self._default_private_loss = (
            type(self).compute_private_loss is DPTrainerMixin.compute_private_loss
        )

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, once per trainer; the privacy hooks are removed from the model when
        it ends, also when it raises (:meth:`remove_privacy_hooks`): ``evaluate()``,
        ``predict()``, ``save_model()`` and :meth:`get_epsilon` work afterwards on the plain
        model, and so do ``copy.deepcopy(model)``, plain training and another DP trainer on the
        same model.

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
        try:
            return super().train(*args, **kwargs)
        finally:
            self.remove_privacy_hooks()

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
            BatchIndependenceError: At the first non-empty batch (with
                ``PrivacyArguments.check_batch_independence``): an example's row, output or
                loss depends on the other examples of its batch; nothing is noised or
                accounted.
        """
        return logical_batch_step(self, model, inputs)

    def compute_private_loss(self, model: nn.Module, inputs: dict[str, Any]) -> Any:
        """The DP loss of one micro-batch: per-example losses ``(B,)`` through the criterion.

        Override to train on another loss (the Trainer's ``compute_loss`` is not used in
        training, and an override of it alone is refused at construction): return what the DP
        criterion :attr:`dp_criterion` returns for per-example losses, e.g.
        ``per_sample_cross_entropy(self.dp_criterion, logits, labels, shift=True)``.
        ``evaluate()`` and ``predict()`` keep the Trainer's ``compute_loss`` (override it too,
        beside this method, to evaluate with your loss). With ``PrivacyArguments.privacy_unit``,
        ``inputs["dp_privacy_units"]`` holds the ``(B,)`` unit of each row: pass it to the
        criterion as ``units=`` (a call without it, or with another grouping of the rows, is
        refused with a ``ValueError``).

        Args:
            model: The model.
            inputs: One collated micro-batch with ``labels``.

        Returns:
            The DP loss (see :func:`per_sample_cross_entropy`).

        Raises:
            ValueError: No ``labels`` in the batch.
        """
        return micro_batch_loss(
            model,
            inputs,
            criterion=self._private.criterion,
            shift_labels=self._shift_labels,
            expand_positions=self._positions,
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
        """Counts the tokens of a logical batch only with
        ``PrivacyArguments.log_non_private_token_counts`` (the Trainer's own count,
        ``include_num_input_tokens_seen``, is refused): not private, logged labelled."""
        if not self.privacy_args.log_non_private_token_counts:
            return
        if not isinstance(inputs, LogicalBatch):
            raise TypeError(f"expected a LogicalBatch, got {type(inputs).__name__}")
        count = 0
        for micro in inputs.micro_batches:
            mask = micro.get("attention_mask")
            ids = micro.get(getattr(self.model, "main_input_name", "input_ids"))
            if "record_ids" in micro:  # packed rows: the records' tokens
                count += int((micro["record_ids"] >= 0).sum())
            elif mask is not None:
                count += int(mask.sum())
            elif ids is not None:
                count += int(ids.numel())
        if self._world_size > 1:  # every rank calls it once per step, as the Trainer's count
            count = int(
                self.accelerator.gather(torch.tensor([count], device=self.args.device)).sum()
            )
        self._non_private_tokens_seen += count

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's ``log``, with ``epsilon`` (at ``target_delta``) added once training
        has started, and every value computed from the private batches without noise renamed
        with the prefix :data:`NON_PRIVATE_LOG_PREFIX` (``loss``, ``total_flos`` and every
        ``train_*`` key, e.g. ``non_private/train_loss``; with
        ``PrivacyArguments.log_non_private_token_counts``,
        ``non_private/num_input_tokens_seen``). In place, so the metrics ``train()`` returns
        hold the same keys."""
        for key in list(logs):
            if key in _NON_PRIVATE_LOG_KEYS or key.startswith("train_"):
                logs[NON_PRIVATE_LOG_PREFIX + key] = logs.pop(key)
        if self.privacy_args.log_non_private_token_counts:
            logs[NON_PRIVATE_LOG_PREFIX + "num_input_tokens_seen"] = self._non_private_tokens_seen
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
        """The Trainer's checkpoint, plus :data:`PRIVACY_STATE_NAME` (see the module docstring).

        Under FSDP2 the Trainer's sharded (or full) model and optimizer state, written by
        accelerate from the DP optimizer's inner optimizer
        (:func:`~opacus_rc.integrations.fsdp.plain_optimizer`)."""
        with plain_optimizer(self) if self._fsdp_plugin is not None else contextlib.nullcontext():
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

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's ``save_model``; under FSDP2 (called by the user) the full model,
        gathered from the shards (a collective: every rank calls it) and written by rank 0 as
        ``from_pretrained`` reads it, whatever ``fsdp_config["state_dict_type"]`` (with
        ``SHARDED_STATE_DICT`` the Trainer's own ``save_model`` writes nothing). A checkpoint's
        model (``_internal_call``) is the Trainer's: sharded, or full, as configured."""
        if self._fsdp_plugin is None or _internal_call:
            super().save_model(output_dir, _internal_call=_internal_call)
            return
        output_dir = self.args.output_dir if output_dir is None else output_dir
        state_dict = self.accelerator.get_state_dict(self.model)  # full, on rank 0's CPU
        if self.args.should_save:
            save_model_state(self, output_dir, state_dict)

    def _privacy_state(self) -> dict[str, Any]:
        """The privacy state (:func:`~opacus_rc.integrations.privacy_state.privacy_state`;
        under DDP a collective: every rank calls it)."""
        return privacy_state(
            self._require_private(),
            sampler_seed=self._poisson_sampler.seed,
            world_size=self._world_size,
        )

    def load_optimizer_and_scheduler_seam(self, checkpoint: str | None) -> None:
        """The Trainer's optimizer and scheduler states, then the privacy state.

        Raises:
            FileNotFoundError: The checkpoint has no privacy state (resuming would restart
                epsilon from zero).
            ValueError: The checkpoint was trained with other privacy settings, or
                ``PrivacyArguments.resume_exact`` with ``ignore_data_skip`` (it would replay
                accounted masks).
        """
        with plain_optimizer(self) if self._fsdp_plugin is not None else contextlib.nullcontext():
            super().load_optimizer_and_scheduler_seam(checkpoint)
        if checkpoint is None:
            return
        self._restore_privacy_state(load_privacy_state(checkpoint))

    def _restore_privacy_state(self, state: dict[str, Any]) -> None:
        # Fresh masks and noise unless PrivacyArguments.resume_exact (module docstring).
        seed = restore_privacy_state(
            self._require_private(),
            state,
            rank=self._rank,
            world_size=self._world_size,
            exact=self.privacy_args.resume_exact,
            ignore_data_skip=self.args.ignore_data_skip,
        )
        self._epsilon_cache = None
        self._poisson_sampler.seed = seed
        self._sampler_seed = seed


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
