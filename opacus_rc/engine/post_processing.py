"""The engine's post-processing: the ``denoise=`` denoiser and the ``check_lora_update`` guard.

One concept in two halves, so that nothing is attached before every option is valid:
:func:`prepare_post_processing` validates the options and builds the objects when the call's
options are validated (before any hook), and :func:`attach_post_processing` attaches them to the DP
optimizer that Opacus' ``make_private`` returned, undoing everything if that fails. The hook
point they attach to is :func:`opacus_rc.optimizers.post_processing.attach_post_processing_hook`
(docs/denoising.md#denoising-post-processing: post-processing never changes the accountant).
"""

from __future__ import annotations

import logging
from typing import Any

from opacus.distributed import DifferentiallyPrivateDistributedDataParallel
from opacus.grad_sample.gsm_base import AbstractGradSampleModule
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from opacus_rc.denoising import make_denoiser
from opacus_rc.grad_sample.grad_sample_module import strip_grad_sample_hooks
from opacus_rc.lora import LoRAUpdateGuard
from opacus_rc.optimizers.post_processing import attach_post_processing_hook

__all__ = ["attach_post_processing", "prepare_post_processing"]

logger = logging.getLogger("opacus_rc.privacy_engine")


def prepare_post_processing(
    *,
    module: nn.Module,
    grad_sample_mode: str,
    denoise: str | None,
    denoise_kappa: float | None,
    denoise_options: dict[str, Any] | None,
    check_lora_update: bool,
) -> tuple[Any, LoRAUpdateGuard | None]:
    """Validate the denoiser and LoRA-guard options and build them; attach nothing.

    Args:
        module: The user's model (or Opacus' wrapper of it).
        grad_sample_mode: The call's ``grad_sample_mode`` (an ``"fsdp"`` mode is distributed).
        denoise: The denoiser's name (:data:`~opacus_rc.denoising.DENOISERS`), or None.
        denoise_kappa: Its threshold factor, or None for its default.
        denoise_options: Its further keyword arguments, or None.
        check_lora_update: Whether to build a :class:`~opacus_rc.lora.LoRAUpdateGuard`.

    Returns:
        ``(denoiser, lora_guard)``, each None where not asked for.

    Raises:
        ValueError: Denoiser options without ``denoise``; ``kappa`` inside
            ``denoise_options``; the denoiser's and the guard's own errors (an unknown name,
            ``denoise_kappa < 1``, no trainable LoRA adapter).
        TypeError: An unknown key in ``denoise_options``.
        NotImplementedError: ``denoise`` with a distributed (DPDDP, DDP, FSDP) model.
    """
    denoiser = None
    if denoise is None:
        if denoise_kappa is not None or denoise_options is not None:
            raise ValueError(
                "denoise_kappa and denoise_options only apply with a denoiser; pass "
                "denoise='spectral'"
            )
    else:
        if isinstance(
            module,
            (DifferentiallyPrivateDistributedDataParallel, DistributedDataParallel, FSDPModule),
        ) or "fsdp" in str(grad_sample_mode):
            raise NotImplementedError(
                f"denoise={denoise!r} does not support distributed training: the denoiser "
                "must see the complete noisy gradient, and Opacus' distributed optimizers "
                "call step hooks before the all-reduce, where ranks hold un-noised partial "
                "sums (denoising those is not post-processing). Train in one process, or "
                "pass denoise=None."
            )
        options = dict(denoise_options or {})
        if "kappa" in options:
            raise ValueError("pass kappa as denoise_kappa, not inside denoise_options")
        denoiser = make_denoiser(denoise, kappa=denoise_kappa, **options)
    guard = None
    if check_lora_update:
        guard = LoRAUpdateGuard(
            module.module if isinstance(module, AbstractGradSampleModule) else module
        )
    return denoiser, guard


def attach_post_processing(
    engine: Any,
    out: tuple[Any, ...],
    *,
    denoiser: Any,
    lora_guard: LoRAUpdateGuard | None,
    module: nn.Module,
    dataset: Any,
) -> tuple[Any, ...]:
    """Attach the denoiser and the LoRA guard to ``out``'s optimizer; undo all on failure.

    Sets ``engine.denoiser`` and ``engine.lora_update_guard`` (None first, the attached objects
    once attached). If attaching raises, the hooks are removed from ``module`` and
    ``engine.dataset`` is restored before the error propagates.

    Args:
        engine: The :class:`~opacus_rc.PrivacyEngine` whose ``make_private`` returned ``out``.
        out: ``make_private``'s return value (the optimizer second).
        denoiser: The denoiser :func:`prepare_post_processing` built, or None.
        lora_guard: The LoRA guard it built, or None.
        module: The user's model.
        dataset: ``engine.dataset`` before ``make_private``, restored if attaching fails.

    Returns:
        ``out``.
    """
    engine.denoiser = None
    engine.lora_update_guard = None
    if denoiser is None and lora_guard is None:
        return out
    optimizer = out[1]
    try:
        if denoiser is not None:
            check = getattr(denoiser, "check_optimizer", None)
            if check is not None:
                check(optimizer)
            attach_post_processing_hook(optimizer, denoiser)
        if lora_guard is not None:
            lora_guard.attach(optimizer)
    except BaseException:
        cleanup = getattr(out[0], "cleanup", None)
        if callable(cleanup):
            cleanup()
        strip_grad_sample_hooks(module)
        engine.dataset = dataset
        raise
    engine.denoiser = denoiser
    engine.lora_update_guard = lora_guard
    logger.info("post-processing: denoiser=%r, lora guard=%s", denoiser, lora_guard)
    return out
