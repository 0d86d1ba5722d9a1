"""The sequence-parallel groups of this process: which ranks share one sample, and which ranks the
batch is split over.

One layout serves both routes into sequence parallelism: ``"sequence_parallel_size"`` in the
config (``initialize`` creates the groups over the mesh's data axis) and DeepSpeed's
``parallel_state_sp.initialize_sequence_parallel(sp)``, which ALST scripts call before
``initialize`` (the groups are then made over the world, which is the mesh's data axis when there
is no pipeline or tensor parallelism). The layout is `ParallelDims.sequence_rank_lists`
(comm/parallel_dims.py): blocks of ``sp`` consecutive ranks share a sample. Creating the same
partition twice returns the same process groups (comm/groups.py's `subgroup` cache), so the two
routes agree by construction. Imports only `zeroshard.comm`.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard.comm import ProcessGroups
from zeroshard.comm.groups import on_destroy, subgroup
from zeroshard.comm.parallel_dims import ParallelDims


@dataclass(frozen=True, slots=True)
class SequenceGroups:
    """The groups of one sequence-parallel layout, as seen from this rank."""

    sp: ProcessGroups
    """The ranks holding slices of the same samples (attention exchanges over it)."""
    dp: ProcessGroups
    """The ranks holding different samples (the data loader's split)."""
    seq_dp: ProcessGroups
    """Both together: ZeRO partitions and reduces over these ranks."""

    @property
    def size(self) -> int:
        return self.sp.world_size


_CURRENT: list[SequenceGroups] = []
on_destroy(_CURRENT.clear)  # a new world builds its own groups (Note: [groups die before finalization])


def create_sequence_groups(seq_dp: ProcessGroups, sp: int) -> SequenceGroups:
    """The sequence-parallel layout of size `sp` over `seq_dp` (ZeRO's group: the mesh's data axis,
    or the world), made this process's current one.

    Collective over the world: every rank calls it with the same size.

    Raises:
        ValueError: `sp` does not divide the group (the message lists the sizes that do).
    """
    if sp < 1 or seq_dp.world_size % sp:
        fits = [d for d in range(1, seq_dp.world_size + 1) if seq_dp.world_size % d == 0]
        raise ValueError(f"sequence_parallel_size {sp} must divide the {seq_dp.world_size} data-parallel rank(s); "
                         f"use one of {fits}.")
    found = current_sequence_groups()
    if found is not None and found.seq_dp == seq_dp and found.size == sp:
        return found
    dims = ParallelDims(world_size=seq_dp.world_size, dp=seq_dp.world_size // sp, sp=sp)
    sp_lists, dp_lists = dims.sequence_rank_lists()
    groups = SequenceGroups(sp=subgroup(seq_dp, sp_lists), dp=subgroup(seq_dp, dp_lists), seq_dp=seq_dp)
    _CURRENT[:] = [groups]
    return groups


def current_sequence_groups() -> SequenceGroups | None:
    """The layout last created in this process (None before any, and after the world is destroyed)."""
    return _CURRENT[0] if _CURRENT else None


def forget_sequence_groups() -> None:
    """No current layout (DeepSpeed's ``_release_sequence_parallel_groups``); the process groups
    themselves stay cached for a later layout of the same shape."""
    _CURRENT.clear()


def sequence_parallel_size() -> int:
    """The current layout's size (1 without sequence parallelism)."""
    found = current_sequence_groups()
    return found.size if found is not None else 1
