"""A named registry: the one helper behind the package's extension points.

Each extension point (sketch estimators, envelopes, threat models, SVD back ends, denoisers) is
a :class:`Registry` filled by a decorator, not an ``if``/``elif`` chain
(docs/architecture.md#architecture-extending). A registry is a ``dict`` from name to object, in
registration order, so ``tuple(registry)``, ``registry[name]`` and ``name in registry`` behave
as before; :meth:`Registry.register` refuses bad and duplicate names, and :meth:`Registry.get`
refuses an unknown name with an error that lists the known ones.

Example:
    >>> laws = Registry("law", option="law")
    >>> @laws.register("flat")
    ... class Flat: ...
    >>> laws.available()
    ('flat',)
    >>> laws.get("steep")
    Traceback (most recent call last):
    ...
    ValueError: unknown law 'steep'; allowed: 'flat'
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")

_MISSING: Any = object()


class Registry(dict, Generic[T]):
    """Name -> object, filled by :meth:`register`, read by :meth:`get`.

    Args:
        kind: What is registered, for registration errors (``"denoiser"``, ``"SVD back end"``).
        option: The user-facing argument whose values are the names, for lookup errors
            (``"denoise"``, ``"sketch estimator"``); defaults to ``kind``.
    """

    def __init__(self, kind: str, *, option: str | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.option = kind if option is None else option

    def register(self, name: str, obj: T | None = None, *, force: bool = False) -> Any:
        """Register ``obj`` under ``name``; without ``obj``, return a decorator that does.

        Args:
            name: The name users pass; a non-empty string.
            obj: The object to register now (returned unchanged); ``None`` returns the
                decorator.
            force: Replace an existing registration instead of raising.

        Returns:
            ``obj``, or the decorator (which returns what it decorates unchanged).

        Raises:
            TypeError: If ``name`` is not a non-empty string or the object is not callable.
            ValueError: If ``name`` is already registered and ``force`` is False.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} name must be a non-empty str, got {name!r}")

        def decorator(item: T) -> T:
            if not callable(item):
                raise TypeError(f"{self.kind} must be callable, got {type(item).__name__}")
            if name in self and not force:
                raise ValueError(
                    f"duplicate registration for {self.kind} {name!r} (already registered); "
                    "pass force=True to replace it"
                )
            self[name] = item
            return item

        return decorator if obj is None else decorator(obj)

    def get(self, name: Any, default: Any = _MISSING) -> T:
        """The object registered as ``name``.

        Args:
            name: A registered name (:meth:`available`).
            default: Returned for an unknown name, as ``dict.get``; without it an unknown name
                raises.

        Raises:
            ValueError: If ``name`` is not registered and no ``default`` is given; the message
                lists the registered names.
        """
        try:
            return self[name]
        except (KeyError, TypeError):
            if default is not _MISSING:
                return default
            allowed = ", ".join(repr(n) for n in self)
            raise ValueError(f"unknown {self.option} {name!r}; allowed: {allowed}") from None

    def available(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.available()!r})"
