"""Registry of gradient denoisers that ``PrivacyEngine.make_private(denoise=...)`` can attach.

A denoiser is a post-processing step hook: ``denoiser(optimizer) -> None`` rewrites ``p.grad`` of
a DP optimizer's parameters after noise and scaling and before the wrapped optimizer's step, using
only the released noisy gradient and public constants (docs/denoising.md#denoising-post-processing),
so the accountant is unchanged. The engine resolves ``denoise="<name>"`` through this registry (as
every extension point, docs/architecture.md#architecture-extending), so a new denoiser needs no
change to the engine.

A *factory* builds one denoiser per ``make_private`` call. It takes keyword arguments only:
``kappa`` (the engine's ``denoise_kappa``; ``None`` means the denoiser's own default) and any
further options (the engine's ``denoise_options``). It must validate every argument and raise
``ValueError``/``TypeError`` on bad input: the engine calls it before attaching any hook.
Factories are registered with the decorator :func:`register_denoiser`, in the style of
:mod:`opacus_rc.grad_sample.registry`; ``"spectral"`` is registered next to
:class:`~opacus_rc.denoising.SpectralDenoiser` in :mod:`opacus_rc.denoising.opacus_adapter`.

Example:
    >>> from opacus_rc.denoising import make_denoiser
    >>> make_denoiser("spectral", kappa=1.2)
    SpectralDenoiser(kappa=1.2, norm_correction=True, min_dim=2, svd='exact')
    >>> make_denoiser("wiener")
    Traceback (most recent call last):
    ...
    ValueError: unknown denoise 'wiener'; allowed: 'spectral'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from opacus_rc.registry import Registry

__all__ = ["DenoiserFactory", "denoiser_names", "make_denoiser", "register_denoiser"]


#: ``factory(*, kappa: float | None, **options) -> denoiser``; ``denoiser(optimizer) -> None``.
DenoiserFactory = Callable[..., Callable[[Any], None]]

_F = TypeVar("_F", bound=DenoiserFactory)

#: Denoiser name -> factory.
_DENOISERS: Registry[DenoiserFactory] = Registry("denoiser", option="denoise")


def register_denoiser(
    name: str, factory: _F | None = None, *, force: bool = False
) -> Callable[[_F], _F] | _F:
    """Decorator registering a denoiser factory under ``name`` for ``make_private(denoise=name)``.

    Example::

        @register_denoiser("wiener")
        def make_wiener_denoiser(*, kappa=None, **options):
            return WienerDenoiser(...)

    ``register_denoiser(name, factory)`` is the same registration as a plain call (it returns
    ``factory``), for classes and callables defined elsewhere.

    Args:
        name: The value users pass as ``denoise``; a non-empty string.
        factory: The factory to register now; ``None`` (default) returns the decorator.
        force: Replace an existing registration instead of raising.

    Returns:
        The decorator (it returns the factory unchanged), or ``factory`` itself when given.

    Raises:
        TypeError: If ``name`` is not a non-empty string or the factory is not callable.
        ValueError: If ``name`` is already registered and ``force`` is False.
    """
    return _DENOISERS.register(name, factory, force=force)


def denoiser_names() -> tuple[str, ...]:
    """Registered denoiser names, sorted."""
    return tuple(sorted(_DENOISERS))


def make_denoiser(
    name: str, *, kappa: float | None = None, **options: Any
) -> Callable[[Any], None]:
    """Build the denoiser registered as ``name``.

    Args:
        name: A registered name (:func:`denoiser_names`).
        kappa: Threshold factor for the denoiser, or ``None`` for its default.
        **options: Further keyword arguments of the factory (for ``"spectral"``: those of
            :class:`~opacus_rc.denoising.SpectralDenoiser`, e.g. ``svd``, ``min_dim``,
            ``norm_correction``).

    Returns:
        The denoiser, a callable ``denoiser(optimizer) -> None``.

    Raises:
        ValueError: If ``name`` is not registered (the message lists the allowed names), or the
            factory rejects a value (e.g. ``kappa < 1`` for ``"spectral"``).
        TypeError: If the factory rejects an option name or type.
    """
    return _DENOISERS.get(name)(kappa=kappa, **options)
