"""Registry of DP optimizer classes by ``(clipping, distributed)``, used by the engine.

Opacus selects its optimizer with an if/elif chain (``opacus.optimizers.get_optimizer_class``).
Randomized clipping registers its classes here instead, so that a new variant (e.g. FSDP) is one
:func:`register_optimizer` call and the engine's selection never changes. :data:`OPTIMIZERS` is
the package's registry helper (:class:`~opacus_rc.registry.Registry`) keyed by
``(clipping, distributed)`` pairs instead of names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from opacus_rc.registry import Registry

__all__ = ["OPTIMIZERS", "get_optimizer_class", "register_optimizer"]

_T = TypeVar("_T", bound=type)


class _OptimizerRegistry(Registry[type]):
    """:class:`~opacus_rc.registry.Registry` keyed by ``(clipping, distributed)``."""

    def check_key(self, key: Any) -> None:
        """Refuse a key that is not ``(non-empty str, bool or str)``.

        Raises:
            TypeError: On any other key.
        """
        if not (
            isinstance(key, tuple)
            and len(key) == 2
            and isinstance(key[0], str)
            and key[0]
            and isinstance(key[1], (bool, str))
        ):
            raise TypeError(
                f"a {self.kind} is registered for (clipping: str, distributed: bool | str), "
                f"got {key!r}"
            )

    def key_text(self, key: Any) -> str:
        """``(clipping='randomized', distributed=False)``; anything else as ``repr``."""
        if isinstance(key, tuple) and len(key) == 2:
            return f"(clipping={key[0]!r}, distributed={key[1]!r})"
        return repr(key)


#: ``(clipping, distributed) -> optimizer class``; ``distributed`` is ``False``, ``True`` (data
#: parallel: DPDDP/DDP) or ``"fsdp"`` (FSDP2).
OPTIMIZERS: Registry[type] = _OptimizerRegistry("DP optimizer")


def _kind(distributed: bool | str) -> bool | str:
    return distributed if isinstance(distributed, str) else bool(distributed)


def register_optimizer(
    clipping: str, *, distributed: bool | str, force: bool = False
) -> Callable[[_T], _T]:
    """Class decorator registering a DP optimizer for ``(clipping, distributed)``.

    Registering the class that is already registered for the key again is a no-op.

    Args:
        clipping: The ``clipping=`` value of ``make_private`` (e.g. ``"randomized"``).
        distributed: ``False`` (one process), ``True`` (a DPDDP/DDP model) or ``"fsdp"`` (an
            FSDP2 model).
        force: Replace an existing registration instead of raising.

    Returns:
        The decorator; it returns the class unchanged.

    Raises:
        TypeError: If ``clipping`` is not a non-empty string.
        ValueError: If the key is taken by another class and ``force`` is ``False``.
    """
    key = (clipping, _kind(distributed))
    OPTIMIZERS.check_key(key)

    def decorator(cls: _T) -> _T:
        if OPTIMIZERS.get(key, None) is not cls:
            OPTIMIZERS.register(key, cls, force=force)
        return cls

    return decorator


def get_optimizer_class(clipping: str, *, distributed: bool | str) -> type:
    """The optimizer class registered for ``(clipping, distributed)``.

    Raises:
        ValueError: If none is registered; the message lists what is.
    """
    return OPTIMIZERS.get((clipping, _kind(distributed)))
