"""The options one ``make_private`` or ``make_private_with_epsilon`` call shares, as one record.

:class:`~opacus_rc.PrivacyEngine` keeps both public signatures explicit (keyword-only, each
option with its default and its documentation); each method then builds one
:class:`MakePrivateOptions` from its arguments, by name. The record has no defaults, so a
field a method forgets to pass fails at the first call, and
``tests/test_privacy_engine.py::test_options_record_has_every_shared_option`` checks that its
fields are exactly the options the two signatures share, so a new option cannot be added to a
signature and silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn, optim
from torch.utils.data import DataLoader

__all__ = ["OPACUS_OPTIONS", "MakePrivateOptions"]

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


@dataclass(frozen=True)
class MakePrivateOptions:
    """Every option of ``make_private`` except ``noise_multiplier`` (and of
    ``make_private_with_epsilon`` except its target and ``epochs``), as the caller passed it.

    Nothing is validated here: :func:`opacus_rc.engine.request.build_request` validates the
    record as a whole. The attributes are the parameters of
    :meth:`opacus_rc.PrivacyEngine.make_private` of the same names; ``kwargs`` holds its
    ``**kwargs`` (Opacus' further options).
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

    def opacus_options(self) -> dict[str, Any]:
        """The keyword arguments for ``opacus.PrivacyEngine.make_private`` (a new dict), except
        ``noise_multiplier`` and ``**kwargs``.

        Returns:
            ``{name: value}`` for the names of :data:`OPACUS_OPTIONS`.
        """
        return {name: getattr(self, name) for name in OPACUS_OPTIONS}
