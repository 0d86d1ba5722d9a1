"""deepspeed.moe.layer: `MoE`, importable and refused by name when built (no expert parallelism)."""

from zeroshard.moe.layer import MoE

__all__ = ["MoE"]
