"""Per-sample norm machinery for randomized clipping.

Importing this package registers, in this package's own registries (Opacus' are untouched):
the sketched ``nn.Linear`` sampler, the exact ``nn.Embedding`` and ``nn.EmbeddingBag``
samplers and the exact closed form of ``transformers``' ``LlamaRMSNorm`` family
(:mod:`~opacus_rc.grad_sample.norm_layers`, once imported) in
:data:`SKETCHED_NORM_SAMPLERS` (the exact ones also in :data:`EXACT_NORM_TYPES`), their
book-keeping clipped sums in :data:`CLIPPED_SUM_FUNCTIONS`, the ``nn.Embedding`` and
``nn.EmbeddingBag`` configuration checks in :data:`MODULE_CHECKS`, and the ``nn.EmbeddingBag``
forward-input adapter in :data:`FORWARD_INPUT_ADAPTERS`.
"""

from opacus_rc.grad_sample import embedding as _embedding  # noqa: F401  (registers nn.Embedding)
from opacus_rc.grad_sample import (  # noqa: F401  (registers nn.EmbeddingBag)
    embedding_bag as _embedding_bag,
)
from opacus_rc.grad_sample import linear as _linear  # noqa: F401  (registers nn.Linear)
from opacus_rc.grad_sample import (  # noqa: F401  (LlamaRMSNorm family)
    norm_layers as _norm_layers,
)
from opacus_rc.grad_sample.embedding import (
    check_embedding,
    compute_embedding_clipped_sum,
    compute_embedding_norm_sample,
)
from opacus_rc.grad_sample.embedding_bag import (
    check_embedding_bag,
    compute_embedding_bag_clipped_sum,
    compute_embedding_bag_norm_sample,
    embedding_bag_inputs,
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
    FORWARD_INPUT_ADAPTERS,
    MODULE_CHECKS,
    SKETCHED_NORM_SAMPLERS,
    ClippedSumFunction,
    ForwardInputAdapter,
    ModuleCheck,
    SketchedNormSampler,
    check_modules,
    register_clipped_sum,
    register_forward_input_adapter,
    register_module_check,
    register_sketched_norm_sampler,
)

__all__ = [
    "CLIPPED_SUM_FUNCTIONS",
    "EXACT_NORM_TYPES",
    "FORWARD_INPUT_ADAPTERS",
    "MODULE_CHECKS",
    "SKETCHED_NORM_SAMPLERS",
    "ClippedSumFunction",
    "ForwardInputAdapter",
    "GradSampleHooksRandomizedClipping",
    "GradSampleHooksRandomizedClippingFSDP",
    "GradSampleModuleRandomizedClipping",
    "GradSampleModuleRandomizedClippingFSDP",
    "ModuleCheck",
    "SketchedNormSampler",
    "check_embedding",
    "check_embedding_bag",
    "check_modules",
    "compute_embedding_bag_clipped_sum",
    "compute_embedding_bag_norm_sample",
    "compute_embedding_clipped_sum",
    "compute_embedding_norm_sample",
    "compute_linear_clipped_sum",
    "compute_linear_sketched_norm_sample",
    "embedding_bag_inputs",
    "register_clipped_sum",
    "register_forward_input_adapter",
    "register_module_check",
    "register_sketched_norm_sampler",
]
