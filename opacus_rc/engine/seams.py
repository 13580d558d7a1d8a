"""The engine's Opacus seams: what ``make_private`` builds for ``clipping="randomized"``.

Opacus' ``make_private`` is a template that calls four build steps; the adapter
:class:`~opacus_rc._compat.opacus.PrivacyEngineSeams` forwards them to public
``prepare_*_seam`` methods (docs/architecture.md#architecture-seams).
:class:`RandomizedClippingSeams` fills them:

* ``prepare_model_seam`` builds a
  :class:`~opacus_rc.grad_sample.GradSampleModuleRandomizedClipping` (or its hooks-only twin for
  ``wrap_model=False``; for an FSDP2 model
  :class:`~opacus_rc.grad_sample.fsdp.GradSampleModuleRandomizedClippingFSDP`);
* ``prepare_data_loader_seam`` is Opacus' (Poisson sampling), at the public rate of
  :func:`~opacus_rc.engine.schedule.public_sizes`, except that a distributed model gets
  :class:`~opacus_rc.data_loader.DistributedDPDataLoader`, which keeps empty per-rank batches;
* ``prepare_optimizer_seam`` builds :class:`~opacus_rc.optimizers.RandomizedClipOptimizer`, or
  its DDP or FSDP2 variant for a distributed or sharded model, dividing by the public expected
  batch size;
* ``prepare_criterion_seam`` builds :class:`~opacus_rc.optimizers.DPLossRandomizedClipping`.

For any other ``clipping`` each seam is Opacus' own step (except the public rate and divisor).
"""

from __future__ import annotations

from typing import Any

import torch
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from torch import nn, optim
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

from opacus_rc._compat.opacus import PrivacyEngineSeams, wrapped_module_if_built
from opacus_rc.config import RandomizedClippingConfig
from opacus_rc.data_loader import DistributedDPDataLoader, RandomOnEmptyCollate
from opacus_rc.engine.schedule import poisson_loader
from opacus_rc.grad_sample import (
    GradSampleHooksRandomizedClipping,
    GradSampleModuleRandomizedClipping,
)
from opacus_rc.grad_sample.fsdp import (
    GradSampleHooksRandomizedClippingFSDP,
    GradSampleModuleRandomizedClippingFSDP,
)
from opacus_rc.grad_sample.grad_sample_module import check_training_mode
from opacus_rc.mechanism import Mechanism
from opacus_rc.optimizers import (
    DistributedRandomizedClipOptimizer,
    DPLossRandomizedClipping,
    FSDPRandomizedClipOptimizer,
    RandomizedClipOptimizer,
)
from opacus_rc.units.data_loader import UnitDataLoader
from opacus_rc.units.distributed import prepare_unit_data_loader
from opacus_rc.units.record import UnitBatchRecord

__all__ = ["RandomizedClippingSeams"]


