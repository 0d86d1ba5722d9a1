"""`deepspeed.comm`'s functions (torch.distributed's shape) over zeroshard's process group.

Scripts written for DeepSpeed call `deepspeed.comm.get_rank()`, `all_reduce(t)`, ...; with
`import zeroshard as deepspeed` these land here. Each call works without a process group too
(world size 1: reductions and broadcasts leave the tensor as it is, gathers copy it), so a
script runs under plain `python` as it does under torchrun. `group=None` is the data-parallel
group zeroshard joined (`init_distributed`), else torch's default group.

`init_distributed` takes DeepSpeed's keyword names and returns zeroshard's `ProcessGroups`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import zeroshard.comm.groups as _groups
from zeroshard.comm.checked import verify_wanted
from zeroshard.comm.divergence import tracker_of
from zeroshard.comm.user_collectives import checked_call

ReduceOp = dist.ReduceOp


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None,
                     rank: int = -1, world_size: int = -1, *, backend: str | None = None,
                     timeout_s: float | None = None) -> _groups.ProcessGroups:
    """Join the job's process group: DeepSpeed's `init_distributed` signature over
    :func:`zeroshard.comm.groups.init_distributed` (torchrun, OpenMPI and SLURM environments).

    Args:
        dist_backend: torch.distributed backend ("nccl", "gloo"); zeroshard's `backend=`.
        auto_mpi_discovery: read OpenMPI's variables when torchrun's are absent (zeroshard
            always does; False is accepted).
        distributed_port: rendezvous port when `MASTER_PORT` is unset.
        verbose, config: accepted; zeroshard logs through the "zeroshard" logger.
        timeout: collective timeout (a timedelta); zeroshard's `timeout_s=` in seconds.
        dist_init_required: False with no process group: stay a single process.
        init_method, rank, world_size: an explicit rendezvous, handed to torch as DeepSpeed does
            (`init_method` defaults to "env://"; without a launcher, `rank` and `world_size`
            are required). Where a launcher's environment is set too (RANK/WORLD_SIZE,
            OpenMPI's or SLURM's variables), it gives the rank and world size, an `init_method`
            other than "env://" is still where the ranks meet, and a `rank=`/`world_size=` that
            contradicts the launcher raises CommError (DeepSpeed hands all three to torch).

    Returns:
        The process's ProcessGroups (DeepSpeed returns None).

    Raises:
        CommError: an explicit rank/world_size contradicts the launcher, is incomplete, or the
            group cannot be joined.
    """
    explicit = _groups.Rendezvous(init_method=init_method, rank=None if rank == -1 else rank,
                                  world_size=None if world_size == -1 else world_size)
    if backend is not None and dist_backend is not None and backend != dist_backend:
        raise ValueError(f"init_distributed: backend={backend!r} and dist_backend={dist_backend!r} disagree")
    if timeout is not None and timeout_s is None:
        timeout_s = timeout.total_seconds()
    if distributed_port != 29500:  # 29500 is every launcher's default already
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if dist_init_required is False and not dist.is_initialized():
        return _groups.ProcessGroups.single()
    return _groups.init_distributed(backend=backend or dist_backend, timeout_s=timeout_s, rendezvous=explicit)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def _group(group: Any) -> Any:
    if group is not None:
        return group
    current = _groups._GROUPS
    return current.dp_group if current is not None and current.dp_group is not None else None


def get_rank(group: Any = None) -> int:
    return dist.get_rank(_group(group)) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(_group(group)) if is_initialized() else 1


def get_local_rank() -> int:
    current = _groups._GROUPS
    if current is not None:
        return current.local_rank
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    if not is_initialized() or group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_world_group() -> Any:
    return dist.group.WORLD if is_initialized() else None


def new_group(ranks: Sequence[int]) -> Any:
    return dist.new_group(list(ranks))


def destroy_process_group(group: Any = None) -> None:
    if group is None:
        _groups.destroy_distributed()
    if is_initialized():
        dist.destroy_process_group(group)


class _Done:
    """The handle an async call returns without a process group: already complete."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _run(call: Any, async_op: bool, op: str = "", tensor: torch.Tensor | None = None, group: Any = None) -> Any:
    """Issue `call`. On a group zeroshard tracks, the call is first sequenced and, for CPU tensors,
    signature-checked like zeroshard's own collectives (Note: [script collectives] in
    user_collectives.py): a collective one rank issues through `deepspeed.comm` and the others
    do not is reported by every rank, not by gloo. `call` runs torch's `distributed_c10d`
    functions, which the wrappers of torch.distributed's namespace do not count again."""
    tracker = tracker_of(_group(group)) if op else None
    if tracker is None or not verify_wanted():
        work = call()
        return work if async_op else None
    current = _groups._GROUPS
    timeout_s = current.timeout_s if current is not None else 1800.0
    numel, dtype = (0, None) if tensor is None else (tensor.numel(), tensor.dtype)
    on_cpu = tensor is None or tensor.device.type == "cpu"
    work = checked_call(tracker, call, "deepspeed.comm", op, numel, dtype, timeout_s, check=on_cpu)
    return work if async_op else None


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
    if not is_initialized():
        return _Done() if async_op else None
    return _run(lambda: c10d.barrier(group=_group(group), async_op=async_op, device_ids=device_ids), async_op,
                "barrier", None, group)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    if not is_initialized():
        return _Done() if async_op else None
    return _run(lambda: c10d.all_reduce(tensor, op=op, group=_group(group), async_op=async_op), async_op,
                "all_reduce", tensor, group)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    if not is_initialized():
        return _Done() if async_op else None
    return _run(lambda: c10d.reduce(tensor, dst, op=op, group=_group(group), async_op=async_op), async_op,
                "reduce", tensor, group)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    if not is_initialized():
        return _Done() if async_op else None
    return _run(lambda: c10d.broadcast(tensor, src, group=_group(group), async_op=async_op), async_op,
                "broadcast", tensor, group)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Any:
    if not is_initialized():
        tensor_list[0].copy_(tensor)
        return _Done() if async_op else None
    return _run(lambda: c10d.all_gather(tensor_list, tensor, group=_group(group), async_op=async_op), async_op,
                "all_gather", tensor, group)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Any:
    if not is_initialized():
        output_tensor.copy_(input_tensor.reshape(output_tensor.shape))
        return _Done() if async_op else None
    return _run(lambda: c10d.all_gather_into_tensor(output_tensor, input_tensor, group=_group(group),
                                                    async_op=async_op), async_op, "all_gather", input_tensor, group)


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False) -> Any:
    if not is_initialized():
        output_tensor.copy_(input_tensor.reshape(output_tensor.shape))
        return _Done() if async_op else None
    return _run(lambda: c10d.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=_group(group),
                                                   async_op=async_op), async_op, "reduce_scatter", input_tensor,
                group)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    if not is_initialized():
        object_list[0] = obj
        return
    _run(lambda: c10d.all_gather_object(object_list, obj, group=_group(group)), False, "all_gather_object", None,
         group)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None) -> None:
    if is_initialized():
        _run(lambda: c10d.broadcast_object_list(object_list, src, group=_group(group), device=device), False,
             "broadcast_object_list", None, group)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: Any = None,
                      input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:
    if not is_initialized():
        output.copy_(tensor)
        return _Done() if async_op else None
    return _run(lambda: c10d.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes,
                                               group=_group(group), async_op=async_op), async_op,
                "all_to_all", None, group)  # split sizes may differ per rank: checked as an op only


__all__ = [
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all_single",
    "barrier", "broadcast", "broadcast_object_list", "destroy_process_group", "get_global_rank",
    "get_local_rank", "get_rank", "get_world_group", "get_world_size", "init_distributed", "is_available",
    "is_initialized", "new_group", "reduce", "reduce_scatter_tensor",
]
