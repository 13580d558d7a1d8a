"""DP optimizers for randomized clipping, their DP loss, and a post-processing hook point."""

from opacus_rc.optimizers.distributed_randomized_clip_optimizer import (
    DistributedRandomizedClipOptimizer,
)
from opacus_rc.optimizers.dp_loss import DPLossRandomizedClipping, DPTensorRandomizedClipping
from opacus_rc.optimizers.fsdp_randomized_clip_optimizer import FSDPRandomizedClipOptimizer
from opacus_rc.optimizers.post_processing import PostProcessingHandle, attach_post_processing_hook
from opacus_rc.optimizers.randomized_clip_optimizer import RandomizedClipOptimizer

__all__ = [
    "DPLossRandomizedClipping",
    "DPTensorRandomizedClipping",
    "DistributedRandomizedClipOptimizer",
    "FSDPRandomizedClipOptimizer",
    "PostProcessingHandle",
    "RandomizedClipOptimizer",
    "attach_post_processing_hook",
]
