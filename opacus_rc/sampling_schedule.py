"""The arithmetic of a run's accounted schedule, from public sizes (no torch, no Opacus).

One definition shared by the engine (:mod:`opacus_rc.engine.schedule`, the noise search of
``make_private_with_epsilon``) and the ``opacus-rc`` command, so that the command searches at
the schedule a run has:

* :func:`batches_per_epoch`: the batches of ``DataLoader(dataset, batch_size=B)`` over ``N``
  records (``len(DataLoader)``); the Poisson rate of the run is one over it.
* :func:`poisson_epoch`: the steps of one epoch of Opacus' Poisson ``DPDataLoader`` at rate
  ``q``, ``int(1 / q)`` (one short of ``1 / q`` for some ``q`` in floating point:
  ``q = 1/93`` gives 92), and the rate each step is accounted at, ``1 / int(1 / q)``
  (Opacus accounts a step at ``1 / len(loader)``).
* :func:`steps_for_epochs`: ``max(1, int(epochs * steps_per_epoch))``.
"""

from __future__ import annotations

import math

__all__ = ["batches_per_epoch", "poisson_epoch", "steps_for_epochs"]


def batches_per_epoch(records: int, batch_size: int, *, drop_last: bool = False) -> int:
    """Batches of one epoch of a ``DataLoader`` over ``records`` records at ``batch_size``.

    Args:
        records: The (public) number of records, >= 0.
        batch_size: The loader's batch size, >= 1.
        drop_last: The loader's ``drop_last``.

    Returns:
        ``ceil(records / batch_size)``, or ``records // batch_size`` with ``drop_last``
        (``len(DataLoader)``); 0 when no batch is formed.
    """
    return records // batch_size if drop_last else math.ceil(records / batch_size)


def poisson_epoch(sample_rate: float) -> tuple[float, int]:
    """The accounted rate and steps of one epoch of a Poisson loader at ``sample_rate``.

    Args:
        sample_rate: ``q`` in (0, 1], the rate the loader samples at.

    Returns:
        ``(1 / n, n)`` with ``n = max(1, int(1 / q))``, the batches of Opacus' ``DPDataLoader``
        (``len(loader)``); Opacus' accountant hook records each step at ``1 / n >= q``.
    """
    per_epoch = max(1, int(1 / sample_rate))
    return 1 / per_epoch, per_epoch


def steps_for_epochs(epochs: float, steps_per_epoch: int) -> int:
    """The steps of ``epochs`` epochs of ``steps_per_epoch`` steps (at least 1).

    Args:
        epochs: A finite number of epochs > 0.
        steps_per_epoch: Steps of one epoch, >= 1.

    Returns:
        ``max(1, int(epochs * steps_per_epoch))``: exact for integer ``epochs``, unlike
        ``int(epochs / q)``, which is one step short for some ``q`` (``3 / 0.01`` is
        ``299.99999999999994``).
    """
    return max(1, int(epochs * steps_per_epoch))
