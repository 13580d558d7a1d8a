"""The engine's sampling schedule, from public inputs (docs/privacy/mechanism.md#mechanism-public).

One concept: how many records a step samples and how the accountant counts it, decided before
any loader is built.

* :func:`public_sizes`: the one function that computes a run's
  :class:`~opacus_rc.mechanism.PublicSizes`: the Poisson rate ``q`` and the divisor of the
  noisy sum, from the loader's ``batch_size``, a unit loader's ``expected_batch_size`` or a
  public ``dataset_size``, never from the private number of records or units, and the rate
  the accountant records with the steps of one epoch (:func:`accounted_schedule`, Opacus'
  ``1 / len(loader)`` of the loader the run iterates). The engine (its
  :class:`~opacus_rc.mechanism.Mechanism`, its noise search) and the DP trainers
  (:func:`~opacus_rc.integrations.train_data.trainer_schedule`) all call it.
* :func:`poisson_loader`: Opacus' Poisson ``DPDataLoader`` at a given rate.

The arithmetic (batches of an epoch, the Poisson epoch's accounted rate and steps) is
:mod:`opacus_rc.sampling_schedule`, which the ``opacus-rc`` command shares without torch.
"""

from __future__ import annotations

import math

import torch
from opacus.data_loader import DPDataLoader
from torch.utils.data import DataLoader, DistributedSampler

from opacus_rc.data_loader import worker_options
from opacus_rc.mechanism import PublicSizes
from opacus_rc.sampling_schedule import batches_per_epoch, poisson_epoch
from opacus_rc.units.data_loader import UnitDataLoader

__all__ = ["PublicSizes", "accounted_schedule", "poisson_loader", "public_sizes"]


_NO_PUBLIC_DIVISOR = (
    "Opacus #819: under loss_reduction='mean' the noisy sum is divided by the expected batch "
    "size, and {what} would compute it from the private number of {records} "
    "(int({count} {records} * rate {rate:.6g}) = {divisor}: one {record} more or less changes "
    "the divisor and so the released noise scale, which the accountant does not cover). "
    "Give a public number instead: {fix}"
)


