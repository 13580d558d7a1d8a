"""``PrivacyEngine`` with randomized clipping (DESIGN.md sections 1 and 3).

:class:`PrivacyEngine` subclasses ``opacus.PrivacyEngine``. ``clipping="randomized"`` builds a
:class:`~opacus_rc.grad_sample.GradSampleModuleRandomizedClipping` (or its hooks-only twin for
``wrap_model=False``), a :class:`~opacus_rc.optimizers.RandomizedClipOptimizer` (its distributed
variant for DPDDP/DDP models, chosen from :mod:`opacus_rc.optimizers.registry`), the
:class:`~opacus_rc.optimizers.DPLossRandomizedClipping` (one backward pass with book-keeping where
the model allows it, else two) and a Poisson data loader, and ties the
accountant's step hook to the optimizer. Every other ``clipping`` value is passed to Opacus
unchanged.

Rules (DESIGN.md section 1): every argument is validated before any hook is attached; an
accountant that cannot account for sketched norms makes ``clipping="randomized"`` raise; and no
hook stays on the user's model when ``make_private`` raises (for any ``clipping``).
"""

from __future__ import annotations

import importlib
import logging
import math
import warnings
from dataclasses import dataclass
from itertools import chain
from typing import Any

import opacus
import torch
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel
from opacus.grad_sample.gsm_base import AbstractGradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn, optim
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from opacus_rc.data_loader import DistributedDPDataLoader
from opacus_rc.denoising import make_denoiser
from opacus_rc.grad_sample import (
    GradSampleHooksRandomizedClipping,
    GradSampleModuleRandomizedClipping,
)
from opacus_rc.grad_sample.grad_sample_module import (
    check_training_mode,
    resolve_sketch_spec,
    strip_grad_sample_hooks,
)
from opacus_rc.lora import LoRAUpdateGuard
from opacus_rc.optimizers import DPLossRandomizedClipping
from opacus_rc.optimizers.post_processing import attach_post_processing_hook
from opacus_rc.optimizers.registry import get_optimizer_class
from opacus_rc.sketching import SketchSpec

__all__ = ["PrivacyEngine"]

logger = logging.getLogger(__name__)

_DEFAULT_SKETCH = "hutchinson"
_DEFAULT_SKETCH_DIM = 32  # THEORY.md section 0, point 4: use k >= 32, default 32.
_ACCOUNTANT_ERROR = (
    "clipping='randomized' needs an accountant that can account for sketched norms; "
    "use accountant='rc'"
)
_RANDOMIZED_GRAD_SAMPLE_MODES = ("hooks", "ghost")


@dataclass(frozen=True)
class _PostProcessing:
    """What ``make_private`` attaches after building the DP optimizer (validated up front).

    Attributes:
        denoiser: The ``denoise=`` post-processing hook, or None.
        lora_guard: The ``check_lora_update=True`` guard, or None.
        dataset: ``engine.dataset`` before ``make_private``, restored if attaching fails.
    """

    denoiser: Any
    lora_guard: LoRAUpdateGuard | None
    dataset: Any


