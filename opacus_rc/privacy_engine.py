"""``PrivacyEngine`` with randomized clipping (docs/architecture.md#architecture-seams).

:class:`PrivacyEngine` subclasses ``opacus.PrivacyEngine`` and runs Opacus' own
``make_private`` template for every ``clipping`` value. For ``clipping="randomized"`` it fills
Opacus' seams (docs/architecture.md#architecture-seams):

* ``prepare_model_seam`` (Opacus' ``_prepare_model``, forwarded by
  :class:`~opacus_rc._compat.opacus.PrivacyEngineSeams`) builds a
  :class:`~opacus_rc.grad_sample.GradSampleModuleRandomizedClipping` (or its hooks-only twin for
  ``wrap_model=False``);
* ``prepare_data_loader_seam`` is Opacus' (Poisson sampling), except that a distributed model
  gets :class:`~opacus_rc.data_loader.DistributedDPDataLoader`, which keeps empty per-rank
  batches;
* ``prepare_optimizer_seam`` builds the optimizer registered for
  ``("randomized", distributed)`` in :mod:`opacus_rc.optimizers.registry`
  (:class:`~opacus_rc.optimizers.RandomizedClipOptimizer` or its DDP or FSDP2 variant; an
  FSDP2 model also gets
  :class:`~opacus_rc.grad_sample.fsdp.GradSampleModuleRandomizedClippingFSDP`);
* ``prepare_criterion_seam`` builds :class:`~opacus_rc.optimizers.DPLossRandomizedClipping` (one
  backward pass with book-keeping where the model allows it, else two).

Opacus ties the accountant's step hook to the optimizer. Every option of randomized clipping is
validated once, by the :class:`~opacus_rc.config.RandomizedClippingConfig` built at the start of
the call, and that one object configures the module and the optimizer.

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

import copy
import importlib
import logging
import math
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from opacus.accountants.utils import get_noise_multiplier as opacus_get_noise_multiplier
from opacus.data_loader import DPDataLoader
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel
from opacus.grad_sample.gsm_base import AbstractGradSampleModule
from opacus.optimizers import DPOptimizer
from opacus.utils.uniform_sampler import (
    DistributedUniformWithReplacementSampler,
    UniformWithReplacementSampler,
)
from torch import nn, optim
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from opacus_rc._compat.opacus import PrivacyEngineSeams, wrapped_module_if_built
from opacus_rc.config import (
    DEFAULT_SKETCH,
    DEFAULT_SKETCH_DIM,
    RandomizedClippingConfig,
    validate_noise_multiplier,
)
from opacus_rc.data_loader import DistributedDPDataLoader, RandomOnEmptyCollate, worker_options
from opacus_rc.denoising import make_denoiser
from opacus_rc.grad_sample import (
    GradSampleHooksRandomizedClipping,
    GradSampleModuleRandomizedClipping,
)
from opacus_rc.grad_sample.fsdp import (
    GradSampleHooksRandomizedClippingFSDP,
    GradSampleModuleRandomizedClippingFSDP,
)
from opacus_rc.grad_sample.grad_sample_module import (
    check_training_mode,
    strip_grad_sample_hooks,
)
from opacus_rc.lora import LoRAUpdateGuard
from opacus_rc.optimizers import DPLossRandomizedClipping
from opacus_rc.optimizers.post_processing import attach_post_processing_hook
from opacus_rc.optimizers.registry import get_optimizer_class
from opacus_rc.unit_data_loader import UnitDataLoader, prepare_unit_data_loader

__all__ = ["PrivacyEngine"]

logger = logging.getLogger(__name__)

#: ``poisson_sampling=False``: the accountant still assumes Poisson sampling at rate
#: ``1 / len(data_loader)``, which fixed or shuffled batches do not give (Chua et al., "How
#: Private are DP-SGD Implementations?", ICML 2024: shuffling can leak far more than the
#: Poisson epsilon). Opacus accepts it silently (meta-pytorch/opacus PR 745).
_NO_POISSON_WARNING = (
    "poisson_sampling=False: the data loader's batches are not Poisson samples, but the "
    "accountant's epsilon assumes Poisson sampling at rate 1/len(data_loader); for fixed or "
    "shuffled batches it is not a valid guarantee. Keep poisson_sampling=True for a private "
    "run (use BatchMemoryManager to bound the physical batch size)"
)

#: Start of the one warning given when a ``sketch_generator`` is passed (filters match it).
_GENERATOR_WARNING_PREFIX = "a sketch_generator was passed"

_ACCOUNTANT_ERROR = (
    "clipping='randomized' needs an accountant that can account for sketched norms; "
    "use accountant='rc'"
)
_RANDOMIZED_GRAD_SAMPLE_MODES = ("hooks", "ghost")
#: Parameters of the public ``make_private*`` methods that are not shared options.
_NOT_SHARED = frozenset({"self", "noise_multiplier", "target_epsilon", "target_delta", "epochs"})
#: Delta at which a noiseless probe step must report an infinite epsilon.
_PROBE_DELTA = 1e-5


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


@dataclass(frozen=True)
class _Request:
    """The validated options of one ``make_private`` or ``make_private_with_epsilon`` call.

    Attributes:
        opacus_options: Keyword arguments of ``opacus.PrivacyEngine.make_private`` except
            ``noise_multiplier`` (the criterion defaulted). For randomized clipping,
            ``grad_sample_mode`` is ``"ghost"``: Opacus then builds the criterion and returns
            four values; the module itself is built by :meth:`PrivacyEngine.prepare_model_seam`.
        kwargs: Further keyword arguments for Opacus (always empty for randomized clipping).
        config: The randomized-clipping configuration, or None for Opacus' own clipping.
        post: The post-processing to attach.
        sizes: The sampling rate and divisor, from public inputs.
    """

    opacus_options: dict[str, Any]
    kwargs: dict[str, Any]
    config: RandomizedClippingConfig | None
    post: _PostProcessing
    sizes: _PublicSizes


@dataclass
class _RandomizedBuild:
    """State shared by the ``prepare_*_seam`` methods during one randomized ``make_private``.

    Opacus' ``make_private`` passes ``_prepare_model`` neither ``clipping`` nor ``**kwargs`` (its
    call passes ``batch_first``, ``max_grad_norm``, ``loss_reduction`` and ``grad_sample_mode``),
    so the configuration reaches the seams through this object, set on the engine for the
    duration of the call only.

    Attributes:
        config: The configuration of this call.
        module: The grad-sample module once ``prepare_model_seam`` has built it.
    """

    config: RandomizedClippingConfig
    module: Any = None


def _shared_options(call_locals: dict[str, Any]) -> dict[str, Any]:
    """The options a public ``make_private*`` method shares, from its ``locals()``.

    Called first thing, so ``locals()`` holds exactly the method's parameters; this is what
    keeps ``make_private`` and ``make_private_with_epsilon`` from listing the same keyword
    arguments twice.
    """
    return {name: value for name, value in call_locals.items() if name not in _NOT_SHARED}


#: Samplers that draw every record uniformly: Opacus' Poisson sampler replaces them without a
#: change of what the loader's weighting means (a ``DistributedSampler`` shards uniformly too).
_UNIFORM_SAMPLERS = (SequentialSampler, RandomSampler, DistributedSampler)
#: Batch samplers Opacus replaces by Poisson sampling as the loader's own (``BatchSampler``) or
#: keeps as Poisson samplers already.
_KNOWN_BATCH_SAMPLERS = (
    BatchSampler,
    UniformWithReplacementSampler,
    DistributedUniformWithReplacementSampler,
)


def _check_data_loader(data_loader: Any, *, poisson_sampling: bool) -> None:
    """Refuse a loader Poisson sampling (or the accountant) cannot use; warn on a replaced sampler.

    Poisson sampling includes every record independently with probability ``q`` (the
    accountant's model): it needs a map-style dataset of known size ``N`` (records by index,
    ``len(dataset)``), and it replaces the loader's sampler (Opacus does it silently).

    Raises:
        TypeError: If ``data_loader`` is not a ``DataLoader``.
        ValueError: If its dataset is an ``IterableDataset``, or has no ``len()``.
    """
    if not isinstance(data_loader, DataLoader):
        raise TypeError(
            f"data_loader must be a torch.utils.data.DataLoader, got {type(data_loader).__name__}"
        )
    dataset = data_loader.dataset
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            f"the data loader's dataset is an IterableDataset ({type(dataset).__name__}): "
            "Poisson sampling, which the privacy guarantee assumes, includes every record "
            "independently with probability q, so it needs a map-style dataset of known size "
            "(a torch.utils.data.Dataset with __len__ and __getitem__). Materialise the "
            "stream first (e.g. a Hugging Face datasets.Dataset instead of streaming=True / "
            "IterableDataset, or a list of its records)"
        )
    try:
        len(dataset)  # type: ignore[arg-type]
    except TypeError as err:
        raise ValueError(
            f"the data loader's dataset ({type(dataset).__name__}) has no len(): Poisson "
            "sampling and the sampling rate q need a map-style dataset of known size "
            "(define __len__)"
        ) from err
    if not poisson_sampling or isinstance(data_loader, (DPDataLoader, UnitDataLoader)):
        return
    batch_sampler = data_loader.batch_sampler
    if not isinstance(batch_sampler, _KNOWN_BATCH_SAMPLERS):
        replaced = f"batch_sampler {type(batch_sampler).__name__}"
    elif isinstance(batch_sampler, BatchSampler) and not isinstance(
        batch_sampler.sampler, _UNIFORM_SAMPLERS
    ):
        replaced = f"sampler {type(batch_sampler.sampler).__name__}"
    else:
        return
    warnings.warn(
        f"the data loader's {replaced} is replaced by Poisson sampling (every record "
        "included independently with the same probability q), which the privacy guarantee "
        "assumes: its weighting or order is not used. Sampling with unequal probabilities "
        "is not what the accountant analyses. To reweight records, weight each sample's loss "
        "instead (the per-sample gradient is clipped after weighting); pass a plain "
        "DataLoader(dataset, batch_size=B) to silence this warning",
        UserWarning,
        stacklevel=4,
    )


@dataclass(frozen=True)
class _PublicSizes:
    """The sizes the mechanism uses, computed from public inputs only (docs/privacy/mechanism.md).

    Attributes:
        sample_rate: ``q``, the Poisson rate the loader samples at; an epoch is ``int(1 / q)``
            steps, each accounted at ``1 / int(1 / q)`` (Opacus' ``1 / len(loader)``, at least
            ``q``: see :func:`_accounted_schedule`).
        expected_batch_size: The divisor of the noisy sum under ``loss_reduction="mean"`` (per
            process: divided by the world size in a distributed run, as Opacus does).
    """

    sample_rate: float
    expected_batch_size: int


def _public_sizes(data_loader: DataLoader, *, dataset_size: int | None) -> _PublicSizes:
    """Sampling rate and divisor from public inputs (Opacus #819, #571).

    Opacus computes ``q = 1 / len(data_loader)`` and divides by ``int(len(dataset) * q)``: the
    divisor is a function of the private number of records ``N`` (neighbours ``N = 12`` and
    ``N = 11`` at batch size 4 get the same ``q`` but divisors 4 and 3). Here:

    * a loader with a ``batch_size`` ``B`` (the usual ``DataLoader(dataset, batch_size=B)``):
      the divisor is ``B`` itself, and ``q = 1 / n`` with ``n = ceil(N' / B)`` batches
      (``floor`` with ``drop_last=True``, as ``len(DataLoader)``), ``N' = dataset_size`` if
      given, else ``len(dataset)`` (Opacus' rate);
    * a loader without one (an Opacus ``DPDataLoader``, a custom ``batch_sampler``):
      ``q = 1 / len(data_loader)`` (for a ``DPDataLoader``, ``1 / int(1 / its sample_rate)``)
      and the divisor ``int(N' q)``, as Opacus. For a
      :class:`~opacus_rc.unit_data_loader.UnitDataLoader` the records are the units:
      ``N'`` is ``dataset_size`` if given, else the number of units.

    Args:
        data_loader: The user's (map-style) data loader.
        dataset_size: The public number of records ``N'``, or None.

    Returns:
        The sizes.

    Raises:
        ValueError: If the data loader (or ``dataset_size``) gives no batch, or
            ``dataset_size`` is not an integer >= 1.
    """
    if dataset_size is not None and (
        isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size < 1
    ):
        raise ValueError(f"dataset_size must be an integer >= 1, got {dataset_size!r}")
    batch_size = data_loader.batch_size
    if batch_size is not None and dataset_size is not None:
        n_batches = (
            dataset_size // batch_size
            if data_loader.drop_last
            else math.ceil(dataset_size / batch_size)
        )
    else:
        n_batches = len(data_loader)
    if n_batches == 0:
        raise ValueError(
            "the data loader is empty"
            if dataset_size is None
            else f"dataset_size={dataset_size} gives no batch of batch_size={batch_size} "
            "with drop_last=True"
        )
    sample_rate = 1 / n_batches
    if batch_size is not None:
        return _PublicSizes(sample_rate, batch_size)
    if dataset_size is not None:
        size = dataset_size
    elif isinstance(data_loader, UnitDataLoader):
        size = data_loader.num_units  # unit-level DP: the records are the units
    else:
        size = len(data_loader.dataset)  # type: ignore[arg-type]
    return _PublicSizes(sample_rate, int(size * sample_rate))


def _accounted_schedule(
    sizes: _PublicSizes, *, data_loader: DataLoader, poisson_sampling: bool
) -> tuple[float, int]:
    """The rate the accountant records and the steps of one epoch, before the loader exists.

    Opacus accounts each step at ``1 / len(loader)`` of the loader the run iterates. A Poisson
    loader built at rate ``q`` (Opacus' ``DPDataLoader``, :class:`DistributedDPDataLoader`)
    has ``int(1 / q)`` batches, one short of ``1 / q`` for some ``q`` in floating point
    (``q = 1/93``: 92); a loader used as it is (a :class:`UnitDataLoader`, or
    ``poisson_sampling=False``) has ``len(data_loader)``.

    Args:
        sizes: The public sizes of the run.
        data_loader: The user's data loader.
        poisson_sampling: Whether the engine builds a Poisson loader.

    Returns:
        ``(1 / n, n)`` with ``n`` the batches per epoch.
    """
    if isinstance(data_loader, UnitDataLoader) or not poisson_sampling:
        per_epoch = len(data_loader)
    else:
        per_epoch = max(1, int(1 / sizes.sample_rate))
    return 1 / per_epoch, per_epoch


def _poisson_loader(
    loader_class: type[DPDataLoader],
    data_loader: DataLoader,
    *,
    sample_rate: float,
    distributed: bool,
    generator: torch.Generator | None,
    batch_first: bool,
    rand_on_empty: bool,
) -> DPDataLoader:
    """Opacus' ``DPDataLoader.from_data_loader`` (opacus 1.6) at a given ``sample_rate``.

    ``from_data_loader`` always samples at ``1 / len(data_loader)``; everything else (workers,
    collate function, generator: ``generator`` or the loader's) is carried over as it does.
    """
    return loader_class(
        dataset=data_loader.dataset,
        sample_rate=sample_rate,
        **worker_options(data_loader),
        drop_last=data_loader.drop_last,
        generator=generator if generator else data_loader.generator,
        distributed=distributed,
        batch_first=batch_first,
        rand_on_empty=rand_on_empty,
    )


class PrivacyEngine(PrivacyEngineSeams):
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
    _build: _RandomizedBuild | None = None
    _sizes: _PublicSizes | None = None

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
                (:mod:`opacus_rc.denoising.registry`; ``"spectral"``: spectral denoising of
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
                (``floor`` with ``drop_last``), or for the divisor ``int(N q)`` of a loader
                without ``batch_size`` (an Opacus ``DPDataLoader``). ``None`` (default):
                ``len(dataset)``, as Opacus, which makes the number of records public. The
                divisor of a loader with a ``batch_size`` is ``B`` in both cases, never
                computed from ``len(dataset)`` (docs/privacy/mechanism.md#mechanism-public).
                Poisson sampling only.
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
                invalid ``dataset_size``, or one with ``poisson_sampling=False``. Unknown
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
                key in ``denoise_options``; a non-bool ``bookkeeping``.
            NotImplementedError: ``denoise`` with a distributed (DPDDP, DDP, FSDP) model.
        """
        request = self._request(**_shared_options(locals()))
        return self._make_private(request, noise_multiplier=noise_multiplier)

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
        request = self._request(**_shared_options(locals()))
        noise_multiplier = self._search_noise_multiplier(
            request, target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs
        )
        return self._make_private(request, noise_multiplier=noise_multiplier)

    # ------------------------------------------------------------------------------------------
    # Opacus' seams
    # ------------------------------------------------------------------------------------------

    def prepare_model_seam(
        self,
        module: nn.Module,
        *,
        batch_first: bool = True,
        max_grad_norm: float | list[float] = 1.0,
        loss_reduction: str = "mean",
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
    ) -> Any:
        """Opacus' seam; for randomized clipping, the module built from the configuration."""
        build = self._build
        if build is None:
            return super().prepare_model_seam(
                module,
                batch_first=batch_first,
                max_grad_norm=max_grad_norm,
                loss_reduction=loss_reduction,
                grad_sample_mode=grad_sample_mode,
                wrap_model=wrap_model,
            )
        # The module checks this too, but Opacus' validator would first reject an eval-mode
        # model with a message that does not say what to do.
        check_training_mode(module)
        self.validate(module=module, optimizer=None, data_loader=None)
        if isinstance(module, FSDPModule):
            module_class = (
                GradSampleModuleRandomizedClippingFSDP
                if wrap_model
                else GradSampleHooksRandomizedClippingFSDP
            )
        else:
            module_class = (
                GradSampleModuleRandomizedClipping
                if wrap_model
                else GradSampleHooksRandomizedClipping
            )
        build.module = module_class(module, config=build.config)
        return build.module

    def prepare_data_loader_seam(
        self,
        data_loader: DataLoader,
        *,
        poisson_sampling: bool,
        distributed: bool,
        batch_first: bool = True,
        rand_on_empty: bool = False,
    ) -> DataLoader:
        """Opacus' seam: Poisson sampling at the public rate of :func:`_public_sizes`.

        Opacus samples at ``1 / len(data_loader)``, which is that rate unless a public
        ``dataset_size`` was given; then the loader is built at the public rate instead. A
        distributed randomized run gets :class:`DistributedDPDataLoader`: Opacus' distributed
        Poisson sampler drops a rank's empty batch, so that rank runs one step less (its
        all-reduces misalign, its accountant counts fewer steps);
        :class:`DistributedDPDataLoader` yields it as a noise-only step. A
        :class:`~opacus_rc.unit_data_loader.UnitDataLoader` (unit-level DP) is used as it is.
        """
        if isinstance(data_loader, UnitDataLoader):
            return prepare_unit_data_loader(
                data_loader,
                engine=self,
                distributed=distributed,
                randomized=self._build is not None,
            )
        sizes = self._sizes
        own_rate = (
            poisson_sampling and sizes is not None and sizes.sample_rate != 1 / len(data_loader)
        )
        own_distributed = self._build is not None and distributed and poisson_sampling
        if not (own_rate or own_distributed):
            loader = super().prepare_data_loader_seam(
                data_loader,
                poisson_sampling=poisson_sampling,
                distributed=distributed,
                batch_first=batch_first,
                rand_on_empty=rand_on_empty,
            )
        else:
            # Opacus' method without sampling: it records (or checks) the engine's dataset.
            super().prepare_data_loader_seam(
                data_loader,
                poisson_sampling=False,
                distributed=distributed,
                batch_first=batch_first,
                rand_on_empty=rand_on_empty,
            )
            loader = _poisson_loader(
                DistributedDPDataLoader if own_distributed else DPDataLoader,
                data_loader,
                sample_rate=1 / len(data_loader) if sizes is None else sizes.sample_rate,
                distributed=distributed,
                generator=self.secure_rng,
                batch_first=batch_first,
                rand_on_empty=rand_on_empty,
            )
        if (
            self._build is not None
            and rand_on_empty
            and isinstance(loader, DPDataLoader)
            and not isinstance(loader, DistributedDPDataLoader)
        ):
            # Opacus' wrapper returns B = 0 for an empty batch before the first non-empty
            # one even with rand_on_empty; ours honours it from the first batch on.
            loader.collate_fn = RandomOnEmptyCollate(
                collate_fn=loader.collate_fn.wrapped_collator_fn,
                dataset=loader.dataset,
                batch_first=batch_first,
                rand_on_empty=True,
            )
        return loader

    def prepare_optimizer_seam(
        self,
        *,
        optimizer: optim.Optimizer,
        noise_multiplier: float,
        max_grad_norm: float | list[float],
        expected_batch_size: int,
        loss_reduction: str = "mean",
        distributed: bool = False,
        clipping: str = "flat",
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        **kwargs: Any,
    ) -> DPOptimizer:
        """Opacus' seam; for randomized clipping, the registry's optimizer for the module.

        Opacus passes ``int(len(dataset) * q)`` as ``expected_batch_size``: a function of the
        private number of records. The divisor used is the public one of
        :func:`_public_sizes` (per process in a distributed run, as Opacus).
        """
        if self._sizes is not None:
            expected_batch_size = self._sizes.expected_batch_size
            if distributed:
                expected_batch_size /= torch.distributed.get_world_size()
        build = self._build
        if build is None:
            return super().prepare_optimizer_seam(
                optimizer=optimizer,
                noise_multiplier=noise_multiplier,
                max_grad_norm=max_grad_norm,
                expected_batch_size=expected_batch_size,
                loss_reduction=loss_reduction,
                distributed=distributed,
                clipping=clipping,
                noise_generator=noise_generator,
                grad_sample_mode=grad_sample_mode,
                **kwargs,
            )
        if isinstance(optimizer, DPOptimizer):
            optimizer = optimizer.original_optimizer
        sharded = isinstance(wrapped_module_if_built(build.module), FSDPModule)
        optimizer_class = get_optimizer_class(
            clipping, distributed="fsdp" if sharded else distributed
        )
        return optimizer_class(
            optimizer,
            grad_sample_module=build.module,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            generator=self.secure_rng if self.secure_mode else noise_generator,
            secure_mode=build.config.secure_mode,
        )

    def prepare_criterion_seam(
        self,
        *,
        module: Any,
        optimizer: DPOptimizer,
        criterion: Any,
        loss_reduction: str = "mean",
        **kwargs: Any,
    ) -> Any:
        """Opacus' seam; for randomized clipping, :class:`DPLossRandomizedClipping`."""
        if self._build is None:
            return super().prepare_criterion_seam(
                module=module,
                optimizer=optimizer,
                criterion=criterion,
                loss_reduction=loss_reduction,
                **kwargs,
            )
        return DPLossRandomizedClipping(module, optimizer, criterion, loss_reduction)

    # ------------------------------------------------------------------------------------------
    # Helpers
    # ------------------------------------------------------------------------------------------

    def _request(
        self,
        *,
        sketch: str | None,
        sketch_dim: int | None,
        sketch_head_dim: int | None,
        sketch_generator: torch.Generator | None,
        bookkeeping: bool,
        denoise: str | None,
        denoise_kappa: float | None,
        denoise_options: dict[str, Any] | None,
        check_lora_update: bool,
        dataset_size: int | None,
        kwargs: dict[str, Any],
        **opacus_options: Any,
    ) -> _Request:
        """Validate one call's options (attaching nothing) and build its configuration."""
        module = opacus_options["module"]
        data_loader = opacus_options["data_loader"]
        _check_data_loader(data_loader, poisson_sampling=opacus_options["poisson_sampling"])
        if dataset_size is not None and not opacus_options["poisson_sampling"]:
            raise ValueError(
                "dataset_size sets the Poisson sampling rate; it needs poisson_sampling=True"
            )
        sizes = _public_sizes(data_loader, dataset_size=dataset_size)  # refuses an empty loader
        post = self._prepare_post_processing(
            module=module,
            grad_sample_mode=opacus_options["grad_sample_mode"],
            denoise=denoise,
            denoise_kappa=denoise_kappa,
            denoise_options=denoise_options,
            check_lora_update=check_lora_update,
        )
        if opacus_options["criterion"] is None:
            opacus_options["criterion"] = nn.CrossEntropyLoss()
        if not opacus_options["poisson_sampling"] and not isinstance(
            opacus_options.get("data_loader"), (DPDataLoader, UnitDataLoader)
        ):
            # An Opacus DPDataLoader (ours included) already draws Poisson batches; Opacus then
            # accounts at rate 1 / len(loader) = 1 / floor(1 / q) >= q, which is conservative.
            warnings.warn(_NO_POISSON_WARNING, UserWarning, stacklevel=3)
        clipping = opacus_options["clipping"]
        if clipping != "randomized":
            if any(o is not None for o in (sketch, sketch_dim, sketch_head_dim, sketch_generator)):
                raise ValueError(
                    "sketch, sketch_dim, sketch_head_dim and sketch_generator only apply to "
                    f"clipping='randomized' (got clipping={clipping!r})"
                )
            if bookkeeping is not True:
                raise ValueError(
                    f"bookkeeping only applies to clipping='randomized' (got clipping={clipping!r})"
                )
            return _Request(opacus_options, dict(kwargs), None, post, sizes)

        if kwargs:
            raise TypeError(
                f"unexpected keyword arguments for clipping='randomized': {sorted(kwargs)}"
            )
        if not getattr(type(self.accountant), "supports_randomized_clipping", False):
            raise ValueError(_ACCOUNTANT_ERROR)
        config = RandomizedClippingConfig(
            max_grad_norm=opacus_options["max_grad_norm"],
            sketch=DEFAULT_SKETCH if sketch is None else sketch,
            sketch_dim=DEFAULT_SKETCH_DIM if sketch_dim is None else sketch_dim,
            sketch_head_dim=sketch_head_dim,
            sketch_generator=sketch_generator,
            secure_mode=self.secure_mode,
            batch_first=opacus_options["batch_first"],
            loss_reduction=opacus_options["loss_reduction"],
            bookkeeping=bookkeeping,
        )
        criterion_reduction = getattr(opacus_options["criterion"], "reduction", None)
        if criterion_reduction is not None and criterion_reduction != config.loss_reduction:
            raise ValueError(
                f"the criterion has reduction={criterion_reduction!r} but "
                f"loss_reduction={config.loss_reduction!r}; they must match"
            )
        grad_sample_mode = opacus_options["grad_sample_mode"]
        if grad_sample_mode not in _RANDOMIZED_GRAD_SAMPLE_MODES:
            raise ValueError(
                f"clipping='randomized' uses its own grad-sample module; grad_sample_mode must "
                f"be one of {_RANDOMIZED_GRAD_SAMPLE_MODES}, got {grad_sample_mode!r}"
            )
        # Opacus builds the DP criterion (and returns four values) only for "ghost" modes.
        opacus_options["grad_sample_mode"] = "ghost"
        return _Request(opacus_options, {}, config, post, sizes)

    def _make_private(self, request: _Request, *, noise_multiplier: Any) -> tuple[Any, ...]:
        """Opacus' ``make_private`` on a validated request; undo everything if it raises."""
        if request.config is not None:
            noise_multiplier = validate_noise_multiplier(noise_multiplier)
        self._check_zero_noise(request, noise_multiplier)
        module = request.opacus_options["module"]
        had_hooks = hasattr(module, "autograd_grad_sample_hooks")
        previous_dataset = self.dataset
        build = None if request.config is None else _RandomizedBuild(request.config)
        self._build = build
        self._sizes = request.sizes
        try:
            with warnings.catch_warnings():
                # The module warns about a passed sketch generator, and the accountant would
                # log it again at the first step; one warning below says both, at the caller.
                warnings.filterwarnings("ignore", message=_GENERATOR_WARNING_PREFIX)
                out = super().make_private(
                    noise_multiplier=noise_multiplier, **request.opacus_options, **request.kwargs
                )
        except BaseException:
            if build is not None and build.module is not None:
                build.module.cleanup()
            if not had_hooks:
                strip_grad_sample_hooks(module)
            self.dataset = previous_dataset
            raise
        finally:
            self._build = None
            self._sizes = None
        if build is not None and build.config.sketch_generator is not None:
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
        if build is not None:
            logger.info(
                "randomized clipping: %s, sample_rate=%.6g, bookkeeping=%s",
                build.config.sketch_spec,
                1 / len(out[-1]),
                build.module.bookkeeping,
            )
        return self._attach_post_processing(out, request.post, module=module)

    def _check_zero_noise(self, request: _Request, noise_multiplier: Any) -> None:
        """``noise_multiplier=0``: refuse it unless the accountant records it; then warn once.

        A noise multiplier in ``(0, 0.01)`` with the RC accountant is refused too: the
        accountant records it but computes no epsilon for it (it would fail after the run).

        The accountant decides whether a step can be accounted, so it is asked with a probe: a
        copy of it records one noiseless step through its optimizer hook (as every real step
        would) and must then report an infinite epsilon. An accountant that refuses the step
        (today's ``RCAccountant``) would make every ``optimizer.step()`` raise, and one that
        reports a finite epsilon for a run without noise would claim a guarantee that does not
        hold: both are refused here, before any hook is attached.

        Raises:
            ValueError: As described, saying what to do.
        """
        try:
            sigma = float(noise_multiplier)
        except (TypeError, ValueError):
            return  # Opacus' concern (non-numeric noise multipliers are not checked here)
        if self.accountant.mechanism() == "rc" and sigma > 0.0:
            # Looked up at call time (the accountants are imported lazily, see __init__).
            smallest = importlib.import_module(
                "opacus_rc.accountants.analysis.epsilon"
            ).MIN_NOISE_MULTIPLIER
            if sigma < smallest:
                # The accountant records such a step but cannot compute its epsilon: refused
                # here, not after the run at get_epsilon.
                raise ValueError(
                    f"noise_multiplier={sigma:.3g} is outside the range the RC accountant "
                    f"computes epsilon for: noise_multiplier must be >= {smallest} (or 0, a "
                    "debugging run without noise, accounted at epsilon = inf). Below it "
                    "epsilon is far beyond any useful budget; use a larger noise multiplier."
                )
        if sigma != 0.0:
            return
        mechanism = self.accountant.mechanism()
        sample_rate = request.sizes.sample_rate
        probe = copy.deepcopy(self.accountant)
        probe.history = []
        step = SimpleNamespace(noise_multiplier=0.0, accumulated_iterations=1)
        if request.config is not None:
            step.sketch_spec = request.config.sketch_spec
        with warnings.catch_warnings():  # the probe's own warnings are not the user's concern
            warnings.simplefilter("ignore")
            try:
                probe.get_optimizer_hook_fn(sample_rate=sample_rate)(step)
            except Exception as err:
                raise ValueError(
                    f"noise_multiplier=0: the {mechanism!r} accountant cannot record a step "
                    f"without noise ({type(err).__name__}: {err}), so every optimizer step "
                    "would fail. Pass a noise_multiplier > 0, or, for a debugging run without "
                    "noise, an accountant that records sigma = 0 with an infinite epsilon."
                ) from err
            try:
                epsilon = float(probe.get_epsilon(_PROBE_DELTA))
            except Exception:  # noqa: BLE001 - no epsilon at all is not a false claim
                epsilon = math.inf
        if math.isfinite(epsilon):
            raise ValueError(
                f"noise_multiplier=0: the {mechanism!r} accountant reports a finite epsilon "
                f"({epsilon:g} at delta={_PROBE_DELTA:g}) for a step without noise, whose "
                "epsilon is infinite; pass a noise_multiplier > 0"
            )
        warnings.warn(
            "noise_multiplier=0: no noise is added, so this run is not differentially private "
            "and its epsilon is infinite; use it for debugging only",
            UserWarning,
            stacklevel=4,
        )

    def _search_noise_multiplier(
        self, request: _Request, *, target_epsilon: float, target_delta: float, epochs: int
    ) -> float:
        """The noise multiplier reaching ``(target_epsilon, target_delta)`` after ``epochs``.

        Searched at the schedule the run will have (:func:`_accounted_schedule`), not at ``q``
        and ``int(epochs / q)``: for some ``q`` an epoch is one step short of ``1 / q`` and
        the accountant records the larger rate ``1 / int(1 / q)`` (``q = 1/93``: 92 steps at
        ``1/92``), which would end the run above the target.
        """
        sample_rate, per_epoch = _accounted_schedule(
            request.sizes,
            data_loader=request.opacus_options["data_loader"],
            poisson_sampling=request.opacus_options["poisson_sampling"],
        )
        schedule: dict[str, Any] = {"epochs": epochs, "steps": None}
        if isinstance(epochs, (int, float)) and 0 < epochs < math.inf:
            schedule = {"epochs": None, "steps": max(1, int(epochs * per_epoch))}
        if len(self.accountant) > 0:
            warnings.warn(
                "make_private_with_epsilon is called with privacy budget already spent; the "
                "noise multiplier assumes a zero starting point, so the total epsilon will be "
                "higher than the target",
                UserWarning,
                stacklevel=3,
            )
        if request.config is None:
            # Opacus' make_private_with_epsilon, including where it sends **kwargs.
            return opacus_get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=target_delta,
                sample_rate=sample_rate,
                **schedule,
                accountant=self.accountant.mechanism(),
                **request.kwargs,
            )
        # Looked up at call time (the package is imported lazily, see __init__).
        accountants = importlib.import_module("opacus_rc.accountants")
        return accountants.get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=sample_rate,
            **schedule,
            sketch_spec=request.config.sketch_spec,
            accountant=self.accountant,
            epsilon_tolerance=0.01,
        )

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
