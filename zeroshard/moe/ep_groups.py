"""Expert-parallel and expert-data-parallel groups, laid out as DeepSpeed 0.19.8 lays them out.

For `ep_size` E in a data-parallel world of W ranks, consecutive blocks of E ranks form the
expert-parallel groups (the ranks that split one layer's experts among them) and ranks at the
same position in every block form the expert-data-parallel groups (the ranks holding the same
experts, over which their gradients are reduced). W = 4, E = 2: expert-parallel [0, 1], [2, 3];
expert-data-parallel [0, 2], [1, 3]. The registry keeps them by DeepSpeed's group name
"ep_size_<E>" and serves `deepspeed.utils.groups`' getters. The layout itself is
`ParallelDims.expert_rank_lists` (comm/parallel_dims.py), the home of every dimension's sizes.
Imports torch.distributed and `zeroshard.comm`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from zeroshard.comm import Comm, ProcessGroups
from zeroshard.comm.groups import on_destroy, subgroup
from zeroshard.comm.parallel_dims import ParallelDims


def group_name(ep_size: int) -> str:
    """DeepSpeed's name for the groups of one expert-parallel size."""
    return f"ep_size_{ep_size}"


def expert_parallel_ranks(world_size: int, ep_size: int,
                          data_before_expert: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) of a data-parallel world, in ranks.

    `data_before_expert` is DeepSpeed's `use_data_before_expert_parallel_`: the expert-parallel
    groups take strided ranks ([0, 2], [1, 3] at W = 4, E = 2) instead of consecutive ones.

    Raises:
        ValueError: `ep_size` does not divide `world_size`.
    """
    if ep_size < 1 or world_size % ep_size:
        raise ValueError(f"MoE ep_size={ep_size} must divide the data-parallel world size ({world_size}); "
                         f"use one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}")
    return ParallelDims(world_size=world_size, dp=world_size, ep=ep_size).expert_rank_lists(data_before_expert)


@dataclass(frozen=True, slots=True)
class ExpertGroups:
    """The two groups of one expert-parallel size, as seen from this rank."""

    name: str
    """DeepSpeed's group name, "ep_size_<E>"; expert parameters carry it as `group_name`."""
    ep: ProcessGroups
    """The expert-parallel group: tokens are exchanged over it (all-to-all)."""
    edp: ProcessGroups
    """The expert-data-parallel group: expert gradients are reduced over it."""
    ep_ranks: tuple[int, ...]
    """Global ranks of this rank's expert-parallel group."""
    edp_ranks: tuple[int, ...]
    """Global ranks of this rank's expert-data-parallel group."""
    ep_comm: Comm
    edp_comm: Comm


_REGISTRY: dict[str, ExpertGroups] = {}
"""By DeepSpeed's name: the groups the last engine set up (what `deepspeed.utils.groups` serves)."""
_BUILT: dict[tuple[str, int, tuple[tuple[int, ...], ...]], ExpertGroups] = {}
"""By name and data-parallel layout: a later engine over the same layout reuses the groups, one over
another layout (tensor or pipeline parallel ranks beside the data-parallel ones) gets its own."""
on_destroy(_REGISTRY.clear)  # a new world builds its own groups (Note: [groups die before finalization])
on_destroy(_BUILT.clear)


def create_expert_groups(dp: ProcessGroups, ep_size: int, comm: Comm) -> ExpertGroups:
    """The groups for `ep_size` over the data-parallel group `dp` (created once per size and
    data-parallel layout).

    Collective over the world: every rank calls it with the same sizes in the same order.
    `comm` is the data-parallel Comm; the new Comms share its log and timeout.
    """
    name = group_name(ep_size)
    key = (name, dp.world_size, dp.siblings)
    if key in _BUILT:
        _REGISTRY[name] = _BUILT[key]
        return _BUILT[key]
    ep_lists, edp_lists = expert_parallel_ranks(dp.world_size, ep_size)
    ep, edp = subgroup(dp, ep_lists), subgroup(dp, edp_lists)
    mine = dp.rank
    groups = ExpertGroups(
        name=name, ep=ep, edp=edp,
        ep_ranks=_global_ranks(dp, next(g for g in ep_lists if mine in g)),
        edp_ranks=_global_ranks(dp, next(g for g in edp_lists if mine in g)),
        ep_comm=Comm(ep, timeout_s=comm.timeout_s, log=comm.log, label=f"ep:{name}"),
        edp_comm=Comm(edp, timeout_s=comm.timeout_s, log=comm.log, label=f"edp:{name}"))
    _REGISTRY[name] = _BUILT[key] = groups
    return groups


def _global_ranks(dp: ProcessGroups, positions: list[int]) -> tuple[int, ...]:
    """Positions in `dp` as global ranks: `dp` is the world, or one of its `siblings` (a mesh axis
    beside tensor-parallel or pipeline ranks), the one holding this rank."""
    if not dp.siblings or not dist.is_initialized():
        return tuple(positions)
    me = dist.get_rank()
    own = next(sib for sib in dp.siblings if me in sib)
    return tuple(own[p] for p in positions)


def expert_groups(name: str) -> ExpertGroups:
    """The groups registered under `name` ("ep_size_<E>").

    Raises:
        RuntimeError: no MoE layer of that size was set up (zeroshard.initialize sets them up).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise RuntimeError(f"expert parallel group {name!r} is not initialized: zeroshard.initialize() creates the "
                           f"groups of every MoE layer of the model it is given (known: {sorted(_REGISTRY)})") from None


def registered() -> dict[str, ExpertGroups]:
    """Every expert group set up so far, by name."""
    return dict(_REGISTRY)
