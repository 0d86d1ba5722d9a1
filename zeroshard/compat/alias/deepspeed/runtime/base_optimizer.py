"""deepspeed.runtime.base_optimizer: DeepSpeed's ZeROOptimizer base, by name only; refused when built."""

from zeroshard.compat.refused import refused_class as _refused

_INSTEAD = ("zeroshard's initialize returns the torch optimizer it wraps (ZeRO partitioning, loss "
            "scaling and offload are the engine's); see docs/deepspeed-differences.md")

ZeROOptimizer = _refused("deepspeed.runtime.base_optimizer.ZeROOptimizer", _INSTEAD)
DeepSpeedOptimizer = _refused("deepspeed.runtime.base_optimizer.DeepSpeedOptimizer", _INSTEAD)

__all__ = ["ZeROOptimizer", "DeepSpeedOptimizer"]
