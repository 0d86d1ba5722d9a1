"""Communication layer: the only zeroshard package that imports torch.distributed.

``init_distributed()`` builds the process's :class:`ProcessGroups` from the launcher's
environment; :class:`Comm` runs collectives on flat tensors with timeouts, a communication
dtype, async :class:`Handle` s, divergence diagnostics and an optional :class:`CommLog`.
"""

from zeroshard.comm.collectives import Comm, Handle, ReduceOpName
from zeroshard.comm.env import LaunchEnv, expand_hostlist, parse_launch_env
from zeroshard.comm.groups import ProcessGroups, destroy_distributed, init_distributed
from zeroshard.comm.log import CommLog, CommRecord

__all__ = [
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
