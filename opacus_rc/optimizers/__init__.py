"""DP optimizers for randomized clipping and a post-processing hook point."""

from opacus_rc.optimizers.post_processing import PostProcessingHandle, attach_post_processing_hook
from opacus_rc.optimizers.randomized_clip_optimizer import RandomizedClipOptimizer

__all__ = ["PostProcessingHandle", "RandomizedClipOptimizer", "attach_post_processing_hook"]
