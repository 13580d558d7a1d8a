"""``SketchSpec``: what the accountant must know about a step's sketch (plain data, no torch).

Defined apart from :mod:`opacus_rc.sketching` (which computes the sketches with PyTorch) so
that the accountant, :mod:`opacus_rc.accountants`, imports neither PyTorch nor Opacus.
:mod:`opacus_rc.sketching` re-exports it; ``opacus_rc.sketching.SketchSpec`` is the documented
name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from opacus_rc.validation import validate_sketch_dim

__all__ = ["SketchSpec"]


@dataclass(frozen=True)
class SketchSpec:
    """What the accountant must know about the sketch that produced a step's clip factors.

    The optimizer reports this with every step; the accountant composes the privacy loss of
    exactly this sketch (never a convention or a default).

    Attributes:
        estimator: Name of the estimator in
            :data:`opacus_rc.sketching.ESTIMATORS` (``"hutchinson"`` or ``"hutch++"``).
        sketch_dim: ``k``, the number of Gaussian columns of the (tail) sketch. For Hutch++ this
            is the number of tail columns; its privacy is certified by the Hutchinson envelope
            with this ``k`` (docs/privacy/hutchpp.md#hutchpp-privacy, Theorem H).
        head_dim: Hutch++ head columns ``s`` (``None`` for Hutchinson).
        per_sample: ``True`` if every sample draws its own independent sketch. Required by the
            ``"hidden"`` threat model (docs/privacy/threat_models.md#threat-models).
        secret: ``True`` if the sketch generator is seeded from the operating system (not a
            user-supplied, possibly public, seed). Also required by ``"hidden"``.
    """

    estimator: str
    sketch_dim: int
    head_dim: int | None = None
    per_sample: bool = True
    secret: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "sketch_dim", validate_sketch_dim(self.sketch_dim))
        head_dim = validate_sketch_dim(self.head_dim, "head_dim", allow_none=True)
        object.__setattr__(self, "head_dim", head_dim)

    @property
    def accounted_dim(self) -> int:
        """The ``k`` of the Hutchinson envelope that certifies this sketch (tail columns)."""
        return self.sketch_dim

    @property
    def supports_hidden(self) -> bool:
        """Whether the ``"hidden"`` threat model is valid for this sketch
        (docs/privacy/threat_models.md#threat-models)."""
        return self.per_sample and self.secret

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form, safe for ``torch.load(weights_only=True)`` checkpoints."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SketchSpec:
        """Inverse of :meth:`to_dict`."""
        return cls(**d)