class PrivacyEngine(opacus.PrivacyEngine):
    """``opacus.PrivacyEngine`` with ``clipping="randomized"`` (DP-SGD-RC).

    Args:
        accountant: Name of an accountant in Opacus' registry. The default ``"rc"`` (registered
            by ``import opacus_rc``) accounts for both randomized and exact clipping.
        secure_mode: Opacus' secure mode (CSPRNG noise and sampling); with randomized clipping
            the sketch generator is also reseeded from :mod:`secrets` after every step.

    Attributes:
        denoiser: The denoiser the last ``make_private(denoise=...)`` attached (e.g. a
            :class:`~opacus_rc.denoising.SpectralDenoiser`, whose ``last_report`` says what it
            did at the last step), or None.
        lora_update_guard: The :class:`~opacus_rc.lora.LoRAUpdateGuard` the last
            ``make_private(check_lora_update=True)`` attached, or None.

    Raises:
        ValueError: If the accountant name is not registered.
    """

    denoiser: Any = None
    lora_update_guard: LoRAUpdateGuard | None = None

    def __init__(self, *, accountant: str = "rc", secure_mode: bool = False) -> None:
        if accountant == "rc":
            # ``import opacus_rc`` registers "rc"; registering again here is idempotent and keeps
            # this class usable on its own. Imported lazily: the accountant package is optional
            # for this module's import.
            try:
                accountants = importlib.import_module("opacus_rc.accountants")
            except ImportError:  # pragma: no cover - depends on the install
                logger.debug("opacus_rc.accountants is not importable", exc_info=True)
            else:
                accountants.register()
        super().__init__(accountant=accountant, secure_mode=secure_mode)

    # ------------------------------------------------------------------------------------------
    # make_private
    # ------------------------------------------------------------------------------------------

    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: optim.Optimizer,
        criterion: Any = None,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: float | list[float],
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        clipping: str = "flat",
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
        rand_on_empty: bool = False,
        sketch: str | None = None,
        sketch_dim: int | None = None,
        sketch_head_dim: int | None = None,
        sketch_generator: torch.Generator | None = None,
        denoise: str | None = None,
        denoise_kappa: float | None = None,
        denoise_options: dict[str, Any] | None = None,
        check_lora_update: bool = False,
        bookkeeping: bool = True,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """Make the model, optimizer, criterion and data loader private.

        With ``clipping="randomized"`` the per-sample norms of ``nn.Linear`` layers are sketched
        (THEORY.md A.2/A.3), every other layer's norm is exact, samples are clipped with
        ``min(1, C / n_hat_i)`` and noised with ``N(0, sigma^2 C^2)``. Any other ``clipping``
        is Opacus' own ``make_private`` with the same arguments and return value.

        Args:
            module: The model, in training mode.
            optimizer: The optimizer over ``module``'s parameters.
            criterion: The loss; must have ``reduction == loss_reduction``. Default
                ``nn.CrossEntropyLoss()``.
            data_loader: The training data loader.
            noise_multiplier: ``sigma`` (>= 0).
            max_grad_norm: ``C`` (> 0; one float for randomized clipping).
            batch_first: Inputs are ``(B, ...)``.
            loss_reduction: ``"mean"`` or ``"sum"``.
            poisson_sampling: Replace the loader by a Poisson-sampling one (needed for the
                guarantee).
            clipping: ``"randomized"``, or an Opacus value (``"flat"``, ``"per_layer"``,
                ``"adaptive"``).
            noise_generator: Generator for the noise (not allowed in secure mode).
            grad_sample_mode: Opacus mode; randomized clipping accepts ``"hooks"`` (the
                default, meaning "choose for me") or ``"ghost"`` and always uses its own module.
            wrap_model: ``False`` attaches hooks to ``module`` without wrapping it; the first
                returned value is then the hooks object (keep using ``module``).
            rand_on_empty: Opacus: feed a random sample instead of an empty Poisson batch.
            sketch: ``"hutchinson"`` (default) or ``"hutch++"``; randomized clipping only.
            sketch_dim: ``k``, Gaussian (tail) columns (default 32); randomized only.
            sketch_head_dim: Hutch++ head columns (default ``sketch_dim``); randomized only.
            sketch_generator: Generator for the probes. Leave ``None`` (seeded from the OS);
                passing one warns and marks the sketch not secret. Randomized only.
            denoise: Name of a post-processing denoiser applied to the noisy gradient at every
                step, after noise and scaling and before the optimizer step
                (:mod:`opacus_rc.denoising.registry`; ``"spectral"``: spectral denoising of
                every 2-D gradient, THEORY.md E). ``None`` (default): no denoising. Works with
                every ``clipping`` and ``grad_sample_mode`` of a single process; never changes
                the accountant (post-processing, THEORY.md E.4). Afterwards the denoiser is
                ``engine.denoiser`` (e.g. its ``last_report``).
            denoise_kappa: Threshold factor ``kappa >= 1`` of the denoiser (``None``: its
                default, :data:`~opacus_rc.denoising.DEFAULT_KAPPA` for ``"spectral"``).
                Only with ``denoise``.
            denoise_options: Further keyword arguments of the denoiser (for ``"spectral"``:
                ``norm_correction``, ``min_dim``, ``svd``, ``rank``, ... of
                :class:`~opacus_rc.denoising.SpectralDenoiser`). Only with ``denoise``.
            check_lora_update: Guard against Opacus issue 820 (peft adapters that never
                change): snapshot the model's LoRA factors now and, right after the first
                optimizer step, raise :class:`~opacus_rc.lora.LoRAUpdateError` if any
                trainable adapter's update ``scaling * B @ A`` did not move or is not finite
                (:class:`~opacus_rc.lora.LoRAUpdateGuard`, then ``engine.lora_update_guard``).
            bookkeeping: Randomized clipping only. ``True`` (default): one backward pass per
                step (book-keeping; Bu, Wang, Zha and Karypis, ICML 2023) where every trainable
                module supports it, else the two-pass path (logged once at INFO with the
                modules that forced it; always two passes for DPDDP/DDP models). ``False``:
                always two backward passes. Both give the same clipped gradient and the same
                privacy guarantee (the probes are drawn in the first pass only); book-keeping
                is faster and frees the graph after the first pass. The module's
                ``bookkeeping`` property says which is used.
            **kwargs: Passed to Opacus for other ``clipping`` values; none are accepted with
                ``clipping="randomized"``.

        Returns:
            With ``clipping="randomized"``: ``(module, optimizer, criterion, data_loader)``,
            where ``module`` is a :class:`GradSampleModuleRandomizedClipping` (or the
            :class:`GradSampleHooksRandomizedClipping` object if ``wrap_model=False``),
            ``optimizer`` a :class:`RandomizedClipOptimizer` and ``criterion`` a
            ``DPLossRandomizedClipping`` whose ``backward()`` computes the clipped gradient
            (one or two backward passes, see ``bookkeeping``). Otherwise Opacus' return value.

        Raises:
            ValueError: Unknown sketch, ``sketch_dim < 1``, an accountant that cannot account
                for randomized clipping, an eval-mode model, a loss-reduction mismatch, sketch
                options without ``clipping="randomized"``, and the other invalid inputs listed
                in :class:`GradSampleModuleRandomizedClipping`; Opacus' own errors otherwise.
                Unknown ``denoise`` (the message lists the allowed names), ``denoise_kappa <
                1``, denoiser options without ``denoise``, ``check_lora_update`` on a model
                without trainable LoRA adapters. ``bookkeeping=False`` without
                ``clipping="randomized"``.
            TypeError: Unknown keyword arguments with ``clipping="randomized"``; an unknown
                key in ``denoise_options``; a non-bool ``bookkeeping``.
            NotImplementedError: ``denoise`` with a distributed (DPDDP, DDP, FSDP) model.
        """
        if criterion is None:
            criterion = nn.CrossEntropyLoss()
        post = self._prepare_post_processing(
            module=module,
            grad_sample_mode=grad_sample_mode,
            denoise=denoise,
            denoise_kappa=denoise_kappa,
            denoise_options=denoise_options,
            check_lora_update=check_lora_update,
        )
        _check_bookkeeping(bookkeeping, clipping)
        if clipping != "randomized":
            self._reject_sketch_options(
                clipping, sketch, sketch_dim, sketch_head_dim, sketch_generator
            )
            out = self._delegate(
                super().make_private,
                module=module,
                optimizer=optimizer,
                criterion=criterion,
                data_loader=data_loader,
                noise_multiplier=noise_multiplier,
                max_grad_norm=max_grad_norm,
                batch_first=batch_first,
                loss_reduction=loss_reduction,
                poisson_sampling=poisson_sampling,
                clipping=clipping,
                noise_generator=noise_generator,
                grad_sample_mode=grad_sample_mode,
                wrap_model=wrap_model,
                rand_on_empty=rand_on_empty,
                **kwargs,
            )
            return self._attach_post_processing(out, post, module=module)

        if isinstance(noise_multiplier, bool) or not (
            isinstance(noise_multiplier, (int, float))
            and math.isfinite(noise_multiplier)
            and noise_multiplier >= 0
        ):
            raise ValueError(
                f"noise_multiplier must be a finite number >= 0, got {noise_multiplier}"
            )
        spec = self._validate_randomized(
            module=module,
            optimizer=optimizer,
            criterion=criterion,
            data_loader=data_loader,
            max_grad_norm=max_grad_norm,
            loss_reduction=loss_reduction,
            noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode,
            sketch=sketch,
            sketch_dim=sketch_dim,
            sketch_head_dim=sketch_head_dim,
            sketch_generator=sketch_generator,
            kwargs=kwargs,
        )

        gsm_class = (
            GradSampleModuleRandomizedClipping if wrap_model else GradSampleHooksRandomizedClipping
        )
        previous_dataset = self.dataset
        gsm = None
        try:
            gsm = gsm_class(
                module,
                max_grad_norm=float(max_grad_norm),  # type: ignore[arg-type]
                sketch=spec.estimator,
                sketch_dim=spec.sketch_dim,
                sketch_head_dim=spec.head_dim,
                sketch_generator=sketch_generator,
                secure_mode=self.secure_mode,
                batch_first=batch_first,
                loss_reduction=loss_reduction,
                strict=True,
                bookkeeping=bookkeeping,
            )
            if poisson_sampling:
                gsm.forbid_grad_accumulation()
            # DPDDP / DDP: each rank clips its samples, rank 0 adds the noise (THEORY B.1 on
            # the global batch); expected_batch_size is per rank, as in Opacus.
            distributed = isinstance(
                module, (DifferentiallyPrivateDistributedDataParallel, DistributedDataParallel)
            )
            dp_loader = self._prepare_data_loader(
                data_loader,
                distributed=distributed,
                poisson_sampling=poisson_sampling,
                batch_first=batch_first,
                rand_on_empty=rand_on_empty,
            )
            if distributed and poisson_sampling:
                # Opacus' distributed sampler drops empty batches per rank (ranks fall out of
                # step, steps go unaccounted); this one keeps them.
                dp_loader = DistributedDPDataLoader.from_data_loader(
                    data_loader,
                    distributed=True,
                    generator=self.secure_rng,
                    batch_first=batch_first,
                    rand_on_empty=rand_on_empty,
                )
            data_loader = dp_loader
            sample_rate = 1 / len(data_loader)
            expected_batch_size = int(len(data_loader.dataset) * sample_rate)
            if distributed:
                expected_batch_size /= torch.distributed.get_world_size()
            if isinstance(optimizer, DPOptimizer):
                optimizer = optimizer.original_optimizer
            optimizer_class = get_optimizer_class("randomized", distributed=distributed)
            dp_optimizer = optimizer_class(
                optimizer,
                grad_sample_module=gsm,
                noise_multiplier=float(noise_multiplier),
                max_grad_norm=float(max_grad_norm),  # type: ignore[arg-type]
                expected_batch_size=expected_batch_size,
                loss_reduction=loss_reduction,
                generator=self.secure_rng if self.secure_mode else noise_generator,
                secure_mode=self.secure_mode,
            )
            dp_optimizer.attach_step_hook(
                self.accountant.get_optimizer_hook_fn(sample_rate=sample_rate)
            )
            dp_criterion = DPLossRandomizedClipping(gsm, dp_optimizer, criterion, loss_reduction)
            if gsm.sketch_spec != spec:  # pragma: no cover - defensive
                raise RuntimeError(f"module uses {gsm.sketch_spec}, validated {spec}")
        except BaseException:
            if gsm is not None:
                gsm.cleanup()
            strip_grad_sample_hooks(module)
            self.dataset = previous_dataset
            raise
        logger.info(
            "randomized clipping: %s, sample_rate=%.6g, bookkeeping=%s",
            spec,
            sample_rate,
            gsm.bookkeeping,
        )
        return self._attach_post_processing(
            (gsm, dp_optimizer, dp_criterion, data_loader), post, module=module
        )

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: optim.Optimizer,
        criterion: Any = None,
        data_loader: DataLoader,
        target_epsilon: float,
        target_delta: float,
        epochs: int,
        max_grad_norm: float | list[float],
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        clipping: str = "flat",
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
        sketch: str | None = None,
        sketch_dim: int | None = None,
        sketch_head_dim: int | None = None,
        sketch_generator: torch.Generator | None = None,
        denoise: str | None = None,
        denoise_kappa: float | None = None,
        denoise_options: dict[str, Any] | None = None,
        check_lora_update: bool = False,
        bookkeeping: bool = True,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """:meth:`make_private` with the noise multiplier found for a privacy budget.

        With ``clipping="randomized"`` the noise multiplier is searched with
        ``opacus_rc.accountants.get_noise_multiplier`` and this engine's accountant, for the
        exact :class:`SketchSpec` the module will use (so the search and the later
        ``get_epsilon`` agree). Other ``clipping`` values are Opacus' own method.

        Args:
            target_epsilon: Target epsilon after ``epochs`` epochs.
            target_delta: Target delta.
            epochs: Number of epochs (``epochs / sample_rate`` steps).
            bookkeeping: Randomized clipping only: one backward pass per step where the model
                allows it (default ``True``), or always two (``False``); see
                :meth:`make_private`. Does not change the noise multiplier found.
            (others): As in :meth:`make_private`.

        Returns:
            As :meth:`make_private`.

        Raises:
            ValueError: As :meth:`make_private`, raised before the (slow) noise search.
            TypeError, NotImplementedError: As :meth:`make_private`, before the search.
        """
        if criterion is None:
            criterion = nn.CrossEntropyLoss()
        post = self._prepare_post_processing(
            module=module,
            grad_sample_mode=grad_sample_mode,
            denoise=denoise,
            denoise_kappa=denoise_kappa,
            denoise_options=denoise_options,
            check_lora_update=check_lora_update,
        )
        _check_bookkeeping(bookkeeping, clipping)
        if clipping != "randomized":
            self._reject_sketch_options(
                clipping, sketch, sketch_dim, sketch_head_dim, sketch_generator
            )
            out = self._delegate(
                super().make_private_with_epsilon,
                module=module,
                optimizer=optimizer,
                criterion=criterion,
                data_loader=data_loader,
                target_epsilon=target_epsilon,
                target_delta=target_delta,
                epochs=epochs,
                max_grad_norm=max_grad_norm,
                batch_first=batch_first,
                loss_reduction=loss_reduction,
                poisson_sampling=poisson_sampling,
                clipping=clipping,
                noise_generator=noise_generator,
                grad_sample_mode=grad_sample_mode,
                wrap_model=wrap_model,
                **kwargs,
            )
            return self._attach_post_processing(out, post, module=module)

        spec = self._validate_randomized(
            module=module,
            optimizer=optimizer,
            criterion=criterion,
            data_loader=data_loader,
            max_grad_norm=max_grad_norm,
            loss_reduction=loss_reduction,
            noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode,
            sketch=sketch,
            sketch_dim=sketch_dim,
            sketch_head_dim=sketch_head_dim,
            sketch_generator=sketch_generator,
            kwargs=kwargs,
        )
        sample_rate = 1 / len(data_loader)
        if len(self.accountant) > 0:
            warnings.warn(
                "make_private_with_epsilon is called with privacy budget already spent; the "
                "noise multiplier assumes a zero starting point, so the total epsilon will be "
                "higher than the target",
                UserWarning,
                stacklevel=2,
            )
        from opacus_rc.accountants import get_noise_multiplier

        noise_multiplier = get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=sample_rate,
            epochs=epochs,
            steps=None,
            sketch_spec=spec,
            accountant=self.accountant,
            epsilon_tolerance=0.01,
        )
        return self.make_private(
            module=module,
            optimizer=optimizer,
            criterion=criterion,
            data_loader=data_loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            poisson_sampling=poisson_sampling,
            clipping="randomized",
            noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode,
            wrap_model=wrap_model,
            sketch=spec.estimator,
            sketch_dim=spec.sketch_dim,
            sketch_head_dim=spec.head_dim,
            sketch_generator=sketch_generator,
            denoise=denoise,
            denoise_kappa=denoise_kappa,
            denoise_options=denoise_options,
            check_lora_update=check_lora_update,
            bookkeeping=bookkeeping,
        )

    # ------------------------------------------------------------------------------------------
    # Helpers
    # ------------------------------------------------------------------------------------------

    def _prepare_post_processing(
        self,
        *,
        module: nn.Module,
        grad_sample_mode: str,
        denoise: str | None,
        denoise_kappa: float | None,
        denoise_options: dict[str, Any] | None,
        check_lora_update: bool,
    ) -> _PostProcessing:
        """Validate the denoiser and LoRA-guard options and build them; attach nothing."""
        denoiser = None
        if denoise is None:
            if denoise_kappa is not None or denoise_options is not None:
                raise ValueError(
                    "denoise_kappa and denoise_options only apply with a denoiser; pass "
                    "denoise='spectral' (or another registered name)"
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
        return _PostProcessing(denoiser=denoiser, lora_guard=guard, dataset=self.dataset)

    def _attach_post_processing(
        self, out: tuple[Any, ...], post: _PostProcessing, *, module: nn.Module
    ) -> tuple[Any, ...]:
        """Attach the denoiser and the LoRA guard to ``out``'s optimizer; undo all on failure."""
        self.denoiser = None
        self.lora_update_guard = None
        if post.denoiser is None and post.lora_guard is None:
            return out
        optimizer = out[1]
        try:
            if post.denoiser is not None:
                check = getattr(post.denoiser, "check_optimizer", None)
                if check is not None:
                    check(optimizer)
                attach_post_processing_hook(optimizer, post.denoiser)
            if post.lora_guard is not None:
                post.lora_guard.attach(optimizer)
        except BaseException:
            cleanup = getattr(out[0], "cleanup", None)
            if callable(cleanup):
                cleanup()
            strip_grad_sample_hooks(module)
            self.dataset = post.dataset
            raise
        self.denoiser = post.denoiser
        self.lora_update_guard = post.lora_guard
        logger.info("post-processing: denoiser=%r, lora guard=%s", post.denoiser, post.lora_guard)
        return out

    @staticmethod
    def _reject_sketch_options(clipping: str, *options: Any) -> None:
        if any(o is not None for o in options):
            raise ValueError(
                "sketch, sketch_dim, sketch_head_dim and sketch_generator only apply to "
                f"clipping='randomized' (got clipping={clipping!r})"
            )

    def _delegate(self, method: Any, *, module: nn.Module, **kwargs: Any) -> Any:
        """Call an Opacus method; on failure, strip any hook it left on ``module``."""
        had_hooks = hasattr(module, "autograd_grad_sample_hooks")
        previous_dataset = self.dataset
        try:
            return method(module=module, **kwargs)
        except BaseException:
            if not had_hooks:
                strip_grad_sample_hooks(module)
            self.dataset = previous_dataset
            raise

    def _validate_randomized(
        self,
        *,
        module: nn.Module,
        optimizer: optim.Optimizer,
        criterion: Any,
        data_loader: DataLoader,
        max_grad_norm: Any,
        loss_reduction: str,
        noise_generator: torch.Generator | None,
        grad_sample_mode: str,
        sketch: str | None,
        sketch_dim: int | None,
        sketch_head_dim: int | None,
        sketch_generator: torch.Generator | None,
        kwargs: dict[str, Any],
    ) -> SketchSpec:
        """Check every input of a randomized-clipping ``make_private``; attach nothing.

        Returns:
            The :class:`SketchSpec` the module will use.
        """
        if kwargs:
            raise TypeError(
                f"unexpected keyword arguments for clipping='randomized': {sorted(kwargs)}"
            )
        if not getattr(type(self.accountant), "supports_randomized_clipping", False):
            raise ValueError(_ACCOUNTANT_ERROR)
        if noise_generator is not None and self.secure_mode:
            raise ValueError("Passing seed is prohibited in secure mode")
        if sketch_generator is not None and self.secure_mode:
            raise ValueError(
                "passing a sketch_generator is prohibited in secure mode: the sketch must come "
                "from the operating system's CSPRNG"
            )
        spec = resolve_sketch_spec(
            sketch=_DEFAULT_SKETCH if sketch is None else sketch,
            sketch_dim=_DEFAULT_SKETCH_DIM if sketch_dim is None else sketch_dim,
            sketch_head_dim=sketch_head_dim,
            sketch_generator=sketch_generator,
        )
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)):
            raise TypeError(
                "clipping='randomized' needs one float max_grad_norm (flat clipping), got "
                f"{type(max_grad_norm).__name__}"
            )
        if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        criterion_reduction = getattr(criterion, "reduction", None)
        if criterion_reduction is not None and criterion_reduction != loss_reduction:
            raise ValueError(
                f"the criterion has reduction={criterion_reduction!r} but "
                f"loss_reduction={loss_reduction!r}; they must match"
            )
        if grad_sample_mode not in _RANDOMIZED_GRAD_SAMPLE_MODES:
            raise ValueError(
                f"clipping='randomized' uses its own grad-sample module; grad_sample_mode must "
                f"be one of {_RANDOMIZED_GRAD_SAMPLE_MODES}, got {grad_sample_mode!r}"
            )
        if isinstance(module, FSDPModule):
            raise NotImplementedError(
                "clipping='randomized' does not support FSDP yet; use DPDDP or DDP"
            )
        if isinstance(module, AbstractGradSampleModule) or hasattr(
            module, "autograd_grad_sample_hooks"
        ):
            raise ValueError(
                "the model already has Opacus grad-sample hooks; pass the plain nn.Module"
            )
        model_parameters = set(module.parameters())
        for p in chain.from_iterable(group["params"] for group in optimizer.param_groups):
            if p not in model_parameters:
                raise ValueError("Module parameters are different than optimizer Parameters")
        check_training_mode(module)
        self.validate(module=module, optimizer=None, data_loader=None)
        if len(data_loader) == 0:
            raise ValueError("the data loader is empty")
        return spec


def _check_bookkeeping(bookkeeping: Any, clipping: str) -> None:
    """Validate ``bookkeeping`` (a bool; ``False`` only with ``clipping="randomized"``)."""
    if not isinstance(bookkeeping, bool):
        raise TypeError(f"bookkeeping must be a bool, got {type(bookkeeping).__name__}")
    if not bookkeeping and clipping != "randomized":
        raise ValueError(
            f"bookkeeping only applies to clipping='randomized' (got clipping={clipping!r})"
        )
