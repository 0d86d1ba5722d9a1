"""deepspeed.runtime.zero.stage_1_and_2: DeepSpeed's stage-1/2 optimizer class, by name only; refused when built."""

from zeroshard.compat.refused import refused_class as _refused

_INSTEAD = ("zeroshard's initialize returns the torch optimizer it wraps (ZeRO partitioning, loss "
            "scaling and offload are the engine's); see docs/deepspeed-differences.md")

DeepSpeedZeroOptimizer = _refused("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", _INSTEAD)

__all__ = ["DeepSpeedZeroOptimizer"]
