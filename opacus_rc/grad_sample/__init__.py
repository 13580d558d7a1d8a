"""Per-sample norm machinery for randomized clipping.

Importing this package registers the sketched ``nn.Linear`` sampler in
:data:`SKETCHED_NORM_SAMPLERS` and its book-keeping clipped sum in :data:`CLIPPED_SUM_FUNCTIONS`
(this package's own registries; Opacus' registries are untouched).
"""

from opacus_rc.grad_sample import linear as _linear  # noqa: F401  (registers nn.Linear)
from opacus_rc.grad_sample.grad_sample_module import (
    GradSampleHooksRandomizedClipping,
    GradSampleModuleRandomizedClipping,
)
from opacus_rc.grad_sample.linear import (
    compute_linear_clipped_sum,
    compute_linear_sketched_norm_sample,
)
from opacus_rc.grad_sample.registry import (
    CLIPPED_SUM_FUNCTIONS,
    SKETCHED_NORM_SAMPLERS,
    ClippedSumFunction,
    SketchedNormSampler,
    register_clipped_sum,
    register_sketched_norm_sampler,
)

__all__ = [
    "CLIPPED_SUM_FUNCTIONS",
    "SKETCHED_NORM_SAMPLERS",
    "ClippedSumFunction",
    "GradSampleHooksRandomizedClipping",
    "GradSampleModuleRandomizedClipping",
    "SketchedNormSampler",
    "compute_linear_clipped_sum",
    "compute_linear_sketched_norm_sample",
    "register_clipped_sum",
    "register_sketched_norm_sampler",
]
