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
* ``packing=True`` and ``padding_free=True`` pack each Poisson logical batch's *sampled*
  records into rows of ``max_length`` tokens (a block-diagonal 4D mask, or no mask with
  restarting ``position_ids``), clipped per record (docs/packing.md#packing-trainer). TRL's
  own packing would pack the whole dataset before sampling (``trl.pack_dataset``), so that
  which records share a row depends on every other record: TRL is given a copy of the config
  with ``packing=False``, ``padding_free=False`` and ``eval_packing=False`` (it prepares one
  record per row), and the trainer packs with an
  :class:`~opacus_rc.packing.PackingCollator` after sampling; ``self.args.packing`` reads
  False, :attr:`DPSFTTrainer.dp_packing_mode` says which mode trains. The sampling rate, the
  divisor and epsilon are those of the records, as without packing. Evaluation is padded;
* refused, with what to do: ``loss_type="dft"``; ``packing`` or ``padding_free`` with a
  custom ``data_collator``; ``packing=True`` without ``max_length``.

TRL's own ``SFTConfig`` defaults to ``bf16=True`` (autocast, no loss scaler: accepted) and
``gradient_checkpointing=True`` (supported). Importing this module needs ``trl``
(``pip install trl``, in this project's ``tutorials`` extra).
"""

from __future__ import annotations

import copy as _copy
from typing import Any

try:
    import trl
except ImportError as err:  # pragma: no cover - depends on the install
    raise ImportError(
        "opacus_rc.integrations.trl needs TRL: pip install 'trl>=1.0' (or install opacus_rc "
        "with its 'tutorials' extra). Without TRL, use "
        "opacus_rc.integrations.transformers.DPTrainer"
    ) from err

from opacus_rc.integrations.packed_batches import packing_mask_dtype
from opacus_rc.integrations.transformers import DPTrainerMixin, PrivacyArguments
from opacus_rc.packed_attention import uses_packed_sdpa
from opacus_rc.packing import PackingCollator

__all__ = ["DPSFTTrainer", "PrivacyArguments"]


def _refuse_sft_options(args: Any) -> None:
    """Refuse the SFT options that change the loss.

    Raises:
        ValueError: ``loss_type="dft"``.
    """
    if args is None:
        return
    if getattr(args, "loss_type", "nll") != "nll":
        raise ValueError(
            f"loss_type={args.loss_type!r}: a DP SFT trainer trains on each example's mean "
            "next-token negative log-likelihood; set loss_type='nll'"
        )


def _packing_mode(args: Any) -> str | None:
    """``"packing"``, ``"padding_free"`` or None, from an ``SFTConfig``."""
    if args is None:
        return None
    if getattr(args, "padding_free", False):
        return "padding_free"
    if getattr(args, "packing", False):
        return "packing"
    return None


def _unpacked_args(args: Any, mode: str | None, data_collator: Any) -> Any:
    """A copy of ``args`` with which TRL prepares the dataset record by record (no packing of
    the dataset, no padding-free collator): the trainer packs each logical batch instead.

    Raises:
        ValueError: A custom ``data_collator`` with packing or padding-free (the trainer's
            packing collator replaces it), or ``packing=True`` without ``max_length``.
    """
    if mode is None:
        return args
    if data_collator is not None:
        raise ValueError(
            f"{mode}=True with a custom data_collator: a DP SFT trainer packs each Poisson "
            "batch's records itself (opacus_rc.packing.PackingCollator), after sampling. Leave "
            f"data_collator=None, or set {mode}=False and pass a padding collator"
        )
    if mode == "packing" and getattr(args, "max_length", None) is None:
        raise ValueError("packing=True needs max_length (the length of a packed row)")
    copy = _copy.copy(args)
    copy.packing = False
    copy.padding_free = False
    copy.eval_packing = False  # evaluation: TRL's padded batches, one example a row
    if getattr(args, "packing_strategy", "bfd") != "bfd" and mode == "packing":
        # "bfd_split" / "wrapped" cut an overlong example instead of truncating it: keep the
        # whole record; the packing collator cuts it across rows and clips it once.
        copy.max_length = None
    return copy


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
        ValueError: ``loss_type="dft"``; ``packing`` or ``padding_free`` with a custom
            ``data_collator``, ``packing`` without ``max_length``; and everything
            :class:`~opacus_rc.integrations.transformers.DPTrainerMixin` refuses.
        NotImplementedError, TypeError: As
            :class:`~opacus_rc.integrations.transformers.DPTrainerMixin`.
    """

    #: TRL's ``compute_loss`` (its mean next-token loss, used by ``evaluate()``) is the loss
    #: ``compute_private_loss`` computes per example: a user subclass's own is refused.
    library_compute_losses = (*DPTrainerMixin.library_compute_losses, trl.SFTTrainer.compute_loss)

    def __init__(self, *args: Any, privacy_args: PrivacyArguments, **kwargs: Any) -> None:
        args = list(args)
        config = kwargs.get("args", args[1] if len(args) > 1 else None)
        # Refused before TRL prepares the dataset.
        _refuse_sft_options(config)
        mode = _packing_mode(config)
        collator = kwargs.get("data_collator", args[2] if len(args) > 2 else None)
        unpacked = _unpacked_args(config, mode, collator)
        if "args" in kwargs:
            kwargs["args"] = unpacked
        elif len(args) > 1:
            args[1] = unpacked
        super().__init__(*args, privacy_args=privacy_args, **kwargs)
        _refuse_sft_options(self.args)
        #: ``"packing"``, ``"padding_free"`` or None: how each logical batch is collated.
        self.dp_packing_mode = mode
        if mode is not None:
            self._dp_packing = self._sft_packing_collator(config, mode)

    def _sft_packing_collator(self, config: Any, mode: str) -> PackingCollator:
        """The packing collator of the training batches: rows of ``max_length`` tokens (the
        longest prepared record when padding-free without ``max_length``), TRL's pad id."""
        pad = getattr(self.data_collator, "pad_token_id", None)
        if pad is None:
            tok = getattr(self.processing_class, "tokenizer", self.processing_class)
            pad = tok.pad_token_id
        length = getattr(config, "max_length", None)
        if length is None:
            length = max(len(ids) for ids in self.train_dataset["input_ids"])
        return PackingCollator(
            max_length=int(length),
            pad_token_id=int(pad),
            # The varlen attention finds the records from the position ids: no 4D mask.
            padding_free=mode == "padding_free" or uses_packed_sdpa(self.model),
            mask_dtype=packing_mask_dtype(self.model),
        )
