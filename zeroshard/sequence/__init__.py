"""Sequence-parallel attention: each rank holds a slice of the sequence, attention sees all of it.

`DistributedAttention` is DeepSpeed-Ulysses (`deepspeed.sequence.layer.DistributedAttention`): two
all-to-alls around an unchanged local attention. Imports torch and `zeroshard.comm` only; never
torch.distributed (the exchange goes through comm/).
"""

from zeroshard.sequence.ulysses import DistributedAttention, seq_all_to_all

__all__ = ["DistributedAttention", "seq_all_to_all"]
