"""deepspeed.sequence.layer: DeepSpeed-Ulysses `DistributedAttention` -> zeroshard.sequence.ulysses."""

from zeroshard.sequence.ulysses import DistributedAttention, apply_rotary_pos_emb

__all__ = ["DistributedAttention", "apply_rotary_pos_emb"]