def _check_public_count(value: object, name: str) -> None:
    """Refuse a public size that is not an integer >= 1 (``ValueError``)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def public_sizes(
    data_loader: DataLoader,
    *,
    dataset_size: int | None,
    loss_reduction: str = "mean",
    world_size: int = 1,
    poisson_sampling: bool = True,
) -> PublicSizes:
    """Sampling rate and divisor from public inputs (Opacus #819, #571).

    Opacus computes ``q = 1 / len(data_loader)`` and divides by ``int(len(dataset) * q)``: the
    divisor is a function of the private number of records ``N`` (neighbours ``N = 12`` and
    ``N = 11`` at batch size 4 get the same ``q`` but divisors 4 and 3). Here the divisor is
    never computed from ``len(dataset)`` or from the number of units:

    * a loader with a ``batch_size`` ``B`` (the usual ``DataLoader(dataset, batch_size=B)``):
      the divisor is ``B`` itself, and ``q = 1 / n`` with ``n = ceil(N' / B)`` batches
      (``floor`` with ``drop_last=True``, as ``len(DataLoader)``), ``N' = dataset_size`` if
      given, else ``len(dataset)`` (Opacus' rate);
    * a :class:`~opacus_rc.units.UnitDataLoader` (the records are the units): the
      rate is that of a ``DPDataLoader`` at the loader's ``sample_rate``,
      ``1 / int(1 / sample_rate)``, not ``1 / len(loader)`` (the loader's ``steps`` sets the
      number of steps only), and the divisor is the loader's public ``expected_batch_size``
      (the expected number of units per step, the whole run's in a distributed one), or
      ``int(dataset_size * q)`` with ``dataset_size`` the public number of units;
    * any other loader without a ``batch_size`` (an Opacus ``DPDataLoader``, a custom
      ``batch_sampler``): ``q = 1 / len(data_loader)`` (for a ``DPDataLoader``,
      ``1 / int(1 / its sample_rate)``) and the divisor ``int(dataset_size * q)``.

    Without a public number, a loader of the last two kinds is refused under
    ``loss_reduction="mean"``; under ``"sum"`` nothing is divided and the divisor is None.

    In a distributed run of ``W`` processes the ``batch_size`` of a loader whose batches are
    *per rank* counts one rank's records: a loader used as it is (``poisson_sampling=False``:
    every rank iterates its own loader, usually over a ``DistributedSampler``), or one whose
    sampler is a ``DistributedSampler`` (Poisson sampling then samples the whole dataset at
    ``q = 1 / len(data_loader)``, the loader's batches per rank, and keeps each rank's shard).
    The global batch, and so the divisor, is then ``B W`` (Opacus PR #745: dividing by ``B``
    takes twice the step at ``W = 2``), and with a ``dataset_size`` the number of batches is
    that of the rank's loader, ``n = ceil(ceil(N' / W) / B)`` (``N' // W`` records per rank
    with the sampler's ``drop_last``). A plain loader with Poisson sampling is sharded by the
    engine: its ``batch_size`` is the global batch.

    Args:
        data_loader: The user's (map-style) data loader.
        dataset_size: The public number of records ``N'`` (of units for a
            :class:`~opacus_rc.units.UnitDataLoader`), or None.
        loss_reduction: ``"mean"`` (the noisy sum is divided by the divisor) or ``"sum"``.
        world_size: The number of processes ``W`` of a distributed run (1: not distributed).
        poisson_sampling: Whether the engine replaces the loader by a Poisson one
            (``make_private``'s argument); False uses it as it is, per rank.

    The rate the accountant records and the steps of an epoch come with them
    (:func:`accounted_schedule`), so that the engine, its noise search and the DP trainers
    read one record (:class:`~opacus_rc.mechanism.PublicSizes`).

    Returns:
        The sizes.

    Raises:
        ValueError: If the data loader (or ``dataset_size``) gives no batch, ``dataset_size``
            is not an integer >= 1, the divisor is 0, or under ``loss_reduction="mean"`` a
            loader without ``batch_size`` comes with no public number (neither
            ``dataset_size`` nor a unit loader's ``expected_batch_size``), or a unit loader
            with both.
    """
    sample_rate, divisor = _rate_and_divisor(
        data_loader,
        dataset_size=dataset_size,
        loss_reduction=loss_reduction,
        world_size=world_size,
        poisson_sampling=poisson_sampling,
    )
    accounted_rate, steps = accounted_schedule(
        sample_rate, data_loader=data_loader, poisson_sampling=poisson_sampling
    )
    return PublicSizes(
        sample_rate=sample_rate,
        expected_batch_size=divisor,
        accounted_rate=accounted_rate,
        steps_per_epoch=steps,
        privacy_unit="unit" if isinstance(data_loader, UnitDataLoader) else "record",
        world_size=world_size,
    )


def _rate_and_divisor(
    data_loader: DataLoader,
    *,
    dataset_size: int | None,
    loss_reduction: str,
    world_size: int,
    poisson_sampling: bool,
) -> tuple[float, int | None]:
    """``(q, global divisor)`` of :func:`public_sizes` (see there)."""
    _check_public_count(dataset_size, "dataset_size")
    batch_size = data_loader.batch_size
    # Batches per rank (see above): the global batch is W of them.
    ranks = (
        world_size
        if world_size > 1
        and batch_size is not None
        and (not poisson_sampling or isinstance(data_loader.sampler, DistributedSampler))
        else 1
    )
    units = isinstance(data_loader, UnitDataLoader)
    if units:
        # The rate the units are drawn at, as Opacus for its DPDataLoader (whose length is
        # int(1 / q)): 1 / int(1 / q) >= q whatever ``steps`` (only the number of steps) is.
        n_batches = poisson_epoch(data_loader.sample_rate)[1]
    elif batch_size is not None and dataset_size is not None:
        per_rank = dataset_size
        if ranks > 1:  # the records of one rank's shard, as DistributedSampler counts them
            drop = getattr(data_loader.sampler, "drop_last", False)
            per_rank = dataset_size // ranks if drop else math.ceil(dataset_size / ranks)
        n_batches = batches_per_epoch(per_rank, batch_size, drop_last=data_loader.drop_last)
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
        return sample_rate, batch_size * ranks
    if units:
        given = data_loader.expected_batch_size
        if given is not None and dataset_size is not None:
            raise ValueError(
                f"both the UnitDataLoader's expected_batch_size={given} and "
                f"make_private's dataset_size={dataset_size} give the divisor of the noisy "
                "sum (the expected number of units per step); give one of them"
            )
        if given is not None:
            return sample_rate, given
    if dataset_size is None:
        if loss_reduction == "sum":
            return sample_rate, None  # nothing is divided
        if units:
            what, records, record = "the UnitDataLoader", "units", "unit"
            count = data_loader.num_units
            fix = (
                "build the loader with expected_batch_size=E, the expected number of units "
                "per step (e.g. sample_rate times the announced number of units; "
                "DistributedUnitDataLoader: of all ranks together), or pass "
                "make_private(..., dataset_size=U) with U the public number of units. Any "
                "such public number keeps the guarantee; a wrong one only rescales the step"
            )
        else:
            what, records, record = "a data loader without batch_size", "records", "record"
            count = len(data_loader.dataset)  # type: ignore[arg-type]
            fix = (
                "pass make_private(..., dataset_size=N) with N the public number of records "
                "(the divisor is then int(N * rate)), or give the loader a batch_size "
                "(DataLoader(dataset, batch_size=B): the divisor is B)"
            )
        raise ValueError(
            _NO_PUBLIC_DIVISOR.format(
                what=what,
                records=records,
                record=record,
                count=count,
                rate=sample_rate,
                divisor=int(count * sample_rate),
                fix=fix,
            )
        )
    divisor = int(dataset_size * sample_rate)
    if divisor == 0 and loss_reduction == "sum":
        return sample_rate, None  # nothing is divided
    if divisor == 0:
        # The noisy sum would be divided by 0: inf/NaN parameters from the first step on,
        # every step still accounted.
        what = "number of units per step" if units else "batch size"
        raise ValueError(
            f"the expected {what}, int(dataset_size={dataset_size} * rate {sample_rate:.6g}), "
            "is 0, and the noisy sum under loss_reduction='mean' is divided by it: "
            + (
                "raise the UnitDataLoader's sample_rate or give a larger public dataset_size "
                "(or expected_batch_size >= 1)"
                if units
                else "give the loader fewer, larger batches (or a larger public dataset_size)"
            )
            + ", so that at least one is expected per step"
        )
    return sample_rate, divisor


def accounted_schedule(
    sample_rate: float, *, data_loader: DataLoader, poisson_sampling: bool
) -> tuple[float, int]:
    """The rate the accountant records and the steps of one epoch, before the loader exists.

    Called by :func:`public_sizes` only (its ``accounted_rate`` and ``steps_per_epoch``).
    Opacus accounts each step at ``1 / len(loader)`` of the loader the run iterates. A Poisson
    loader built at rate ``q`` (Opacus' ``DPDataLoader``, :class:`DistributedDPDataLoader`)
    has ``int(1 / q)`` batches, one short of ``1 / q`` for some ``q`` in floating point
    (``q = 1/93``: 92); a loader used as it is (a :class:`UnitDataLoader`, or
    ``poisson_sampling=False``) has ``len(data_loader)``. A :class:`UnitDataLoader`'s steps
    are accounted at ``sample_rate`` (the rate its units are drawn at), not
    ``1 / len(loader)``: its ``steps`` need not be ``int(1 / q)``.

    Args:
        sample_rate: ``q``, the public sampling rate of the run.
        data_loader: The user's data loader.
        poisson_sampling: Whether the engine builds a Poisson loader.

    Returns:
        ``(1 / n, n)`` with ``n`` the batches per epoch (``(sample_rate, n)`` for a
        :class:`UnitDataLoader`).
    """
    if isinstance(data_loader, UnitDataLoader):
        # ``len(loader)`` steps (its ``steps``), each at the rate the units are drawn at.
        return sample_rate, len(data_loader)
    if poisson_sampling:
        return poisson_epoch(sample_rate)
    return 1 / len(data_loader), len(data_loader)


def poisson_loader(
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
