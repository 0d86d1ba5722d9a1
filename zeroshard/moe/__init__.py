"""DeepSpeed's legacy mixture-of-experts API (`deepspeed.moe`): the `MoE` layer with expert parallelism.

gating.py routes tokens (top-1/2/k with capacity), experts.py holds the experts and moves tokens
(all-to-all over the expert-parallel group), layer.py is the `MoE` module, ep_groups.py lays out the
expert-parallel and expert-data-parallel groups as DeepSpeed does, prepare.py attaches them at
initialize, utils.py groups expert parameters for the optimizer, hf_experts.py is AutoEP (Hugging
Face expert banks cut over the expert-parallel ranks). Imports torch, `zeroshard.comm`,
`zeroshard.errors` and `zeroshard.config` (the `expert_parallel` section's presets and types);
never zero/ or runtime/ (those import this package).
"""

from zeroshard.moe import layer, utils

__all__ = ["layer", "utils"]
