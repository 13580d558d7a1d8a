"""opacus_rc: randomized clipping (DP-SGD-RC) and spectral denoising for Opacus.

The public names are imported on first use (PEP 562), so that the accountant,
``import opacus_rc.accountants`` (and the ``opacus-rc`` command), imports neither PyTorch nor
Opacus: it needs only numpy, scipy and prv-accountant.

The ``"rc"`` accountant in Opacus' accountant registry, for an existing Opacus script's
``opacus.PrivacyEngine(accountant="rc")``: ``import opacus_rc`` registers it when PyTorch or
Opacus is already imported (a training script's ``import torch`` comes first); otherwise the
first use of a public name other than the accountant's (``opacus_rc.PrivacyEngine``,
``opacus_rc.RandomizedClipOptimizer``, ...) registers it, and ``opacus_rc.PrivacyEngine``
registers it itself. A script that imports ``opacus_rc`` before ``torch`` and ``opacus`` and then
uses only ``opacus.PrivacyEngine(accountant="rc")`` calls ``opacus_rc.register()``. Opacus has no
plug-in (entry-point) mechanism for accountants; without the registration it raises
``ValueError: Unexpected accounting mechanism: rc``. Nothing else global is changed at import.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from opacus_rc.version import __version__

if TYPE_CHECKING:  # the names as static tools see them; imported on use at run time
    from opacus_rc.accountants import RCAccountant, get_noise_multiplier, register
    from opacus_rc.batch_independence import (
        BatchIndependenceError,
        position_ids_from_attention_mask,
    )
    from opacus_rc.checkpoints import unwrap_state_dict
    from opacus_rc.denoising import SpectralDenoiser
    from opacus_rc.grad_sample import (
        GradSampleHooksRandomizedClipping,
        GradSampleModuleRandomizedClipping,
        register_sketched_norm_sampler,
    )
    from opacus_rc.optimizers import RandomizedClipOptimizer, attach_post_processing_hook
    from opacus_rc.privacy_engine import PrivacyEngine
    from opacus_rc.sketching import SketchSpec
    from opacus_rc.units import UnitDataLoader

#: Where each public name is defined: the module imported on its first use.
_HOMES = {
    "BatchIndependenceError": "opacus_rc.batch_independence",
    "GradSampleHooksRandomizedClipping": "opacus_rc.grad_sample",
    "GradSampleModuleRandomizedClipping": "opacus_rc.grad_sample",
    "PrivacyEngine": "opacus_rc.privacy_engine",
    "RCAccountant": "opacus_rc.accountants",
    "RandomizedClipOptimizer": "opacus_rc.optimizers",
    "SketchSpec": "opacus_rc.sketching",
    "SpectralDenoiser": "opacus_rc.denoising",
    "UnitDataLoader": "opacus_rc.units",
    "attach_post_processing_hook": "opacus_rc.optimizers",
    "get_noise_multiplier": "opacus_rc.accountants",
    "position_ids_from_attention_mask": "opacus_rc.batch_independence",
    "register": "opacus_rc.accountants",
    "register_sketched_norm_sampler": "opacus_rc.grad_sample",
    "unwrap_state_dict": "opacus_rc.checkpoints",
}
#: The accountant's names: their use imports neither PyTorch nor Opacus, nor registers.
_ACCOUNTANT_NAMES = frozenset({"RCAccountant", "get_noise_multiplier", "register"})

__all__ = [
    "BatchIndependenceError",
    "GradSampleHooksRandomizedClipping",
    "GradSampleModuleRandomizedClipping",
    "PrivacyEngine",
    "RCAccountant",
    "RandomizedClipOptimizer",
    "SketchSpec",
    "SpectralDenoiser",
    "UnitDataLoader",
    "__version__",
    "attach_post_processing_hook",
    "get_noise_multiplier",
    "position_ids_from_attention_mask",
    "register",
    "register_sketched_norm_sampler",
    "unwrap_state_dict",
]


def _register_rc() -> None:
    """Put ``"rc"`` in Opacus' accountant registry (idempotent; imports Opacus)."""
    importlib.import_module("opacus_rc.accountants").register()


def __getattr__(name: str) -> Any:
    """Import a public name on its first use (PEP 562); an Opacus-facing name registers
    ``"rc"`` in Opacus' accountant registry first.

    Raises:
        AttributeError: for a name that is not public.
    """
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'opacus_rc' has no attribute {name!r}")
    if name not in _ACCOUNTANT_NAMES:
        _register_rc()
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later uses are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if "torch" in sys.modules or "opacus" in sys.modules:  # a training process: Opacus is cheap now
    _register_rc()
