"""Integrations of randomized clipping with training frameworks.

* :mod:`opacus_rc.integrations.transformers`:
  :class:`~opacus_rc.integrations.transformers.DPTrainer` (a ``transformers.Trainer``) and
  :class:`~opacus_rc.integrations.transformers.PrivacyArguments` (parsed by
  ``transformers.HfArgumentParser``).
  Its parts, by concept: :mod:`~opacus_rc.integrations.privacy_arguments` (the options),
  :mod:`~opacus_rc.integrations.refusals` (what is refused, and why),
  :mod:`~opacus_rc.integrations.train_data` (the training data, its Poisson schedule and
  loader), :mod:`~opacus_rc.integrations.logical_batches` (Poisson logical batches and their
  micro-batches), :mod:`~opacus_rc.integrations.packed_batches` (packed logical batches, clipped
  per record), :mod:`~opacus_rc.integrations.private_run` (the run's one ``make_private``
  call and its seeds), :mod:`~opacus_rc.integrations.logical_batch_step` (one logical batch's
  private backward), :mod:`~opacus_rc.integrations.per_sample_loss` (the per-example loss) and
  :mod:`~opacus_rc.integrations.privacy_state` (the privacy state of a checkpoint) and
  :mod:`~opacus_rc.integrations.fsdp` (FSDP2 through the trainer: its sharding, lockstep
  micro-batches and checkpoints); the
  trainer module holds the trainer's methods and re-exports the public names.
* :mod:`opacus_rc.integrations.trl`: :class:`~opacus_rc.integrations.trl.DPSFTTrainer` (a
  ``trl.SFTTrainer``), importable where TRL is installed.

Nothing is imported here: each submodule imports its framework (``transformers``, ``trl``) only
when it is itself imported, so ``import opacus_rc`` never needs either.
"""

__all__: list[str] = []
