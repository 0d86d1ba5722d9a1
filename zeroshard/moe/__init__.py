"""DeepSpeed's `deepspeed.moe` names that scripts import even without mixture-of-experts layers.

zeroshard has no MoE (expert parallelism): `moe.utils` works for dense models and refuses a model
or parameter group holding expert parameters; `moe.layer.MoE` refuses to be built. Imports torch
and zeroshard.errors only.
"""

from zeroshard.moe import layer, utils

__all__ = ["layer", "utils"]
