"""The error of a call out of the order of the randomized-clipping step protocol.

A module of its own, outside :mod:`opacus_rc.grad_sample`, so that :mod:`opacus_rc.units`
(a unit cut across physical batches) raises it without importing the step's owner,
:class:`~opacus_rc.grad_sample.private_step.PrivateStep`, which calls into it.
"""

from __future__ import annotations

__all__ = ["StepProtocolError"]


class StepProtocolError(RuntimeError):
    """A call out of the order of the randomized-clipping step protocol."""
