"""deepspeed.runtime.fp16.fused_optimizer: DeepSpeed's FP16_Optimizer, by name only; refused when built."""

from zeroshard.compat.refused import refused_class as _refused

_INSTEAD = ("zeroshard's initialize returns the torch optimizer it wraps (ZeRO partitioning, loss "
            "scaling and offload are the engine's); see docs/deepspeed-differences.md")

FP16_Optimizer = _refused("deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer", _INSTEAD)

__all__ = ["FP16_Optimizer"]
