"""The one options record of a ``make_private`` or ``make_private_with_epsilon`` call.

:class:`~opacus_rc.PrivacyEngine` keeps both public signatures explicit (keyword-only, each
option with its default and its documentation); each method then builds one
:class:`MakePrivateOptions` from its arguments, by name. The options have no defaults, so a
field a method forgets to pass fails at the first call, and
``tests/test_privacy_engine.py::test_options_record_has_every_shared_option`` checks that they
are exactly the options the two signatures share, so a new option cannot be added to a
signature and silently dropped. :func:`~opacus_rc.engine.request.validate_options` returns the
same record validated, with what it derives filled in (:data:`DERIVED_FIELDS`); that record is
what the rest of the call reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn, optim
from torch.utils.data import DataLoader

if TYPE_CHECKING:
    from opacus_rc.config import RandomizedClippingConfig
    from opacus_rc.mechanism import PublicSizes

__all__ = ["DERIVED_FIELDS", "OPACUS_OPTIONS", "MakePrivateOptions"]

#: The fields passed on to ``opacus.PrivacyEngine.make_private`` (with ``noise_multiplier``).
OPACUS_OPTIONS = (
    "module",
    "optimizer",
    "criterion",
    "data_loader",
    "max_grad_norm",
    "batch_first",
    "loss_reduction",
    "poisson_sampling",
    "clipping",
    "noise_generator",
    "grad_sample_mode",
    "wrap_model",
    "rand_on_empty",
)

#: The fields :func:`~opacus_rc.engine.request.validate_options` fills in (``None`` before).
DERIVED_FIELDS = ("config", "sizes", "denoiser", "lora_guard")


@dataclass(frozen=True)
class MakePrivateOptions:
    """Every option of ``make_private`` except ``noise_multiplier`` (and of
    ``make_private_with_epsilon`` except its target and ``epochs``), and what is derived from
    them.

    As the caller passed it, nothing is validated and the derived fields are ``None``;
    :func:`opacus_rc.engine.request.validate_options` validates the record as a whole and
    returns a copy with ``criterion`` defaulted, ``grad_sample_mode`` the value Opacus is
    called with, and the derived fields set. The option attributes are the parameters of
    :meth:`opacus_rc.PrivacyEngine.make_private` of the same names; ``kwargs`` holds its
    ``**kwargs`` (Opacus' further options).

    Attributes:
        config: The randomized-clipping configuration that configures the grad-sample module
            and the optimizer (None for Opacus' own clipping).
        sizes: The sampling rate, accounted rate, steps per epoch and divisor, from public
            inputs (:func:`~opacus_rc.engine.schedule.public_sizes`): the schedule of the run's
            :class:`~opacus_rc.mechanism.Mechanism` and of the noise search.
        denoiser: The ``denoise=`` post-processing hook to attach, or None.
        lora_guard: The ``check_lora_update=True`` guard to attach, or None.
    """

    module: nn.Module
    optimizer: optim.Optimizer
    criterion: Any
    data_loader: DataLoader
    max_grad_norm: float | list[float]
    batch_first: bool
    loss_reduction: str
    poisson_sampling: bool
    clipping: str
    noise_generator: torch.Generator | None
    grad_sample_mode: str
    wrap_model: bool
    rand_on_empty: bool
    sketch: str | None
    sketch_dim: int | None
    sketch_head_dim: int | None
    sketch_generator: torch.Generator | None
    denoise: str | None
    denoise_kappa: float | None
    denoise_options: dict[str, Any] | None
    check_lora_update: bool
    bookkeeping: bool | str
    dataset_size: int | None
    check_batch_independence: bool
    kwargs: dict[str, Any]
    config: RandomizedClippingConfig | None = None
    sizes: PublicSizes | None = None
    denoiser: Any = None
    lora_guard: Any = None

    def opacus_options(self) -> dict[str, Any]:
        """The keyword arguments for ``opacus.PrivacyEngine.make_private`` (a new dict), except
        ``noise_multiplier`` and ``**kwargs``.

        Returns:
            ``{name: value}`` for the names of :data:`OPACUS_OPTIONS`.
        """
        return {name: getattr(self, name) for name in OPACUS_OPTIONS}
