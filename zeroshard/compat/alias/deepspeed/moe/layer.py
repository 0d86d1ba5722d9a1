"""deepspeed.moe.layer -> zeroshard.moe.layer (`MoE`, DeepSpeed 0.19.8's legacy mixture-of-experts layer)."""

from zeroshard.moe.layer import MoE

__all__ = ["MoE"]
