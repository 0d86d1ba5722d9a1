"""deepspeed.sequence.layer: DeepSpeed-Ulysses `DistributedAttention` -> zeroshard.sequence.ulysses."""

from zeroshard.sequence.ulysses import DistributedAttention, _rotate_half, _torchembed_available, apply_rotary_pos_emb

__all__ = ["DistributedAttention", "_rotate_half", "_torchembed_available", "apply_rotary_pos_emb"]
