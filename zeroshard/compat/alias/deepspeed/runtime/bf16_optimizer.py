"""deepspeed.runtime.bf16_optimizer: DeepSpeed's BF16_Optimizer, by name only; refused when built."""

from zeroshard.compat.refused import refused_class as _refused

_INSTEAD = ("zeroshard's initialize returns the torch optimizer it wraps (ZeRO partitioning, loss "
            "scaling and offload are the engine's); see docs/deepspeed-differences.md")

BF16_Optimizer = _refused("deepspeed.runtime.bf16_optimizer.BF16_Optimizer", _INSTEAD)

__all__ = ["BF16_Optimizer"]
