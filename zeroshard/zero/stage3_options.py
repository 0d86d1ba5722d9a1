"""What stage 3 is told: `Stage3Options`, the typed settings zero/build.py derives from the
config's zero_optimization, offload and precision sections for `Stage3Strategy` (zero/stage3.py).
Imports nothing of ours but zero/offload/policy.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from zeroshard.zero.offload.policy import OffloadPolicy


@dataclass(frozen=True, slots=True)
class Stage3Options:
    """The settings of one `Stage3Strategy`; zero/build.py builds them from a Config."""

    grad_dtype: torch.dtype
    comm_dtype: torch.dtype | None
    persistence_threshold: int
    """Parameters with fewer elements stay whole on every rank."""
    prefetch_numel: int
    """Elements gathered ahead of use (`stage3_prefetch_bucket_size`)."""
    max_live_numel: int
    """Gathered elements at once, prefetch included (`stage3_max_live_parameters`)."""
    max_reuse_distance: int
    """Keep a unit gathered if it is used again within this many gathered elements."""
    prescale_factor: float = 1.0
    release_grads: bool = False
    """`stage3_release_grads`: each unit's gradient shard exists from its first reduction of a step
    until the step ends (Note: [gradient lifetime] in zero/grad_shard.py)."""
    persistence_budget: int = sys.maxsize
    """At most this many elements in all persistent parameters together
    (`stage3_model_persistence_threshold`): walking the model's parameters in order, one that
    would exceed it stays partitioned, as in DeepSpeed."""
    master_dtype: torch.dtype = torch.float32
    """dtype of the master shard (bf16 with `bf16.bf16_master_weights_and_grads`)."""
    overlap_comm: bool = True
    reduce_scatter: bool = True
    """Reduce-scatter each unit's gradients (False: all-reduce and keep this rank's chunk)."""
    offload_optimizer: OffloadPolicy = OffloadPolicy()
    """Where master shard, gradient shard and optimizer state live."""
    offload_param: OffloadPolicy = OffloadPolicy()
    """Where the low-precision parameter shards live between gathers."""
    quantized_gradients: bool = False
    """qgZ (`zero_quantized_gradients`): reduce each unit's gradients as int4 blocks
    (ReduceMode.QUANTIZED_REDUCE_SCATTER), whatever `reduce_scatter` says."""
    quantized_weights: bool = False
    """qwZ (`zero_quantized_weights`): the gathers of forward and backward carry int8 codes
    (zero/gather.py). Note: [exact gathers] in zero/stage3.py says which gathers stay exact."""
    node_size: int = 1
    """Ranks per node (comm/groups.py `node_size`): qgZ reduces hierarchically (within the
    node, then across) when 1 < node_size < world size."""
    float8_gather: bool = False
    """`fp8.float8_all_gather`: the weights runtime/fp8.py marks `zs_float8_weight` travel as e4m3
    codes in the gathers of forward and backward (zero/float8_gather.py)."""
    hpz_size: int = 1
    """hpZ (`zero_hpz_partition_size`): ranks per node holding a secondary partition that the
    gathers of forward and backward read (zero/gather.py, SecondaryPartition); 1 = off.
    zero/build.py checks it equals the node size and divides the world size."""
