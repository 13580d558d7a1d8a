"""DP supervised fine-tuning with randomized clipping through TRL's ``SFTTrainer``.

:class:`DPSFTTrainer` is ``trl.SFTTrainer`` with the behaviour of
:class:`~opacus_rc.integrations.transformers.DPTrainer` (Poisson logical batches split into
micro-batches, one noisy accounted step per logical batch, the noise searched for the run,
epsilon in the logs, the privacy state in checkpoints, the same refusals): see
:mod:`opacus_rc.integrations.transformers`. What SFT adds:

* the dataset preparation is TRL's (formatting, chat templates, tokenization, ``labels`` with
  ``-100`` outside the completion or assistant turns when ``completion_only_loss`` or
  ``assistant_only_loss`` ask for it, truncation to ``max_length``); each prepared example is
  one privacy unit, and its loss is the mean over its labelled tokens;
* the training loss is computed from the model's full logits, not TRL's fused LM head: the
  fused head multiplies by ``lm_head.weight`` outside the head's module, where no per-example
  norm hook sees it (evaluation keeps TRL's fused head);
* refused, with what to do: ``packing=True`` (a packed row holds several examples, and the
  packing of each row depends on the others, so one example's removal changes other rows) and
  ``padding_free=True`` (one row for the whole batch), ``loss_type="dft"``.

TRL's own ``SFTConfig`` defaults to ``bf16=True`` (autocast, no loss scaler: accepted) and
``gradient_checkpointing=True`` (supported). Importing this module needs ``trl``
(``pip install trl``, in this project's ``tutorials`` extra).
"""

from __future__ import annotations

from typing import Any

try:
    import trl
except ImportError as err:  # pragma: no cover - depends on the install
    raise ImportError(
        "opacus_rc.integrations.trl needs TRL: pip install 'trl>=1.0' (or install opacus_rc "
        "with its 'tutorials' extra). Without TRL, use "
        "opacus_rc.integrations.transformers.DPTrainer"
    ) from err

from opacus_rc.integrations.transformers import DPTrainerMixin, PrivacyArguments

__all__ = ["DPSFTTrainer", "PrivacyArguments"]


def _refuse_sft_options(args: Any) -> None:
    """Refuse the SFT options that put several examples in one row or change the loss.

    Raises:
        ValueError: ``packing``, ``padding_free`` or ``loss_type="dft"``.
    """
    if args is None:
        return
    if getattr(args, "packing", False):
        raise ValueError(
            "packing=True puts several examples in one row, and which examples share a row "
            "depends on the whole dataset: the privacy unit would be a packed row, and one "
            "example's removal would change other rows. Set packing=False (each example is one "
            "padded row; per_device_train_batch_size bounds the memory)"
        )
    if getattr(args, "padding_free", False):
        raise ValueError(
            "padding_free=True concatenates the batch into one row, so no per-example gradient "
            "exists to clip. Set padding_free=False"
        )
    if getattr(args, "loss_type", "nll") != "nll":
        raise ValueError(
            f"loss_type={args.loss_type!r}: a DP SFT trainer trains on each example's mean "
            "next-token negative log-likelihood; set loss_type='nll'"
        )


class DPSFTTrainer(DPTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` with DP-SGD-RC: see the module docstring.

    Args:
        *args: ``trl.SFTTrainer``'s arguments (``model``, ``args`` (an ``SFTConfig``),
            ``data_collator``, ``train_dataset``, ``eval_dataset``, ``processing_class``,
            ``peft_config``, ...).
        privacy_args: The :class:`~opacus_rc.integrations.transformers.PrivacyArguments`
            (keyword only).
        **kwargs: As ``*args``.

    Raises:
        ValueError: ``packing``, ``padding_free``, ``loss_type="dft"``, and everything
            :class:`~opacus_rc.integrations.transformers.DPTrainerMixin` refuses.
        NotImplementedError, TypeError: As
            :class:`~opacus_rc.integrations.transformers.DPTrainerMixin`.
    """

    #: TRL's ``compute_loss`` (its mean next-token loss, used by ``evaluate()``) is the loss
    #: ``compute_private_loss`` computes per example: a user subclass's own is refused.
    library_compute_losses = (*DPTrainerMixin.library_compute_losses, trl.SFTTrainer.compute_loss)

    def __init__(self, *args: Any, privacy_args: PrivacyArguments, **kwargs: Any) -> None:
        # Refused before TRL prepares (and packs) the dataset.
        _refuse_sft_options(kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, privacy_args=privacy_args, **kwargs)
        _refuse_sft_options(self.args)
