"""Hugging Face ``transformers.Trainer`` internals the DP trainer relies on (see
:mod:`opacus_rc._compat` for the rule).

Checked against transformers 5.24 (and TRL 1.16's ``SFTTrainer``, which inherits them); the
contract tests are in ``tests/compat/test_transformers_contract.py``: they check that every
private method named here exists with the arguments used and is still called by the
``Trainer`` (an override the ``Trainer`` stopped calling would be skipped silently).

Imported by :mod:`opacus_rc.integrations` only (``transformers`` is optional).
"""

from __future__ import annotations

from typing import Any

import transformers

__all__ = [
    "TRAINER_SEAMS",
    "TrainerSeams",
    "accelerator_state_initialised",
    "collator_with_removed_columns",
    "enable_fsdp2_on_cpu",
    "loss_shifts_labels",
    "output_dir",
    "overrides_train_sampler",
    "prepare_inputs",
    "remove_unused_columns",
    "save_model_state",
    "train_batch_size",
]

#: ``Trainer`` private method -> the public seam :class:`TrainerSeams` forwards it to.
TRAINER_SEAMS: dict[str, str] = {
    "_clip_grad_norm": "clip_grad_norm_seam",
    "_get_grad_norm": "get_grad_norm_seam",
    "_get_num_items_in_batch": "num_items_in_batch_seam",
    "_track_num_input_tokens": "track_num_input_tokens_seam",
    "_save_checkpoint": "save_checkpoint_seam",
    "_load_optimizer_and_scheduler": "load_optimizer_and_scheduler_seam",
}


