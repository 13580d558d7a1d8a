"""A named registry: the one helper behind the package's extension points.

Registries are kept where users extend the package: the per-layer tables of
:mod:`opacus_rc.grad_sample` (samplers, clipped sums, checks and input adapters of a layer type)
and the envelope laws of :mod:`opacus_rc.accountants.analysis.envelopes`
(docs/architecture.md#architecture-extending); the accountant is Opacus' own registry. Fixed
tables (noise placements, SVD back ends, estimators, threat models, the denoiser) are plain
code. A registry is a ``dict`` from name to object, in registration order, so
``tuple(registry)``, ``registry[name]`` and ``name in registry`` behave as for a dict;
:meth:`Registry.register` refuses bad and duplicate names, and :meth:`Registry.get` refuses an
unknown name with an error that lists the known ones.

:class:`TypeRegistry` is the same helper keyed by module types: one registration may name
several types, and an unregistered type is the ordinary answer (the caller falls back, e.g. to
Opacus' exact samplers), so its :meth:`TypeRegistry.get` returns ``None`` as ``dict.get`` does.
Lookup is by exact type, never along the MRO, as Opacus looks up its grad samplers: a subclass
may change ``forward``, and a sampler that is right for the base class is then wrong for it, so
a subclass is registered explicitly or takes the fallback.

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

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

__all__ = ["Registry", "TypeRegistry", "qualified_name"]

T = TypeVar("T")
_F = TypeVar("_F", bound=Callable[..., Any])

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
            TypeError: If ``name`` is not a valid key (:meth:`check_key`; here a non-empty
                string) or the object is not callable.
            ValueError: If ``name`` is already registered and ``force`` is False.
        """
        self.check_key(name)

        def decorator(item: T) -> T:
            self._insert((name,), item, force=force)
            return item

        return decorator if obj is None else decorator(obj)

    def check_key(self, key: Any) -> None:
        """Refuse a key this registry cannot hold (subclasses override it).

        Raises:
            TypeError: If ``key`` is not a non-empty string.
        """
        if not isinstance(key, str) or not key:
            raise TypeError(f"{self.kind} name must be a non-empty str, got {key!r}")

    def key_text(self, key: Any) -> str:
        """How a key is written in error messages (subclasses override it): ``repr(key)``."""
        return repr(key)

    def _insert(self, keys: tuple[Hashable, ...], item: Any, *, force: bool) -> None:
        """Put ``item`` under every key of ``keys`` (validated), all or none.

        Raises:
            TypeError: If ``item`` is not callable.
            ValueError: If a key is taken and ``force`` is False.
        """
        if not callable(item):
            raise TypeError(f"{self.kind} must be callable, got {type(item).__name__}")
        taken = [] if force else [k for k in keys if k in self]
        if taken:
            names = ", ".join(self.key_text(k) for k in taken)
            raise ValueError(
                f"duplicate registration for {self.kind} {names} (already registered); "
                "pass force=True to replace it"
            )
        for key in keys:
            self[key] = item

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
            allowed = ", ".join(self.key_text(n) for n in self)
            raise ValueError(
                f"unknown {self.option} {self.key_text(name)}; allowed: {allowed}"
            ) from None

    def available(self) -> tuple[Any, ...]:
        """The registered names, in registration order."""
        return tuple(self)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.available()!r})"


def qualified_name(cls: type) -> str:
    """``module.qualname`` of a class, e.g. ``"torch.nn.modules.linear.Linear"``."""
    return f"{cls.__module__}.{cls.__qualname__}"


class TypeRegistry(Registry[T]):
    """Module type -> object, looked up by exact type (see the module docstring).

    Example:
        >>> class Layer: ...
        >>> class Wide(Layer): ...
        >>> checks = TypeRegistry("layer check", base=Layer)
        >>> @checks.register_types(Layer)
        ... def check(layer): ...
        >>> checks.get(Layer) is check, checks.get(Wide)
        (True, None)
        >>> checks.register_types(int)
        Traceback (most recent call last):
        ...
        TypeError: a layer check is registered for Layer subclasses, got <class 'int'>

    Args:
        kind: What is registered, for errors (``"sketched norm sampler"``).
        base: The class every key must be (a subclass of), e.g. ``nn.Module``.
        base_name: How ``base`` is written in errors (default ``base.__qualname__``).
        option: As :class:`Registry`.
    """

    def __init__(
        self,
        kind: str,
        *,
        base: type = object,
        base_name: str | None = None,
        option: str | None = None,
    ) -> None:
        super().__init__(kind, option=option)
        self.base = base
        self.base_name = base.__qualname__ if base_name is None else base_name

    def register_types(self, *types: type, force: bool = False) -> Callable[[_F], _F]:
        """Decorator registering one object for every type of ``types``.

        The types are checked when this is called (before anything is decorated).

        Args:
            *types: The exact classes (subclasses of ``base``) the object handles.
            force: Replace existing registrations instead of raising.

        Returns:
            The decorator; it returns what it decorates unchanged.

        Raises:
            TypeError: If no type is given, or one is not a subclass of ``base``; (when
                decorating) if the object is not callable.
            ValueError: (when decorating) if a type is already registered and ``force`` is
                False; nothing is registered then.
        """
        if not types:
            raise TypeError(f"a {self.kind} registration needs at least one module type")
        for t in types:
            self.check_key(t)

        def decorator(item: _F) -> _F:
            self._insert(types, item, force=force)
            return item

        return decorator

    def check_key(self, key: Any) -> None:
        """Refuse a key that is not a subclass of ``base``.

        Raises:
            TypeError: If ``key`` is not a class derived from ``base``.
        """
        if not (isinstance(key, type) and issubclass(key, self.base)):
            raise TypeError(
                f"a {self.kind} is registered for {self.base_name} subclasses, got {key!r}"
            )

    def key_text(self, key: Any) -> str:
        """A type as ``module.qualname``; anything else as ``repr``."""
        return qualified_name(key) if isinstance(key, type) else repr(key)

    def get(self, key: Any, default: Any = None) -> Any:  # type: ignore[override]
        """The object registered for exactly the type ``key``, else ``default`` (``None``).

        An unregistered type is not an error here: the caller takes its fallback path.
        """
        return dict.get(self, key, default)

    def __repr__(self) -> str:
        return f"TypeRegistry({self.kind!r}, {tuple(self.key_text(k) for k in self)!r})"
