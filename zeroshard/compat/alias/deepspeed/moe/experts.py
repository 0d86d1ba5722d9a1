"""deepspeed.moe.experts -> zeroshard.moe.experts (`Experts`, the local expert copies of a MoE layer)."""

from zeroshard.moe.experts import Experts

__all__ = ["Experts"]
