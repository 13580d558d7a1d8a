"""``PrivacyEngine`` with randomized clipping (docs/architecture.md#architecture-seams).

:class:`PrivacyEngine` subclasses ``opacus.PrivacyEngine`` and runs Opacus' own
``make_private`` template for every ``clipping`` value. This module holds the public methods and
the order of one call; each step is a module of :mod:`opacus_rc.engine`:

1. the call's options, one record (:mod:`opacus_rc.engine.options`), validated as a whole before
   any hook is attached and completed with what is derived from them
   (:mod:`opacus_rc.engine.request`: the data loader, the public sizes of
   :mod:`opacus_rc.engine.schedule`, the post-processing, and for ``clipping="randomized"`` the
   one :class:`~opacus_rc.config.RandomizedClippingConfig` that configures the module and the
   optimizer);
2. the noise multiplier: searched for a target epsilon at the schedule the run will have, or a
   given one checked (``noise_multiplier=0`` only with an accountant that records it,
   :mod:`opacus_rc.engine.noise`); with it the run's one
   :class:`~opacus_rc.mechanism.Mechanism` is built (``engine.mechanism``);
3. Opacus' ``make_private``, whose build steps for randomized clipping are the seams of
   :class:`~opacus_rc.engine.seams.RandomizedClippingSeams` (the grad-sample module, the
   Poisson loader, the randomized-clipping optimizer, the DP loss);
4. the post-processing attached to the DP optimizer (:mod:`opacus_rc.engine.post_processing`:
   the denoiser, the LoRA guard).

Rules: every argument is validated before any hook is attached; an
accountant that cannot account for sketched norms makes ``clipping="randomized"`` raise; a
``noise_multiplier`` the accountant cannot record is refused up front (never a step that fails);
and no hook stays on the user's model when ``make_private`` raises (for any ``clipping``).

The ``"rc"`` accountant is registered in Opacus' registry by ``import opacus_rc`` (Opacus has no
plug-in mechanism for accountants, so ``opacus.PrivacyEngine(accountant="rc")`` without that
import fails with Opacus' ``ValueError: Unexpected accounting mechanism: rc``). This class
registers it itself, so ``opacus_rc.PrivacyEngine()`` always works.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn, optim
from torch.utils.data import DataLoader

from opacus_rc.batch_independence import BatchIndependenceCheck
from opacus_rc.config import validate_noise_multiplier
from opacus_rc.engine.noise import check_zero_noise, search_noise_multiplier
from opacus_rc.engine.options import MakePrivateOptions
from opacus_rc.engine.post_processing import attach_post_processing
from opacus_rc.engine.request import validate_options
from opacus_rc.engine.seams import RandomizedClippingSeams
from opacus_rc.grad_sample.grad_sample_module import strip_grad_sample_hooks
from opacus_rc.lora import LoRAUpdateGuard
from opacus_rc.mechanism import Mechanism
from opacus_rc.packed_loss import PackedAttentionGuard
from opacus_rc.units.data_loader import UnitDataLoader

__all__ = ["PrivacyEngine"]

logger = logging.getLogger(__name__)

#: Start of the one warning given when a ``sketch_generator`` is passed (filters match it).
_GENERATOR_WARNING_PREFIX = "a sketch_generator was passed"


@contextlib.contextmanager
def _secure_rng_warning_on_rank_zero() -> Iterator[None]:
    """Silence Opacus' "Secure RNG turned off" warning on every rank but 0 (the same message
    on each of W ranks told a distributed run W times). The rank is that of the initialised
    default process group, else ``$RANK`` (torchrun sets it before the group exists)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    else:
        try:
            rank = int(os.environ.get("RANK", "0"))
        except ValueError:
            rank = 0
    if rank == 0:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off", category=UserWarning)
        yield


