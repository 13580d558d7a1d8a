"""Registry of gradient denoisers that ``PrivacyEngine.make_private(denoise=...)`` can attach.

A denoiser is a post-processing step hook: ``denoiser(optimizer) -> None`` rewrites ``p.grad`` of
a DP optimizer's parameters after noise and scaling and before the wrapped optimizer's step, using
only the released noisy gradient and public constants (THEORY.md E.4), so the accountant is
unchanged. The engine resolves ``denoise="<name>"`` through this registry (STYLE.md section 2:
"resolve names through registries"), so a new denoiser needs no change to the engine.

A *factory* builds one denoiser per ``make_private`` call. It takes keyword arguments only:
``kappa`` (the engine's ``denoise_kappa``; ``None`` means the denoiser's own default) and any
further options (the engine's ``denoise_options``). It must validate every argument and raise
``ValueError``/``TypeError`` on bad input: the engine calls it before attaching any hook.

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
from typing import Any

from opacus_rc.denoising.spectral import DEFAULT_KAPPA, SpectralDenoiser

__all__ = ["DenoiserFactory", "denoiser_names", "make_denoiser", "register_denoiser"]

#: ``factory(*, kappa: float | None, **options) -> denoiser``; ``denoiser(optimizer) -> None``.
DenoiserFactory = Callable[..., Callable[[Any], None]]

_DENOISERS: dict[str, DenoiserFactory] = {}


def register_denoiser(name: str, factory: DenoiserFactory, *, force: bool = False) -> None:
    """Register ``factory`` under ``name`` for ``make_private(denoise=name)``.

    Args:
        name: The value users pass as ``denoise``; a non-empty string.
        factory: ``factory(*, kappa=None, **options)`` returning a callable
            ``denoiser(optimizer) -> None`` (see the module docstring for the contract).
        force: Replace an existing registration instead of raising.

    Raises:
        TypeError: If ``name`` is not a non-empty string or ``factory`` is not callable.
        ValueError: If ``name`` is already registered and ``force`` is False.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"denoiser name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"denoiser factory must be callable, got {type(factory).__name__}")
    if name in _DENOISERS and not force:
        raise ValueError(
            f"duplicate registration for denoiser {name!r}; pass force=True to replace it"
        )
    _DENOISERS[name] = factory


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
    factory = _DENOISERS.get(name) if isinstance(name, str) else None
    if factory is None:
        allowed = ", ".join(repr(n) for n in denoiser_names())
        raise ValueError(f"unknown denoise {name!r}; allowed: {allowed}")
    return factory(kappa=kappa, **options)


def _spectral_factory(*, kappa: float | None = None, **options: Any) -> SpectralDenoiser:
    """``"spectral"``: :class:`SpectralDenoiser` (default kappa :data:`DEFAULT_KAPPA`)."""
    return SpectralDenoiser(kappa=DEFAULT_KAPPA if kappa is None else kappa, **options)


register_denoiser("spectral", _spectral_factory)