class RandomizedClippingSeams(PrivacyEngineSeams):
    """Opacus' build steps for randomized clipping and the public sizes (see the module docstring).

    The base of :class:`~opacus_rc.PrivacyEngine`, whose ``make_private`` sets ``_config`` (a
    randomized call: its configuration) and ``_mechanism`` (every call: the run's
    :class:`~opacus_rc.mechanism.Mechanism`, whose rate the loader samples at and whose
    divisor, noise and events the optimizer uses) for the duration of Opacus' template; with
    both None each seam is Opacus' own. Opacus' ``make_private`` passes ``_prepare_model``
    neither ``clipping`` nor ``**kwargs``, hence these attributes. ``prepare_model_seam`` sets
    ``_grad_sample_module`` to the module it builds, which the later seams use.
    """

    _config: RandomizedClippingConfig | None = None
    _grad_sample_module: Any = None
    _mechanism: Mechanism | None = None

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
        config = self._config
        if config is None:
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
        self._grad_sample_module = module_class(module, config=config)
        return self._grad_sample_module

    def prepare_data_loader_seam(
        self,
        data_loader: DataLoader,
        *,
        poisson_sampling: bool,
        distributed: bool,
        batch_first: bool = True,
        rand_on_empty: bool = False,
    ) -> DataLoader:
        """Opacus' seam: Poisson sampling at the public rate of
        :func:`~opacus_rc.engine.schedule.public_sizes`.

        Opacus samples at ``1 / len(data_loader)``, which is that rate unless a public
        ``dataset_size`` was given; then the loader is built at the public rate instead. A
        distributed randomized run gets :class:`DistributedDPDataLoader`: Opacus' distributed
        Poisson sampler drops a rank's empty batch, so that rank runs one step less (its
        all-reduces misalign, its accountant counts fewer steps);
        :class:`DistributedDPDataLoader` yields it as a noise-only step. A
        :class:`~opacus_rc.units.UnitDataLoader` (unit-level DP) is used as it is.
        """
        grad_sample_module = self._grad_sample_module
        if self._config is not None and grad_sample_module is not None:
            # What the criterion's units= / unit_split= are checked against (units/record.py):
            # the unit loader records each batch it yields; a per-sequence loader refuses them.
            record = UnitBatchRecord(
                per_unit=isinstance(data_loader, UnitDataLoader),
                where="criterion(..., units=batch['units']) with the units the UnitDataLoader "
                "yielded, and unit_split= under UnitBatchMemoryManager(split_units=True)",
            )
            grad_sample_module.unit_batch_record = record
            if isinstance(data_loader, UnitDataLoader):
                data_loader.unit_record = record
        if isinstance(data_loader, UnitDataLoader):
            return prepare_unit_data_loader(
                data_loader,
                engine=self,
                distributed=distributed,
                randomized=self._config is not None,
            )
        mechanism = self._mechanism
        own_rate = (
            poisson_sampling
            and mechanism is not None
            and mechanism.sample_rate != 1 / len(data_loader)
        )
        own_distributed = self._config is not None and distributed and poisson_sampling
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
            loader = poisson_loader(
                DistributedDPDataLoader if own_distributed else DPDataLoader,
                data_loader,
                # Set for every make_private call: the run's rate.
                sample_rate=mechanism.sample_rate,
                distributed=distributed,
                generator=self.secure_rng,
                batch_first=batch_first,
                rand_on_empty=rand_on_empty,
            )
        if (
            self._config is not None
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
        """Opacus' seam; for randomized clipping, the randomized-clipping optimizer.

        Opacus passes ``int(len(dataset) * q)`` as ``expected_batch_size``: a function of the
        private number of records. The divisor used is the run's mechanism's
        (:attr:`~opacus_rc.mechanism.Mechanism.divisor`, from
        :func:`~opacus_rc.engine.schedule.public_sizes`: per process in a distributed run, as
        Opacus). The randomized-clipping optimizer is given the mechanism itself and takes its
        noise multiplier, clip bound, divisor and step event from it.
        """
        mechanism = self._mechanism
        if mechanism is not None:
            expected_batch_size = mechanism.divisor
        config = self._config
        if config is None:
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
        sharded = isinstance(wrapped_module_if_built(self._grad_sample_module), FSDPModule)
        if sharded:
            optimizer_class: type[RandomizedClipOptimizer] = FSDPRandomizedClipOptimizer
        elif distributed:
            optimizer_class = DistributedRandomizedClipOptimizer
        else:
            optimizer_class = RandomizedClipOptimizer
        return optimizer_class(
            optimizer,
            grad_sample_module=self._grad_sample_module,
            mechanism=mechanism,
            generator=self.secure_rng if self.secure_mode else noise_generator,
            secure_mode=config.secure_mode,
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
        if self._config is None:
            return super().prepare_criterion_seam(
                module=module,
                optimizer=optimizer,
                criterion=criterion,
                loss_reduction=loss_reduction,
                **kwargs,
            )
        return DPLossRandomizedClipping(module, optimizer, criterion, loss_reduction)