class PrivacyEngine(RandomizedClippingSeams):
    """``opacus.PrivacyEngine`` with ``clipping="randomized"`` (DP-SGD-RC).

    Adjacency: :meth:`get_epsilon` (and the target of ``make_private_with_epsilon``) is the
    epsilon for *add/remove* adjacency only (neighbouring datasets differ by the presence of
    one record), as in Opacus; under *replace-one* adjacency it does not hold. With the RC
    accountant, ``engine.accountant.get_epsilon_replace_one(delta)`` gives a valid
    replace-one bound (docs/privacy/adjacency.md#adjacency-replace-one).

    Args:
        accountant: Name of an accountant in Opacus' registry. The default ``"rc"`` (registered
            by ``import opacus_rc``, and by this constructor) accounts for both randomized and
            exact clipping.
        secure_mode: Opacus' secure mode (CSPRNG noise and sampling); with randomized clipping
            the sketch generator is also reseeded from :mod:`secrets` after every step. Without
            it Opacus warns "Secure RNG turned off" (once per process); in a distributed run
            only rank 0 shows it (the rank of an initialised process group, else ``$RANK``),
            so that a run prints it once, not once per rank.

    Attributes:
        denoiser: The denoiser the last ``make_private(denoise=...)`` attached (e.g. a
            :class:`~opacus_rc.denoising.SpectralDenoiser`, whose ``last_report`` says what it
            did at the last step), or None.
        lora_update_guard: The :class:`~opacus_rc.lora.LoRAUpdateGuard` the last
            ``make_private(check_lora_update=True)`` attached, or None.
        mechanism: The :class:`~opacus_rc.mechanism.Mechanism` of the last successful
            ``make_private`` (or ``make_private_with_epsilon``) call, or None before one: the
            privacy unit, sampling rate, accounted rate, steps per epoch, divisor, ``C``,
            ``sigma``, sketch and threat model of every step, all from public inputs. The
            randomized-clipping optimizer holds the same record (``optimizer.mechanism``) and
            makes every step's DP event from it (``mechanism.step_event()``).

    Raises:
        ValueError: If the accountant name is not registered.
    """

    denoiser: Any = None
    lora_update_guard: LoRAUpdateGuard | None = None
    mechanism: Mechanism | None = None

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
        with _secure_rng_warning_on_rank_zero():
            super().__init__(accountant=accountant, secure_mode=secure_mode)

    # ------------------------------------------------------------------------------------------
    # Public API
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
        bookkeeping: bool | str = True,
        dataset_size: int | None = None,
        check_batch_independence: bool = True,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """Make the model, optimizer, criterion and data loader private.

        With ``clipping="randomized"`` the per-sample norms of ``nn.Linear`` layers are sketched
        (docs/privacy/estimators.md#estimators-hutchinson and #estimators-hutchpp), every other
        layer's norm is exact, samples are clipped with ``min(1, C / n_hat_i)`` and noised with
        ``N(0, sigma^2 C^2)``. Any other ``clipping`` is Opacus' own ``make_private`` with the same
        arguments and return value.

        Args:
            module: The model, in training mode.
            optimizer: The optimizer over ``module``'s parameters.
            criterion: The loss; must have ``reduction == loss_reduction``. Default
                ``nn.CrossEntropyLoss()``.
            data_loader: The training data loader.
            noise_multiplier: ``sigma`` (>= 0). ``0`` is a debugging run without noise: it
                warns (the run is not differentially private; its epsilon is infinite), and it
                is refused with a ``ValueError`` before any hook if the engine's accountant
                cannot record a step without noise.
            max_grad_norm: ``C`` (> 0; one float for randomized clipping).
            batch_first: Inputs are ``(B, ...)``.
            loss_reduction: ``"mean"`` or ``"sum"``.
            poisson_sampling: Replace the loader by a Poisson-sampling one (needed for the
                guarantee; False warns that the reported epsilon does not hold).
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
                (:data:`opacus_rc.denoising.DENOISERS`; ``"spectral"``: spectral denoising of
                every 2-D gradient, docs/denoising.md#denoising). ``None`` (default): no denoising.
                Works with every ``clipping`` and ``grad_sample_mode`` of a single process; never
                changes the accountant (post-processing,
                docs/denoising.md#denoising-post-processing). Afterwards the denoiser is
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
                modules that forced it; under DPDDP/DDP too, each rank's clipped sum being
                all-reduced once by the optimizer). Under activation checkpointing each
                ``nn.Linear`` then keeps the smaller of its per-sample gradients (its norm
                exact) and its input and output gradient
                (:class:`~opacus_rc.config.RandomizedClippingConfig`). ``"always"``: every
                layer keeps its input and output gradient, checkpointed or not. ``False``:
                always two backward passes. All give the same privacy guarantee (the probes
                are drawn in the first pass only; the same sketch spec is accounted);
                book-keeping is faster and frees the graph after the first pass. The
                module's ``bookkeeping`` property says which is used.
            dataset_size: The public number of records ``N`` (an integer >= 1), for the
                Poisson sampling rate ``q = 1 / ceil(N / B)`` of a loader of batch size ``B``
                (``floor`` with ``drop_last``; Poisson sampling only), or for the divisor
                ``int(N q)`` of a loader without ``batch_size`` (an Opacus ``DPDataLoader``,
                a custom ``batch_sampler``; for a
                :class:`~opacus_rc.units.UnitDataLoader` ``N`` is the public
                number of units). ``None`` (default): the rate of a loader with a
                ``batch_size`` comes from ``len(dataset)``, as Opacus, which makes the number
                of records public, and its divisor is ``B``; a loader without ``batch_size``
                then has no public divisor and is refused under ``loss_reduction="mean"``
                (unless a unit loader's ``expected_batch_size`` gives it). The divisor is never
                computed from ``len(dataset)`` or the number of units
                (docs/privacy/mechanism.md#mechanism-public).
            check_batch_independence: ``True`` (default): at the model's first training-mode
                forward (before anything is noised or accounted), a few records' outputs
                computed alone must equal their outputs inside the batch, each record cut to
                its real tokens where an ``attention_mask`` ``(B, T)`` is an input
                (:class:`~opacus_rc.batch_independence.BatchIndependenceCheck`; the cost: one
                extra forward of the batch and up to three of one record, once per run). A
                record whose output depends on the others (left padding with learned
                positions, a batch statistic, NEFTune) breaks the bound ``C`` on its influence,
                and raises :class:`~opacus_rc.batch_independence.BatchIndependenceError`.
                ``False``: no check (for a dependence you account for yourself).
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
            ValueError: A data loader over an ``IterableDataset`` or a dataset without
                ``len()`` (Poisson sampling needs a map-style dataset of known size); an
                invalid ``dataset_size``, or one with ``poisson_sampling=False`` and a loader
                with a ``batch_size``; under ``loss_reduction="mean"``, a loader without
                ``batch_size`` and no public divisor (neither ``dataset_size`` nor a unit
                loader's ``expected_batch_size``: it would come from the private number of
                records or units, Opacus #819), or a unit loader with both. Unknown
                sketch, ``sketch_dim < 1``, an accountant that cannot account
                for randomized clipping, an eval-mode model, a loss-reduction mismatch, sketch
                options without ``clipping="randomized"``, and the other invalid inputs listed
                in :class:`~opacus_rc.config.RandomizedClippingConfig` and
                :class:`GradSampleModuleRandomizedClipping`; ``noise_multiplier=0`` with an
                accountant that cannot record it; Opacus' own errors otherwise. Unknown
                ``denoise`` (the message lists the allowed names), ``denoise_kappa < 1``,
                denoiser options without ``denoise``, ``check_lora_update`` on a model without
                trainable LoRA adapters. ``bookkeeping=False`` without
                ``clipping="randomized"``.
            TypeError: Unknown keyword arguments with ``clipping="randomized"``; an unknown
                key in ``denoise_options``; a non-bool ``bookkeeping`` or
                ``check_batch_independence``.
            BatchIndependenceError: (a ``ValueError``, at the first training forward) A
                record's output depends on the other records of its batch (see
                ``check_batch_independence``).
            NotImplementedError: ``denoise`` with a distributed (DPDDP, DDP, FSDP) model.
        """
        options = MakePrivateOptions(
            module=module,
            optimizer=optimizer,
            criterion=criterion,
            data_loader=data_loader,
            max_grad_norm=max_grad_norm,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            poisson_sampling=poisson_sampling,
            clipping=clipping,
            noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode,
            wrap_model=wrap_model,
            rand_on_empty=rand_on_empty,
            sketch=sketch,
            sketch_dim=sketch_dim,
            sketch_head_dim=sketch_head_dim,
            sketch_generator=sketch_generator,
            denoise=denoise,
            denoise_kappa=denoise_kappa,
            denoise_options=denoise_options,
            check_lora_update=check_lora_update,
            bookkeeping=bookkeeping,
            dataset_size=dataset_size,
            check_batch_independence=check_batch_independence,
            kwargs=kwargs,
        )
        options = validate_options(  # called here: its warnings' stacklevel is the caller's line
            options, accountant=self.accountant, secure_mode=self.secure_mode
        )
        return self._make_private(options, noise_multiplier=noise_multiplier)

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
        rand_on_empty: bool = False,
        sketch: str | None = None,
        sketch_dim: int | None = None,
        sketch_head_dim: int | None = None,
        sketch_generator: torch.Generator | None = None,
        denoise: str | None = None,
        denoise_kappa: float | None = None,
        denoise_options: dict[str, Any] | None = None,
        check_lora_update: bool = False,
        bookkeeping: bool | str = True,
        dataset_size: int | None = None,
        check_batch_independence: bool = True,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """:meth:`make_private` with the noise multiplier found for a privacy budget.

        Takes every argument of :meth:`make_private` except ``noise_multiplier``. Everything is
        validated before the (slow) noise search. With ``clipping="randomized"`` the noise
        multiplier is searched with ``opacus_rc.accountants.get_noise_multiplier`` and this
        engine's accountant, for the exact :class:`~opacus_rc.sketching.SketchSpec` the module
        will use (so the search and the later ``get_epsilon`` agree). Other ``clipping`` values
        search as Opacus' ``make_private_with_epsilon`` does (Opacus' ``get_noise_multiplier``
        with this accountant's mechanism and ``**kwargs``).

        Args:
            target_epsilon: Target epsilon after ``epochs`` epochs.
            target_delta: Target delta.
            epochs: Number of epochs (``epochs / sample_rate`` steps) the search assumes: the
                training loop must run that many passes over the returned data loader.
            (others): As in :meth:`make_private`.

        Returns:
            As :meth:`make_private`.

        Raises:
            ValueError: As :meth:`make_private`, raised before the noise search; also if the
                search fails (the target is out of reach).
            TypeError, NotImplementedError: As :meth:`make_private`, before the search.
        """
        options = MakePrivateOptions(
            module=module,
            optimizer=optimizer,
            criterion=criterion,
            data_loader=data_loader,
            max_grad_norm=max_grad_norm,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            poisson_sampling=poisson_sampling,
            clipping=clipping,
            noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode,
            wrap_model=wrap_model,
            rand_on_empty=rand_on_empty,
            sketch=sketch,
            sketch_dim=sketch_dim,
            sketch_head_dim=sketch_head_dim,
            sketch_generator=sketch_generator,
            denoise=denoise,
            denoise_kappa=denoise_kappa,
            denoise_options=denoise_options,
            check_lora_update=check_lora_update,
            bookkeeping=bookkeeping,
            dataset_size=dataset_size,
            check_batch_independence=check_batch_independence,
            kwargs=kwargs,
        )
        options = validate_options(  # called here: its warnings' stacklevel is the caller's line
            options, accountant=self.accountant, secure_mode=self.secure_mode
        )
        noise_multiplier = search_noise_multiplier(
            self.accountant,
            options,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            epochs=epochs,
        )
        return self._make_private(options, noise_multiplier=noise_multiplier)

    # ------------------------------------------------------------------------------------------
    # The call, on its validated options
    # ------------------------------------------------------------------------------------------

    def _make_private(
        self, options: MakePrivateOptions, *, noise_multiplier: Any
    ) -> tuple[Any, ...]:
        """Opacus' ``make_private`` on validated options; undo everything if it raises."""
        config = options.config
        if config is not None:
            noise_multiplier = validate_noise_multiplier(noise_multiplier)
        check_zero_noise(self.accountant, options, noise_multiplier)
        module = options.module
        had_hooks = hasattr(module, "autograd_grad_sample_hooks")
        previous_dataset = self.dataset
        # The run's mechanism, built once from the validated options and the noise multiplier:
        # the seams sample at its rate, the optimizer divides, noises and accounts from it.
        mechanism = Mechanism(
            sizes=options.sizes,
            max_grad_norm=options.max_grad_norm if config is None else config.max_grad_norm,
            noise_multiplier=noise_multiplier,
            sketch_spec=None if config is None else config.sketch_spec,
        )
        # For the seams, during Opacus' template only (it passes them neither option).
        self._config, self._grad_sample_module, self._mechanism = config, None, mechanism
        try:
            with warnings.catch_warnings():
                # The module warns about a passed sketch generator, and the accountant would
                # log it again at the first step; one warning below says both, at the caller.
                warnings.filterwarnings("ignore", message=_GENERATOR_WARNING_PREFIX)
                out = super().make_private(
                    noise_multiplier=noise_multiplier,
                    **options.opacus_options(),
                    **options.kwargs,
                )
            grad_sample_module = self._grad_sample_module
        except BaseException:
            if self._grad_sample_module is not None:
                self._grad_sample_module.cleanup()
            if not had_hooks:
                strip_grad_sample_hooks(module)
            self.dataset = previous_dataset
            raise
        finally:
            self._config, self._grad_sample_module, self._mechanism = None, None, None
        self.mechanism = mechanism
        if isinstance(options.data_loader, UnitDataLoader):
            # Opacus' template accounts at 1 / len(loader), the loader's ``steps``; the units
            # are drawn at its sample rate, the mechanism's accounted rate: the accountant
            # records that.
            out[1].attach_step_hook(
                self.accountant.get_optimizer_hook_fn(sample_rate=mechanism.accounted_rate)
            )
        if config is not None and config.sketch_generator is not None:
            warnings.warn(
                f"{_GENERATOR_WARNING_PREFIX}: the 'hidden' privacy guarantee of randomized "
                "clipping holds only if its seed stays secret, so the sketch spec has "
                "secret=False and the accountant uses the more conservative 'revealed' threat "
                "model for every step (a larger epsilon); pass sketch_generator=None for a "
                "secret sketch seeded from the operating system",
                UserWarning,
                stacklevel=3,
            )
            mark = getattr(self.accountant, "mark_revealed_warning_given", None)
            if callable(mark):
                mark()
        if config is not None:
            logger.info(
                "randomized clipping: %s, sample_rate=%.6g, bookkeeping=%s",
                config.sketch_spec,
                mechanism.accounted_rate,
                grad_sample_module.bookkeeping,
            )
        if options.check_batch_independence and callable(getattr(out[0], "disable_hooks", None)):
            # At the first training forward; its handle goes with the hooks (cleanup()).
            check = BatchIndependenceCheck(module, hooks=out[0], batch_first=options.batch_first)
            out[0].autograd_grad_sample_hooks.append(check.handle)
            out[0].batch_independence_check = check
        if config is not None and callable(getattr(out[0], "disable_hooks", None)):
            # The criterion's record_ids= checks packed batches' attention with it.
            guard = PackedAttentionGuard(
                module, hooks=out[0], full_check=options.check_batch_independence
            )
            out[0].autograd_grad_sample_hooks.append(guard.handle)
            out[0].packed_attention_guard = guard
        return attach_post_processing(
            self,
            out,
            denoiser=options.denoiser,
            lora_guard=options.lora_guard,
            module=module,
            dataset=previous_dataset,
        )
