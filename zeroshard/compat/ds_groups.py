"""`deepspeed.utils.groups`' expert-group getters, answered from zeroshard's expert groups
(moe/ep_groups.py), which `zeroshard.initialize` creates for every MoE layer of the model.

Group names are DeepSpeed's, "ep_size_<E>". A group of one rank has no torch process group in
zeroshard: its getter returns None (the rank and size getters are right either way).
"""

from __future__ import annotations

from typing import Any

from zeroshard.comm.groups import current_groups
from zeroshard.moe.ep_groups import expert_groups, expert_parallel_ranks, registered
from zeroshard.sequence.sp_groups import current_sequence_groups

mpu: Any = None
"""DeepSpeed's model-parallel unit slot: zeroshard's MoE layers take no mpu (no tensor-parallel experts)."""


def _get_expert_parallel_group(group_name: str) -> Any:
    return expert_groups(group_name).ep.dp_group


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return list(expert_groups(group_name).ep_ranks)


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {name: g.ep.dp_group for name, g in registered().items()}


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return expert_groups(group_name).edp.dp_group


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return list(expert_groups(group_name).edp_ranks)


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return {name: g.edp.dp_group for name, g in registered().items()}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return expert_groups(group_name).ep.world_size


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return expert_groups(group_name).edp.world_size


def _get_expert_parallel_rank(group_name: str) -> int:
    return expert_groups(group_name).ep.rank


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return expert_groups(group_name).edp.rank


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The global rank of position 0 of this rank's expert-parallel group."""
    return expert_groups(group_name).ep_ranks[0]


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank of position 0 of this rank's expert-data-parallel group."""
    return expert_groups(group_name).edp_ranks[0]


def _get_max_expert_size_name() -> str:
    names = registered()
    if not names:
        raise RuntimeError("no expert parallel group is initialized: zeroshard.initialize() creates them")
    return max(names, key=lambda n: names[n].ep.world_size)


def _get_max_expert_size() -> int:
    return registered()[_get_max_expert_size_name()].ep.world_size


def _get_max_expert_parallel_group() -> Any:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_model_parallel_world_size() -> int:
    """Tensor parallelism inside experts: not implemented, so 1."""
    return 1


def _get_data_parallel_group() -> Any:
    groups = current_groups()
    return None if groups is None else groups.dp_group


def _get_data_parallel_world_size() -> int:
    groups = current_groups()
    return 1 if groups is None else groups.world_size


def _get_data_parallel_rank() -> int:
    groups = current_groups()
    return 0 if groups is None else groups.rank


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1,
                               use_data_before_expert_parallel_: bool = False
                               ) -> tuple[list[list[int]], list[list[int]]]:
    """DeepSpeed's layout function, for data parallelism only (tensor and pipeline size 1).

    Raises:
        ValueError: a tensor or pipeline size other than 1, or an ep size that does not divide.
    """
    if tensor_parallel_size_ != 1 or pipeline_parallel_size_ != 1:
        raise ValueError("zeroshard lays out expert groups for data parallelism only (tensor_parallel_size_ and "
                         "pipeline_parallel_size_ 1)")
    return expert_parallel_ranks(world_size, expert_parallel_size_, use_data_before_expert_parallel_)


def _get_sequence_parallel_group() -> Any:
    """The sequence-parallel group (a torch process group).

    Raises:
        KeyError: there is none (DeepSpeed's error without a sequence-parallel mpu or mesh).
    """
    seq = current_sequence_groups()
    if seq is None:
        raise KeyError("No sequence parallel group found")
    return seq.sp.dp_group


def _get_sequence_parallel_world_size() -> int:
    seq = current_sequence_groups()
    return 1 if seq is None else seq.sp.world_size


def _get_sequence_parallel_rank() -> int:
    seq = current_sequence_groups()
    return 0 if seq is None else seq.sp.rank


def _get_sequence_data_parallel_group() -> Any:
    """ZeRO's group with sequence parallelism (data x sequence ranks); the data-parallel group without."""
    seq = current_sequence_groups()
    return _get_data_parallel_group() if seq is None else seq.seq_dp.dp_group


def _get_sequence_data_parallel_world_size() -> int:
    seq = current_sequence_groups()
    return _get_data_parallel_world_size() if seq is None else seq.seq_dp.world_size


def _get_sequence_data_parallel_rank() -> int:
    seq = current_sequence_groups()
    return _get_data_parallel_rank() if seq is None else seq.seq_dp.rank
