"""Registry of DP optimizer classes by ``(clipping, distributed)``, used by the engine.

Opacus selects its optimizer with an if/elif chain (``opacus.optimizers.get_optimizer_class``).
Randomized clipping registers its classes here instead, so that a new variant (e.g. FSDP) is one
:func:`register_optimizer` call and the engine's selection never changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["OPTIMIZERS", "get_optimizer_class", "register_optimizer"]

_T = TypeVar("_T", bound=type)

#: ``(clipping, distributed) -> optimizer class``; ``distributed`` is ``False``, ``True`` (data
#: parallel: DPDDP/DDP) or ``"fsdp"`` (FSDP2).
OPTIMIZERS: dict[tuple[str, bool | str], type] = {}


def _kind(distributed: bool | str) -> bool | str:
    return distributed if isinstance(distributed, str) else bool(distributed)


def register_optimizer(
    clipping: str, *, distributed: bool | str, force: bool = False
) -> Callable[[_T], _T]:
    """Class decorator registering a DP optimizer for ``(clipping, distributed)``.

    Args:
        clipping: The ``clipping=`` value of ``make_private`` (e.g. ``"randomized"``).
        distributed: ``False`` (one process), ``True`` (a DPDDP/DDP model) or ``"fsdp"`` (an
            FSDP2 model).
        force: Replace an existing registration instead of raising.

    Returns:
        The decorator; it returns the class unchanged.

    Raises:
        ValueError: If the key is taken and ``force`` is ``False``.
    """

    def decorator(cls: _T) -> _T:
        key = (clipping, _kind(distributed))
        if key in OPTIMIZERS and not force and OPTIMIZERS[key] is not cls:
            raise ValueError(
                f"an optimizer is already registered for clipping={clipping!r}, "
                f"distributed={distributed}: {OPTIMIZERS[key].__qualname__}; pass force=True"
            )
        OPTIMIZERS[key] = cls
        return cls

    return decorator


def get_optimizer_class(clipping: str, *, distributed: bool | str) -> type:
    """The optimizer class registered for ``(clipping, distributed)``.

    Raises:
        ValueError: If none is registered; the message lists what is.
    """
    try:
        return OPTIMIZERS[(clipping, _kind(distributed))]
    except KeyError:
        known = ", ".join(
            f"(clipping={c!r}, distributed={d!r})"
            for c, d in sorted(OPTIMIZERS, key=lambda k: (k[0], str(k[1])))
        )
        raise ValueError(
            f"no optimizer for clipping={clipping!r} with distributed={distributed}; "
            f"registered: {known}"
        ) from None
