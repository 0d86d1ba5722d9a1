"""Sequence parallelism: each rank holds a slice of the sequence, attention sees all of it.

`DistributedAttention` is DeepSpeed-Ulysses (`deepspeed.sequence.layer.DistributedAttention`): two
all-to-alls around an unchanged local attention. sequence/ring.py is the ring (context-parallel)
attention past Ulysses' head limit, alone or in a 2D layout with Ulysses. sequence/sp_groups.py holds
the groups (the config's ``sequence_parallel_size`` or DeepSpeed's ``parallel_state_sp``),
sequence/sp_setup.py what ``initialize`` does with them (Note: [sequence-parallel gradients]),
sequence/loss.py the token-weighted loss for scripts that compute their own. Imports torch, comm,
config and errors; never torch.distributed (the exchanges go through comm/).
"""

from zeroshard.sequence.loss import token_weighted_loss
from zeroshard.sequence.ring import (
    RingAttention,
    UlyssesRingAttention,
    ring_attention,
    shard_positions,
    ulysses_ring_groups,
)
from zeroshard.sequence.sp_groups import SequenceGroups, create_sequence_groups, current_sequence_groups
from zeroshard.sequence.tiled import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute
from zeroshard.sequence.ulysses import DistributedAttention, seq_all_to_all

__all__ = ["DistributedAttention", "RingAttention", "SequenceGroups", "TiledFusedLogitsLoss", "TiledMLP",
           "UlyssesRingAttention", "create_sequence_groups", "current_sequence_groups", "ring_attention",
           "seq_all_to_all", "sequence_tiled_compute", "shard_positions", "token_weighted_loss", "ulysses_ring_groups"]
