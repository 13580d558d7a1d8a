"""opacus_rc: randomized clipping (DP-SGD-RC) and spectral denoising for Opacus.

``import opacus_rc`` registers the ``"rc"`` accountant in Opacus' accountant registry, so an
existing Opacus script can use ``opacus.PrivacyEngine(accountant="rc")``.
"""

from opacus_rc.version import __version__

__all__ = ["__version__"]
