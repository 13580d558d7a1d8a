"""Post-processing hook point for any Opacus ``DPOptimizer``
(docs/architecture.md#architecture-step, step 8).

A post-processing hook is a function ``hook(optimizer) -> None`` that may rewrite ``p.grad`` of
the optimizer's parameters after noise and ``scale_grad`` and before the wrapped optimizer's
step. It runs before the step hook that was already attached (the accountant's), so the
accountant still sees every step. It must only use the released noisy gradient and public
constants (docs/denoising.md#denoising-post-processing): then it is post-processing and the privacy
guarantee is unchanged.

Opacus calls ``optimizer.step_hook(optimizer)`` once per step in ``pre_step`` (after
``add_noise`` and ``scale_grad``, and only for steps that are not skipped). This module chains
onto that attribute; nothing in Opacus is patched.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

from opacus.optimizers import DistributedDPOptimizer, DistributedDPOptimizerFastGradientClipping

__all__ = ["PostProcessingHandle", "attach_post_processing_hook"]

logger = logging.getLogger(__name__)

PostProcessingHook = Callable[[Any], None]

#: Opacus optimizers whose ``step()`` all-reduces after ``pre_step`` (and so after the hook).
_REDUCE_AFTER_STEP_HOOK = (DistributedDPOptimizer, DistributedDPOptimizerFastGradientClipping)


class _PostProcessingChain:
    """A ``step_hook`` that runs post-processing hooks in order, then the original step hook."""

    def __init__(self, inner: Callable[[Any], None] | None) -> None:
        self.hooks: list[PostProcessingHook] = []
        self.inner = inner

    def __call__(self, optimizer: Any) -> None:
        for hook in list(self.hooks):
            hook(optimizer)
        if self.inner is not None:
            self.inner(optimizer)


class PostProcessingHandle:
    """Returned by :func:`attach_post_processing_hook`; :meth:`remove` detaches the hook."""

    def __init__(self, chain: _PostProcessingChain, hook: PostProcessingHook) -> None:
        self._chain = chain
        self._hook = hook

    def remove(self) -> None:
        """Detach the hook (a no-op if it was already removed)."""
        if self._hook in self._chain.hooks:
            self._chain.hooks.remove(self._hook)


def attach_post_processing_hook(optimizer: Any, hook: PostProcessingHook) -> PostProcessingHandle:
    """Run ``hook(optimizer)`` at every step after noise and scaling, before the accountant hook.

    Works for any single-process Opacus ``DPOptimizer`` (flat, per-layer, adaptive, ghost, or
    :class:`~opacus_rc.optimizers.RandomizedClipOptimizer`) and for
    :class:`~opacus_rc.optimizers.DistributedRandomizedClipOptimizer`. Hooks run in the order
    attached. Opacus' own DDP optimizers are refused: they call the step hook *before* the
    all-reduce, where ranks other than 0 hold an un-noised partial sum, so a hook there would
    not be post-processing.

    Call it after ``make_private``: ``DPOptimizer.attach_step_hook`` replaces ``step_hook``, so
    on a plain Opacus optimizer an accountant hook attached later would drop the chain (a warning
    is issued when no step hook is attached yet). :class:`RandomizedClipOptimizer` keeps the chain
    in that case.

    Args:
        optimizer: An Opacus ``DPOptimizer`` (anything with a ``step_hook`` attribute that its
            ``pre_step`` calls after ``add_noise`` and ``scale_grad``).
        hook: ``hook(optimizer) -> None``; may modify ``p.grad`` in place.

    Returns:
        A handle whose ``remove()`` detaches the hook.

    Raises:
        TypeError: If ``hook`` is not callable or ``optimizer`` has no ``step_hook``.
        ValueError: For Opacus' ``DistributedDPOptimizer`` (and subclasses) and
            ``DistributedDPOptimizerFastGradientClipping``.
    """
    if not callable(hook):
        raise TypeError(f"hook must be callable, got {type(hook).__name__}")
    if not hasattr(optimizer, "step_hook"):
        raise TypeError(
            f"{type(optimizer).__name__} has no step_hook; pass an Opacus DPOptimizer "
            "(the optimizer returned by make_private)"
        )
    if isinstance(optimizer, _REDUCE_AFTER_STEP_HOOK):
        raise ValueError(
            f"{type(optimizer).__name__} runs step hooks before its gradient all-reduce, on a "
            "rank's un-noised partial sum (noise is added on rank 0 only): a post-processing "
            "hook there is not post-processing of the released gradient. Use "
            "opacus_rc.PrivacyEngine(clipping='randomized') with a DPDDP/DDP model "
            "(DistributedRandomizedClipOptimizer reduces before its hooks)."
        )
    current = optimizer.step_hook
    if isinstance(current, _PostProcessingChain):
        chain = current
    else:
        if current is None and not getattr(optimizer, "_keeps_post_processing", False):
            warnings.warn(
                "attach_post_processing_hook: the optimizer has no step hook yet; if an "
                "accountant hook is attached later with attach_step_hook it will replace the "
                "post-processing hook. Attach post-processing after make_private.",
                UserWarning,
                stacklevel=2,
            )
        chain = _PostProcessingChain(current)
        optimizer.step_hook = chain
    chain.hooks.append(hook)
    logger.debug("attached post-processing hook %r to %s", hook, type(optimizer).__name__)
    return PostProcessingHandle(chain, hook)
