"""DeepSpeed's ``parallel_state_sp`` (the mpu ALST's ``register_with_transformers`` returns), over
zeroshard's sequence-parallel groups (sequence/sp_groups.py).

A script calls `initialize_sequence_parallel(sp)` after the process group exists and before
``initialize``; passing this module as ``initialize(mpu=...)`` then tells the engine the size (its
model-parallel queries answer the sequence group, as DeepSpeed's do). The groups are the ones the
config route (``"sequence_parallel_size"``) makes: blocks of ``sp`` consecutive ranks.
"""

from __future__ import annotations

from typing import Any

from zeroshard.comm import is_initialized
from zeroshard.comm.groups import current_groups, init_distributed
from zeroshard.sequence.sp_groups import (
    SequenceGroups,
    create_sequence_groups,
    current_sequence_groups,
    forget_sequence_groups,
)


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Create the sequence-parallel groups of `sequence_parallel_size` consecutive ranks.

    Raises:
        RuntimeError: no process group yet, or the size does not fit the world.
        ValueError: a size of 1 or less (DeepSpeed's refusal: nothing to split).
    """
    world = current_groups() or (init_distributed() if is_initialized() else None)  # the script's own group
    if world is None:
        raise RuntimeError("initialize_sequence_parallel: no process group yet; call deepspeed.init_distributed() "
                           "(zeroshard.init_distributed()) first")
    if world.world_size < sequence_parallel_size:
        raise RuntimeError(f"world_size ({world.world_size}) is less than sequence_parallel_size "
                           f"{sequence_parallel_size}")
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    if world.world_size % sequence_parallel_size:
        raise RuntimeError(f"world_size ({world.world_size}) is not divisible by sequence_parallel_size "
                           f"{sequence_parallel_size}")
    create_sequence_groups(world, sequence_parallel_size)


def _groups() -> SequenceGroups:
    found = current_sequence_groups()
    if found is None:
        raise AssertionError("sequence parallel group is not initialized: call initialize_sequence_parallel(size) "
                             "or set sequence_parallel_size in the config")
    return found


def _release_sequence_parallel_groups() -> None:
    forget_sequence_groups()


def get_sequence_parallel_group() -> Any:
    return _groups().sp.dp_group


def get_sequence_data_parallel_group() -> Any:
    return _groups().seq_dp.dp_group


def get_sequence_parallel_world_size() -> int:
    return _groups().sp.world_size


def get_sequence_data_parallel_world_size() -> int:
    return _groups().seq_dp.world_size


def get_sequence_parallel_rank() -> int:
    return _groups().sp.rank


def get_sequence_data_parallel_rank() -> int:
    return _groups().seq_dp.rank


get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
