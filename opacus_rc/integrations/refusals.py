"""What a DP trainer refuses, and why: every ``Trainer`` configuration that would break the
guarantee (or that the DP trainer cannot run) raises before anything runs, with what to do."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.utils.data import IterableDataset

from opacus_rc._compat.transformers import overrides_train_sampler
from opacus_rc.integrations.fsdp import refuse_unsupported_fsdp

__all__ = [
    "check_train_dataset",
    "refuse_ignored_compute_loss",
    "refuse_unsupported",
    "refuse_unsupported_parallelism",
]

#: Optimizers that update parameters inside the backward pass, before any noise is added.
IN_BACKWARD_OPTIMIZERS = ("lomo", "adalomo")


def refuse_unsupported(trainer: Any, *, mixin: type) -> tuple[int, int]:
    """Refuse, before anything runs, every configuration that would break the guarantee.

    Args:
        trainer: The DP trainer, after ``Trainer.__init__``.
        mixin: The DP trainer mixin (whose ``get_train_dataloader`` must not be overridden).

    Returns:
        ``(rank, world_size)``: ``(0, 1)`` in one process, else the DDP process group's.

    Raises:
        ValueError: A refused configuration, with what to do.
        NotImplementedError: See :func:`refuse_unsupported_parallelism`.
    """
    args = trainer.args
    if args.gradient_accumulation_steps != 1:
        raise ValueError(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}: a DP trainer "
            "accumulates itself; set gradient_accumulation_steps=1, give the logical "
            "batch as PrivacyArguments.expected_batch_size (Poisson-sampled) and the memory "
            "limit as per_device_train_batch_size (each logical batch is split into "
            "micro-batches of at most that size, with one noisy step per logical batch)"
        )
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy != "random" or getattr(args, "group_by_length", False):
        what = "group_by_length=True" if strategy == "random" else f"{strategy!r}"
        raise ValueError(
            f"train_sampling_strategy={what}: a DP trainer draws its batches by Poisson "
            "sampling (every example independently, at rate q), which the privacy "
            "accounting assumes; grouping by length or any other order would change it. Use "
            "the default train_sampling_strategy='random' (it is replaced by Poisson "
            "sampling)"
        )
    if overrides_train_sampler(type(trainer)):
        raise ValueError(
            f"{type(trainer).__name__} overrides _get_train_sampler: a DP trainer draws its "
            "batches by Poisson sampling, which the privacy accounting assumes, so a "
            "sampler of your own cannot be used. Remove the override"
        )
    if type(trainer).get_train_dataloader is not mixin.get_train_dataloader:
        raise ValueError(
            f"{type(trainer).__name__} overrides get_train_dataloader: the DP trainer's loader "
            "draws the Poisson logical batches that the accounting assumes. Remove the "
            "override (customise the data collator instead)"
        )
    scaler = getattr(trainer.accelerator, "scaler", None)
    if args.fp16 or scaler is not None or trainer.accelerator.mixed_precision == "fp16":
        raise ValueError(
            "fp16 mixed precision uses a loss scaler, which multiplies every per-example "
            "gradient before clipping and skips steps whose noisy gradient overflows: the "
            "clipping bound and the accounted steps would no longer be what was accounted. "
            "Use bf16=True (autocast without a loss scaler) or full precision"
        )
    if trainer.compute_loss_func is not None:
        raise ValueError(
            "compute_loss_func returns one loss for the batch; a DP trainer needs one loss "
            "per example. Subclass the trainer and override compute_private_loss(model, "
            "inputs) to return the criterion's per-example loss"
        )
    if args.include_num_input_tokens_seen not in ("no", False, None):
        raise ValueError(
            f"include_num_input_tokens_seen={args.include_num_input_tokens_seen!r} logs the "
            "number of tokens in the private batches, counted without noise: neighbouring "
            "datasets log different counts beside the same epsilon, and no epsilon covers "
            "them. Leave include_num_input_tokens_seen='no'; to log the count anyway, knowing "
            "that it is not private, set PrivacyArguments.log_non_private_token_counts=True "
            "(it is logged as 'non_private/num_input_tokens_seen')"
        )
    if trainer.model_init is not None:
        raise ValueError(
            "model_init (hyperparameter search) is not supported: every trial would train "
            "on the private data and spend privacy budget that no single run's epsilon "
            "reports. Pass model= and tune on public data"
        )
    if args.auto_find_batch_size:
        raise ValueError(
            "auto_find_batch_size retries training with a smaller batch after an "
            "out-of-memory error, after steps were already taken and accounted; set "
            "per_device_train_batch_size (the physical batch) yourself"
        )
    if getattr(args, "torch_compile", False):
        raise ValueError(
            "torch_compile=True is not supported with per-example clipping hooks; set "
            "torch_compile=False"
        )
    if getattr(args, "use_liger_kernel", False):
        raise ValueError(
            "use_liger_kernel=True replaces the model's layers and loss with fused kernels "
            "that the per-example norm hooks do not see; set use_liger_kernel=False"
        )
    if str(getattr(args.optim, "value", args.optim)).lower() in IN_BACKWARD_OPTIMIZERS:
        raise ValueError(
            f"optim={args.optim!r} updates the weights inside the backward pass, before "
            "clipping and noise; use an optimizer that steps after backward (adamw_torch, sgd)"
        )
    world = refuse_unsupported_parallelism(trainer)
    if trainer.train_dataset is not None:
        check_train_dataset(trainer.train_dataset)
    return world


def refuse_ignored_compute_loss(trainer_type: type, *, mixin: type) -> None:
    """Refuse a ``compute_loss`` of the user's that training would not use.

    A DP trainer trains on :meth:`compute_private_loss` (per-example losses through the DP
    criterion); ``compute_loss`` returns one loss for the batch, from which no per-example loss
    can be recovered, and is used only by ``evaluate()`` and ``predict()``. A ``compute_loss``
    other than the library trainers' (``trainer_type.library_compute_losses``, whose loss
    ``compute_private_loss`` computes per example) would make training and evaluation use
    different losses without a word; it is accepted only beside an override of
    ``compute_private_loss`` (then the user has chosen the training loss, and ``compute_loss``
    is the evaluation's).

    Args:
        trainer_type: The DP trainer's class.
        mixin: The DP trainer mixin (its ``compute_private_loss`` is the default).

    Raises:
        ValueError: ``compute_loss`` overridden and ``compute_private_loss`` not.
    """
    if trainer_type.compute_loss in trainer_type.library_compute_losses:
        return
    if trainer_type.compute_private_loss is not mixin.compute_private_loss:
        return
    owner = next(k for k in trainer_type.__mro__ if "compute_loss" in vars(k))
    raise ValueError(
        f"{owner.__qualname__} overrides compute_loss, which a DP trainer does not train with: "
        "training computes each example's loss in compute_private_loss(model, inputs) (the "
        "DP criterion needs one loss per example to clip each example's gradient; "
        "compute_loss returns one loss for the batch), while evaluate() and predict() call "
        "compute_loss, so training and evaluation would use different losses. Override "
        "compute_private_loss to train on your loss (return the DP criterion's output, e.g. "
        "per_sample_cross_entropy(self.dp_criterion, logits, labels, shift=True)); an "
        "override of compute_loss is accepted beside it, for evaluation"
    )


def refuse_unsupported_parallelism(trainer: Any) -> tuple[int, int]:
    """Accept one process, or data parallelism over processes (DDP or FSDP2); refuse the rest.

    Args:
        trainer: The DP trainer, after ``Trainer.__init__``.

    Returns:
        ``(rank, world_size)``.

    Raises:
        NotImplementedError: Several devices in one process (``torch.nn.DataParallel``),
            DeepSpeed, an FSDP configuration that
            :func:`~opacus_rc.integrations.fsdp.refuse_unsupported_fsdp` refuses (FSDP version
            1 among them), tensor parallelism, or a multi-process launch that is neither
            accelerate's plain data parallelism nor its FSDP2.
    """
    args = trainer.args
    if args.n_gpu > 1:
        raise NotImplementedError(
            f"n_gpu={args.n_gpu}: the Trainer would use torch.nn.DataParallel in one "
            "process, which replicates the model per device and so splits every "
            "per-example norm hook; launch one process per device instead (torchrun "
            "--nproc-per-node N your_script.py), which a DP trainer runs as DDP"
        )
    if trainer.is_deepspeed_enabled:
        raise NotImplementedError(
            "DeepSpeed through the Trainer is not supported by a DP trainer: its engine "
            "reduces and partitions the gradients itself (ZeRO: in buckets, during the "
            "backward, before per-example clipping could see them) and applies its own "
            "optimizer and loss scaling, so the clipped sum cannot be noised once per logical "
            "batch. To shard a model that does not fit one device, use FSDP2 through the "
            "trainer: TrainingArguments(fsdp=True, fsdp_config={'version': 2}) launched with "
            "torchrun --nproc-per-node N (docs/distributed.md); or launch without DeepSpeed "
            "(DDP)"
        )
    fsdp = bool(trainer.is_fsdp_enabled or getattr(args, "fsdp", None))
    if fsdp:
        refuse_unsupported_fsdp(trainer)  # FSDP2 runs (opacus_rc/integrations/fsdp.py)
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        raise NotImplementedError(
            "tensor parallelism (a model loaded with tp_plan / device_mesh) is not supported "
            "by a DP trainer: each rank holds a slice of a layer, so no rank can form a "
            "per-example norm alone. Load the whole model on each rank and launch with "
            "torchrun --nproc-per-node N (DDP)"
        )
    if args.world_size <= 1:
        return 0, 1
    kind = getattr(trainer.accelerator.distributed_type, "name", "")
    if not (kind.startswith("MULTI_") or (fsdp and kind == "FSDP")) or not (
        dist.is_available() and dist.is_initialized()
    ):
        raise NotImplementedError(
            f"world_size={args.world_size} with accelerate's distributed type {kind!r}: a "
            "DP trainer runs several processes as data parallelism (DDP: torchrun "
            "--nproc-per-node N, or accelerate launch with a multi-CPU / multi-GPU config) or "
            "FSDP2 (TrainingArguments(fsdp=True, fsdp_config={'version': 2})) only; "
            "docs/distributed.md"
        )
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != args.world_size:
        raise NotImplementedError(
            f"the process group has {world_size} ranks but the Trainer counts "
            f"world_size={args.world_size} (model or pipeline parallelism?); a DP trainer "
            "runs several processes as data parallelism only (DDP)"
        )
    if trainer.privacy_args.denoise is not None:
        raise NotImplementedError(
            f"denoise={trainer.privacy_args.denoise!r} does not support several processes: "
            "the denoiser must see the whole noisy gradient; train in one process, or "
            "without denoise"
        )
    return rank, world_size


def check_train_dataset(dataset: Any) -> None:
    """Refuse a training dataset that cannot be Poisson-sampled.

    Raises:
        ValueError: An iterable or unsized dataset, or an empty one.
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            "a DP trainer needs a dataset with a length and indexing (Poisson sampling picks "
            "every example independently); an IterableDataset cannot be sampled. Use a "
            "map-style dataset (datasets.Dataset, a list, torch Dataset)"
        )
    if len(dataset) == 0:
        raise ValueError("the training dataset is empty")
