"""Per-sample norm machinery for randomized clipping.

Importing this package registers, in this package's own registries (Opacus' are untouched):
the sketched ``nn.Linear`` sampler and the exact ``nn.Embedding`` sampler in
:data:`SKETCHED_NORM_SAMPLERS` (the latter also in :data:`EXACT_NORM_TYPES`), their book-keeping
clipped sums in :data:`CLIPPED_SUM_FUNCTIONS`, and the ``nn.Embedding`` configuration check in
:data:`MODULE_CHECKS`.
"""

from opacus_rc.grad_sample import embedding as _embedding  # noqa: F401  (registers nn.Embedding)
from opacus_rc.grad_sample import linear as _linear  # noqa: F401  (registers nn.Linear)
from opacus_rc.grad_sample.embedding import (
    check_embedding,
    compute_embedding_clipped_sum,
    compute_embedding_norm_sample,
)
from opacus_rc.grad_sample.fsdp import (
    GradSampleHooksRandomizedClippingFSDP,
    GradSampleModuleRandomizedClippingFSDP,
)
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
    EXACT_NORM_TYPES,
    MODULE_CHECKS,
    SKETCHED_NORM_SAMPLERS,
    ClippedSumFunction,
    ModuleCheck,
    SketchedNormSampler,
    check_modules,
    register_clipped_sum,
    register_module_check,
    register_sketched_norm_sampler,
)

__all__ = [
    "CLIPPED_SUM_FUNCTIONS",
    "EXACT_NORM_TYPES",
    "MODULE_CHECKS",
    "SKETCHED_NORM_SAMPLERS",
    "ClippedSumFunction",
    "GradSampleHooksRandomizedClipping",
    "GradSampleHooksRandomizedClippingFSDP",
    "GradSampleModuleRandomizedClipping",
    "GradSampleModuleRandomizedClippingFSDP",
    "ModuleCheck",
    "SketchedNormSampler",
    "check_embedding",
    "check_modules",
    "compute_embedding_clipped_sum",
    "compute_embedding_norm_sample",
    "compute_linear_clipped_sum",
    "compute_linear_sketched_norm_sample",
    "register_clipped_sum",
    "register_module_check",
    "register_sketched_norm_sampler",
]
