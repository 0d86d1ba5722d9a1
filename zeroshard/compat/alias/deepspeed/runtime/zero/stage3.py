"""deepspeed.runtime.zero.stage3: DeepSpeed's stage-3 optimizer class, by name only; refused when built."""

from zeroshard.compat.ds_utils import unwrap_model_for_generation
from zeroshard.compat.refused import refused_class as _refused

_INSTEAD = ("zeroshard's initialize returns the torch optimizer it wraps (ZeRO partitioning, loss "
            "scaling and offload are the engine's); see docs/deepspeed-differences.md")

DeepSpeedZeroOptimizer_Stage3 = _refused("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", _INSTEAD)

__all__ = ["DeepSpeedZeroOptimizer_Stage3", "unwrap_model_for_generation"]
