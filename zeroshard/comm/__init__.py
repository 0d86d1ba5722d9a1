"""Communication layer: the only zeroshard package that imports torch.distributed.

``init_distributed()`` builds the process's :class:`ProcessGroups` from the launcher's
environment; :class:`Comm` runs collectives on flat tensors with timeouts, a communication
dtype, async :class:`Handle` s, divergence diagnostics and an optional :class:`CommLog`.
DeepSpeed's functional API (``deepspeed.comm.get_rank``, ``all_reduce``, ...) is in
``comm/functional.py`` and exported here under DeepSpeed's names.
"""

from zeroshard.comm.collectives import Comm, Handle, ReduceOpName
from zeroshard.comm.env import LaunchEnv, expand_hostlist, parse_launch_env
from zeroshard.comm.functional import (  # deepspeed.comm's functions
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    destroy_process_group,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_group,
    get_world_size,
    init_distributed,
    is_available,
    is_initialized,
    new_group,
    reduce,
    reduce_scatter_tensor,
)
from zeroshard.comm.groups import ProcessGroups, destroy_distributed
from zeroshard.comm.log import CommLog, CommRecord

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "is_available",
    "is_initialized",
    "new_group",
    "reduce",
    "reduce_scatter_tensor",
    "Comm",
    "CommLog",
    "CommRecord",
    "Handle",
    "LaunchEnv",
    "ProcessGroups",
    "ReduceOpName",
    "destroy_distributed",
    "expand_hostlist",
    "init_distributed",
    "parse_launch_env",
]
