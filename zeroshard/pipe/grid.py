"""DeepSpeed's `PipelineParallelGrid` (`engine.grid`, `PipelineModule._grid`, `engine.mpu` of a
pipeline): which stage, pipeline and tensor slice this rank is, and the process group of each.

Pipeline scripts written for DeepSpeed shard their data and name their files with it
(`engine.grid.get_data_parallel_rank()`); Megatron-style code reads it as an `mpu`. Here it is a
read-only view: the coordinates come from the module's `ProcessTopology`, the groups from
comm/topology.py's mesh (the groups the engine trains with), so a script's collective on
`get_data_parallel_group()` runs over exactly the ranks ZeRO reduces over. Nothing is decided here.

DeepSpeed's "model parallel" group of a pipeline is every rank holding a part of one model replica
(all stages and tensor slices of one data-parallel index), its "slice" group the tensor-parallel
ranks. An axis of size 1 has no group in the mesh (its collectives are local); a script that hands
`dist.all_reduce` that axis's group gets a real one-rank group, never None (which torch reads as
the whole world).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zeroshard.comm.groups import ProcessGroups, current_groups, init_distributed
from zeroshard.comm.topology import MeshGroups, build_mesh
from zeroshard.pipe.topology import PipeDataParallelTopology, ProcessTopology


def default_topology(world_size: int) -> PipeDataParallelTopology:
    """DeepSpeed's grid without a topology: the world's prime factors, smallest first, dealt
    alternately to the pipeline and the data-parallel axis.

    >>> [(t.get_dim("pipe"), t.get_dim("data")) for t in map(default_topology, (1, 2, 6, 8, 12))]
    [(1, 1), (2, 1), (2, 3), (4, 2), (6, 2)]
    """
    factors, n, p = [], world_size, 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    pp = dp = 1
    for i, f in enumerate(factors):
        if i % 2 == 0:
            pp *= f
        else:
            dp *= f
    return PipeDataParallelTopology(num_pp=pp, num_dp=dp)


class PipelineParallelGrid:
    """This rank's place in a pipeline x data x tensor grid, with DeepSpeed's names.

    Args:
        topology: the grid (a `PipeDataParallelTopology` / `PipeModelDataParallelTopology`);
            DeepSpeed's default split of the world when None.
        process_group: accepted for DeepSpeed's signature; the world is the current process group.
        mesh: the engine's groups (internal: the engine passes its own so that no group is built twice).
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None, *,
                 mesh: MeshGroups | None = None) -> None:
        del process_group  # DeepSpeed ignores it as well (its own TODO); the world is the current group
        world = mesh.world if mesh is not None else (current_groups() or init_distributed())
        self._topo = topology if topology is not None else default_topology(world.world_size)
        ours = self._topo.as_topology()
        if mesh is None or mesh.topology != ours:
            mesh = build_mesh(world, ours)  # collective (DeepSpeed's constructor creates groups too); built once
        self._mesh = mesh
        self._solo: Any = None
        self.global_rank = world.rank
        self.world_size = world.world_size
        self.pipe_parallel_size, self.data_parallel_size, self.model_parallel_size = ours.pp, ours.dp, ours.tp
        self.slice_parallel_size = ours.tp
        coord = ours.coord(self.global_rank)
        self.stage_id, self.data_parallel_id = coord["pp"], coord["dp"]
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == ours.pp - 1
        self.dp_group = ours.axis_ranks("dp", self.global_rank)
        self.pp_group = ours.axis_ranks("pp", self.global_rank)
        self.p2p_groups = [[r, self._next_stage(r)] for r in range(self.world_size)]

    def _next_stage(self, rank: int) -> int:
        ranks = self._mesh.topology.axis_ranks("pp", rank)
        return ranks[(ranks.index(rank) + 1) % len(ranks)]

    def _group(self, groups: ProcessGroups) -> Any:
        """The torch process group of one of the mesh's groups (a real one-rank group for size 1)."""
        if groups.dp_group is not None or not dist.is_initialized():
            return groups.dp_group
        if self._solo is None:  # only this rank is in it, so only this rank needs to create it
            self._solo = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        return self._solo

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of `stage_id` in this rank's pipeline (or at the given `data=` / `model=`)."""
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **kwargs)._asdict())

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self._group(self._mesh.axis("pp"))

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self._group(self._mesh.axis("dp"))

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_group)

    def get_model_parallel_rank(self) -> int:
        """Position among the ranks holding one model replica (every stage and tensor slice)."""
        return self._mesh.axes("pp", "tp").rank

    def get_model_parallel_world_size(self) -> int:
        return self.pipe_parallel_size * self.slice_parallel_size

    def get_model_parallel_group(self) -> Any:
        return self._group(self._mesh.axes("pp", "tp"))

    def get_slice_parallel_rank(self) -> int:
        return self._mesh.coord["tp"]

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self._group(self._mesh.axis("tp"))

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size

    def __repr__(self) -> str:
        return (f"PipelineParallelGrid(pipe {self.pipe_parallel_size} x data {self.data_parallel_size} x "
                f"model {self.slice_parallel_size}, rank {self.global_rank}: stage {self.stage_id}, "
                f"data {self.data_parallel_id})")
