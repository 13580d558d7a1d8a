"""The options of randomized clipping, validated once (docs/architecture.md#architecture-concepts).

:class:`RandomizedClippingConfig` is built once, by ``PrivacyEngine.make_private`` or by a
grad-sample module constructed directly, and shared by the engine, the grad-sample module and
the optimizer. Every option is checked in ``__post_init__`` and nowhere else, so the three
objects cannot disagree on the clip bound, the loss reduction or the sketch that the accountant
is told about.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from opacus_rc.sketching import SketchSpec, get_estimator
from opacus_rc.validation import (
    validate_max_grad_norm,
    validate_noise_multiplier,
    validate_sketch_dim,
)

__all__ = [
    "DEFAULT_SKETCH",
    "DEFAULT_SKETCH_DIM",
    "LOSS_REDUCTIONS",
    "RandomizedClippingConfig",
    "validate_max_grad_norm",
    "validate_noise_multiplier",
]

#: Estimator used when none is named.
DEFAULT_SKETCH = "hutchinson"
#: ``k`` used when none is given (docs/privacy/index.md#privacy-defaults, point 4: use ``k >= 32``).
DEFAULT_SKETCH_DIM = 32
#: The loss reductions Opacus' DP losses support.
LOSS_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class RandomizedClippingConfig:
    """Every option of randomized clipping, validated on construction and then frozen.

    Args:
        max_grad_norm: ``C``, the flat clipping bound (> 0), in the units of the per-sample
            gradient's Euclidean norm.
        sketch: Estimator name (:data:`opacus_rc.sketching.ESTIMATORS`): ``"hutchinson"`` or
            ``"hutch++"``.
        sketch_dim: ``k``, Gaussian (tail) columns per sample and layer (>= 1).
        sketch_head_dim: Hutch++ head columns ``s`` (default ``sketch_dim``); only with
            ``sketch="hutch++"``.
        sketch_generator: Source of the probes; ``None`` (recommended) means a private
            generator seeded from :mod:`secrets` per device. Passing one makes the spec
            ``secret=False`` (accounted under the ``"revealed"`` threat model).
        secure_mode: Opacus' secure mode; the sketch generator is reseeded from :mod:`secrets`
            after every step, and ``sketch_generator`` must be ``None``.
        batch_first: Whether inputs are ``(B, ...)`` (else ``(T, B, ...)``).
        loss_reduction: ``"mean"`` or ``"sum"``, as the criterion's ``reduction``.
        strict: Opacus' ``strict`` (reject trainable modules with buffers).
        force_functorch: Use functorch for every layer without a sketched sampler.
        bookkeeping: ``True`` (default): one backward pass per step (book-keeping; Bu, Wang,
            Zha and Karypis, ICML 2023) where the model allows it, also in steps whose forward
            ran activation-checkpointed regions (HF ``gradient_checkpointing_enable()``, either
            ``use_reentrant``, or ``torch.utils.checkpoint``). Each layer keeps what its clipped
            sum needs until the clip factors exist; an ``nn.Linear`` keeps whichever is
            smaller, its per-sample gradients (``p d + p`` floats per sample; its norm is then
            the same sketch computed from them, with the same probes:
            docs/privacy/estimators.md, "The same estimator from either stash") or its input
            and output gradient (``T (p + d)``), so that in a checkpointed step the stored
            tensors do not undo checkpointing's memory saving (fastDP's per-layer rule applied
            to the stash; :mod:`opacus_rc.grad_sample.norms`), and in any step the sketch costs
            ``2 p d k`` instead of ``2 T k (p + d)`` FLOPs where that is less. Embeddings, and the
            embedding side of a tied weight, keep their ids and output gradient. The stash is then
            at most ``B`` copies of the trainable weights: negligible at long ``T`` (30 SmolLM2
            blocks, T = 32768: 1.00x the checkpointed non-private step's peak memory), but at short
            ``T`` it can dominate a checkpointed step (T = 512: 1.34-1.51x), where ``False`` needs
            less memory at 1.6-1.8x the FLOPs (``python -m benchmarks.long_context``). ``"always"``:
            every layer keeps its input and output gradient, checkpointed or not (more memory
            under checkpointing). ``False``: two backward passes always. The
            guarantee is the same in every mode (the same sketch spec is accounted).

    Attributes:
        sketch_spec: The :class:`~opacus_rc.sketching.SketchSpec` that every step of a module
            built from this configuration is accounted with.

    Raises:
        TypeError: A non-int ``sketch_dim``, a non-bool flag, a ``sketch_generator`` that is not
            a ``torch.Generator``, a non-float ``max_grad_norm``.
        ValueError: An unknown estimator, ``sketch_dim < 1``, a head dimension without Hutch++,
            a bad ``loss_reduction`` or ``max_grad_norm``, or a generator in secure mode.
    """

    max_grad_norm: float
    sketch: str = DEFAULT_SKETCH
    sketch_dim: int = DEFAULT_SKETCH_DIM
    sketch_head_dim: int | None = None
    sketch_generator: torch.Generator | None = field(default=None, compare=False)
    secure_mode: bool = False
    batch_first: bool = True
    loss_reduction: str = "mean"
    strict: bool = True
    force_functorch: bool = False
    bookkeeping: bool | str = True
    sketch_spec: SketchSpec = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_grad_norm", validate_max_grad_norm(self.max_grad_norm))
        get_estimator(self.sketch)
        object.__setattr__(self, "sketch_dim", validate_sketch_dim(self.sketch_dim))
        if self.sketch == "hutch++":
            head_dim = self.sketch_dim if self.sketch_head_dim is None else self.sketch_head_dim
            validate_sketch_dim(head_dim, "sketch_head_dim")
        elif self.sketch_head_dim is not None:
            raise ValueError(
                f"sketch_head_dim is only used by sketch='hutch++', not {self.sketch!r}"
            )
        else:
            head_dim = None
        if not (isinstance(self.bookkeeping, bool) or self.bookkeeping == "always"):
            raise TypeError(
                f"bookkeeping must be a bool or 'always', got {type(self.bookkeeping).__name__} "
                f"{self.bookkeeping!r}"
            )
        for name in ("secure_mode", "batch_first", "strict", "force_functorch"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        if self.sketch_generator is not None and not isinstance(
            self.sketch_generator, torch.Generator
        ):
            raise TypeError(
                "sketch_generator must be a torch.Generator, got "
                f"{type(self.sketch_generator).__name__}"
            )
        if self.secure_mode and self.sketch_generator is not None:
            raise ValueError(
                "passing a sketch_generator is prohibited in secure mode: the sketch must come "
                "from the operating system's CSPRNG, so a generator is prohibited with "
                "secure_mode=True; pass sketch_generator=None"
            )
        spec = SketchSpec(
            estimator=self.sketch,
            sketch_dim=self.sketch_dim,
            head_dim=head_dim,
            per_sample=True,
            secret=self.sketch_generator is None,
        )
        object.__setattr__(self, "sketch_spec", spec)
