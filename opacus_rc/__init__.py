"""opacus_rc: randomized clipping (DP-SGD-RC) and spectral denoising for Opacus.

``import opacus_rc`` registers the ``"rc"`` accountant in Opacus' accountant registry, so an
existing Opacus script can use ``opacus.PrivacyEngine(accountant="rc")``. The import is required:
Opacus has no plug-in (entry-point) mechanism for accountants, and without the import it raises
``ValueError: Unexpected accounting mechanism: rc``. (``opacus_rc.PrivacyEngine`` registers the
accountant itself.) Nothing else global is changed at import.
"""

from opacus_rc.accountants import RCAccountant, get_noise_multiplier, register
from opacus_rc.batch_independence import BatchIndependenceError, position_ids_from_attention_mask
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
from opacus_rc.version import __version__

register()

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