class TrainerSeams:
    """A mixin that exposes the ``Trainer``'s private training-loop hooks as public seams.

    It must come before the ``Trainer`` class in the bases (``DPTrainerMixin`` derives from it).
    Each private hook of :data:`TRAINER_SEAMS` is forwarded to its public seam, whose default
    is the ``Trainer``'s own method; a subclass overrides the seam. Relies on
    ``Trainer._clip_grad_norm(model)``, ``_get_grad_norm(model, grad_norm=None)``,
    ``_get_num_items_in_batch(batch_samples, device)``, ``_track_num_input_tokens(inputs)``,
    ``_save_checkpoint(model, trial)`` and ``_load_optimizer_and_scheduler(checkpoint)`` being
    called by the training loop. Test:
    ``test_transformers_contract.py::test_trainer_calls_each_seam``.
    """

    def _clip_grad_norm(self, model: Any) -> Any:
        return self.clip_grad_norm_seam(model)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        return self.get_grad_norm_seam(model, grad_norm=grad_norm)

    def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
        return self.num_items_in_batch_seam(batch_samples, device)

    def _track_num_input_tokens(self, inputs: Any) -> None:
        self.track_num_input_tokens_seam(inputs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self.save_checkpoint_seam(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        self.load_optimizer_and_scheduler_seam(checkpoint)

    def clip_grad_norm_seam(self, model: Any) -> Any:
        """The ``Trainer``'s clipping of the summed gradient (returns its norm)."""
        return super()._clip_grad_norm(model)  # type: ignore[misc]

    def get_grad_norm_seam(self, model: Any, grad_norm: Any = None) -> Any:
        """The ``Trainer``'s gradient norm for logging."""
        return super()._get_grad_norm(model, grad_norm=grad_norm)  # type: ignore[misc]

    def num_items_in_batch_seam(self, batch_samples: list, device: Any) -> Any:
        """The ``Trainer``'s count of target tokens in a batch (for loss scaling)."""
        return super()._get_num_items_in_batch(batch_samples, device)  # type: ignore[misc]

    def track_num_input_tokens_seam(self, inputs: Any) -> None:
        """The ``Trainer``'s count of input tokens seen (``include_num_input_tokens_seen``)."""
        super()._track_num_input_tokens(inputs)  # type: ignore[misc]

    def save_checkpoint_seam(self, model: Any, trial: Any) -> None:
        """The ``Trainer``'s checkpoint of model, optimizer, scheduler and state."""
        super()._save_checkpoint(model, trial)  # type: ignore[misc]

    def load_optimizer_and_scheduler_seam(self, checkpoint: str | None) -> None:
        """The ``Trainer``'s resume of optimizer and scheduler states."""
        super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]


def overrides_train_sampler(trainer_type: type) -> bool:
    """Whether ``trainer_type`` replaces the ``Trainer``'s train sampler.

    Relies on ``transformers.Trainer._get_train_sampler``. Tests:
    ``test_transformers_contract.py::test_trainer_helpers``,
    ``test_transformers_contract.py::test_trainer_private_methods``.
    """
    return trainer_type._get_train_sampler is not transformers.Trainer._get_train_sampler


def train_batch_size(trainer: Any) -> int:
    """The per-device batch size the ``Trainer`` builds its loader with (which
    ``auto_find_batch_size`` may lower).

    Relies on ``Trainer._train_batch_size``, set in ``__init__``. Tests:
    ``test_transformers_contract.py::test_trainer_helpers``,
    ``test_transformers_contract.py::test_trainer_sets_private_attributes``.
    """
    return trainer._train_batch_size


def remove_unused_columns(trainer: Any, dataset: Any, *, description: str) -> Any:
    """``dataset`` without the columns the model's ``forward`` does not take.

    Relies on ``Trainer._remove_unused_columns(dataset, description)``. Tests:
    ``test_transformers_contract.py::test_trainer_helpers``,
    ``test_transformers_contract.py::test_trainer_private_methods``.
    """
    return trainer._remove_unused_columns(dataset, description=description)


def collator_with_removed_columns(trainer: Any, collator: Any, *, description: str) -> Any:
    """``collator`` wrapped to drop the columns the model's ``forward`` does not take.

    Relies on ``Trainer._get_collator_with_removed_columns(data_collator, description)``.
    Tests: ``test_transformers_contract.py::test_trainer_helpers``,
    ``test_transformers_contract.py::test_trainer_private_methods``.
    """
    return trainer._get_collator_with_removed_columns(collator, description=description)


def prepare_inputs(trainer: Any, inputs: Any) -> Any:
    """``inputs`` moved to the device and prepared as the ``Trainer`` does before a forward.

    Relies on ``Trainer._prepare_inputs(inputs)``. Tests:
    ``test_transformers_contract.py::test_trainer_helpers``,
    ``test_transformers_contract.py::test_trainer_private_methods``.
    """
    return trainer._prepare_inputs(inputs)


def output_dir(trainer: Any, trial: Any) -> str:
    """The folder checkpoints of this run (or hyper-parameter trial) go into.

    Relies on ``Trainer._get_output_dir(trial=trial)``. Tests:
    ``test_transformers_contract.py::test_trainer_helpers``,
    ``test_transformers_contract.py::test_trainer_private_methods``.
    """
    return trainer._get_output_dir(trial=trial)


def loss_shifts_labels(trainer: Any) -> bool:
    """Whether the ``Trainer`` found the model's loss to be the causal-LM loss that shifts
    the labels; ``False`` if unknown.

    Relies on ``Trainer._loss_shifts_labels``, set in ``__init__``. Tests:
    ``test_transformers_contract.py::test_trainer_helpers``,
    ``test_transformers_contract.py::test_trainer_sets_private_attributes``.
    """
    return bool(getattr(trainer, "_loss_shifts_labels", False))


def save_model_state(trainer: Any, output_dir: str, state_dict: dict[str, Any]) -> None:
    """Write ``state_dict`` as the model ``from_pretrained`` reads (the ``Trainer``'s writer:
    ``save_pretrained`` with the state dict given, the processing class beside it).

    Relies on ``Trainer._save(output_dir, state_dict=...)``. Tests:
    ``test_transformers_contract.py::test_trainer_private_methods``.
    """
    trainer._save(output_dir, state_dict=state_dict)


def accelerator_state_initialised() -> bool:
    """Whether accelerate's process-wide ``AcceleratorState`` exists already (configured before
    this trainer's accelerator and kept, ``use_configured_state``: a new accelerator shares its
    distributed type and plugins; ``TrainingArguments`` resets it otherwise).

    Relies on ``accelerate.state.AcceleratorState._shared_state`` (empty until the first
    ``Accelerator``). Tests: ``test_transformers_contract.py::test_accelerate_fsdp2_on_cpu``.
    """
    from accelerate.state import AcceleratorState

    return bool(AcceleratorState._shared_state)


def enable_fsdp2_on_cpu(trainer: Any) -> bool:
    """Give a CPU (gloo) launch with ``TrainingArguments.fsdp`` accelerate's FSDP2 path.

    Accelerate enables FSDP only for accelerator devices (its ``AcceleratorState`` sets
    ``DistributedType.FSDP`` and the plugin for ``MULTI_GPU`` and the like, not ``MULTI_CPU``);
    on CPU the ``Trainer`` would drop ``fsdp`` and wrap the model in DDP. FSDP2 itself runs on
    CPU with gloo, so for a multi-CPU launch whose ``TrainingArguments`` ask for FSDP2 and whose
    accelerator made a fresh state (``TrainingArguments`` resets accelerate's state unless
    ``accelerator_config={"use_configured_state": True}``), this sets the state's
    distributed type to ``FSDP`` and its plugin to the one the ``Trainer`` builds from the
    arguments, and the trainer's ``is_fsdp_enabled``: the same path (accelerate's FSDP2
    preparation, checkpoint functions and state-dict gathering) as on GPUs.

    Relies on ``AcceleratorState.distributed_type`` and ``.fsdp_plugin`` and
    ``PartialState.distributed_type`` being writable attributes of the shared states (accelerate
    sets both distributed types to ``FSDP`` itself on GPUs) and on
    ``TrainingArguments.fsdp_plugin_args``. Tests:
    ``test_transformers_contract.py::test_accelerate_fsdp2_on_cpu``; the 2-process runs of
    ``tests/integrations/test_dp_trainer_fsdp.py``.

    Args:
        trainer: The trainer, right after ``create_accelerator_and_postprocess``.

    Returns:
        Whether the state was changed.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin_args = getattr(trainer.args, "fsdp_plugin_args", None)
    state = trainer.accelerator.state
    if (
        plugin_args is None
        or int(plugin_args.get("fsdp_version", 1)) != 2
        or state.distributed_type != DistributedType.MULTI_CPU
        or getattr(state, "fsdp_plugin", None) is not None
    ):
        return False
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**plugin_args)
    state.distributed_type = DistributedType.FSDP
    # As accelerate does at the end of its state's set-up (every later AcceleratorState()
    # copies the process state's distributed type).
    PartialState().distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True
    return True
