"""Per-sample norm machinery for randomized clipping.

Importing this package registers the sketched ``nn.Linear`` sampler in
:data:`SKETCHED_NORM_SAMPLERS` (this package's own registry; Opacus' registries are untouched).
"""

from opacus_rc.grad_sample import linear as _linear  # noqa: F401  (registers nn.Linear)
from opacus_rc.grad_sample.grad_sample_module import (
    GradSampleHooksRandomizedClipping,
    GradSampleModuleRandomizedClipping,
)
from opacus_rc.grad_sample.linear import compute_linear_sketched_norm_sample
from opacus_rc.grad_sample.registry import (
    SKETCHED_NORM_SAMPLERS,
    SketchedNormSampler,
    register_sketched_norm_sampler,
)

__all__ = [
    "SKETCHED_NORM_SAMPLERS",
    "GradSampleHooksRandomizedClipping",
    "GradSampleModuleRandomizedClipping",
    "SketchedNormSampler",
    "compute_linear_sketched_norm_sample",
    "register_sketched_norm_sampler",
]
