"""comm/topology.py: the pp x dp x tp rank arithmetic against hand-written tables (DeepSpeed's
layout: tensor-parallel ranks adjacent), and the one-process mesh without a process group."""

from __future__ import annotations

import importlib.util

import pytest

from zeroshard.comm import ProcessGroups
from zeroshard.comm.topology import AXES, MeshGroups, Topology, build_mesh

# pp 2 x dp 2 x tp 2 on 8 ranks: rank = (pp * 2 + dp) * 2 + tp.
TABLE_222 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
}
COORDS_222 = {0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 1, 0), 3: (0, 1, 1),
              4: (1, 0, 0), 5: (1, 0, 1), 6: (1, 1, 0), 7: (1, 1, 1)}
# pp 3 x dp 2 x tp 1 on 6 ranks (not a power of two): rank = pp * 2 + dp.
TABLE_321 = {
    "tp": [[0], [1], [2], [3], [4], [5]],
    "dp": [[0, 1], [2, 3], [4, 5]],
    "pp": [[0, 2, 4], [1, 3, 5]],
}
# pp 1 x dp 3 x tp 2 on 6 ranks.
TABLE_132 = {
    "tp": [[0, 1], [2, 3], [4, 5]],
    "dp": [[0, 2, 4], [1, 3, 5]],
    "pp": [[0], [1], [2], [3], [4], [5]],
}
CASES = [((2, 2, 2), TABLE_222), ((3, 2, 1), TABLE_321), ((1, 3, 2), TABLE_132)]


@pytest.mark.parametrize(("sizes", "table"), CASES)
def test_every_rank_groups_match_the_table(sizes: tuple[int, int, int], table: dict[str, list[list[int]]]) -> None:
    pp, dp, tp = sizes
    topo = Topology(pp=pp, dp=dp, tp=tp)
    assert topo.world_size == pp * dp * tp
    for axis in AXES:
        assert topo.axis_groups(axis) == table[axis]
        for rank in range(topo.world_size):
            (mine,) = [g for g in table[axis] if rank in g]
            assert topo.axis_ranks(axis, rank) == mine
    for rank in range(topo.world_size):
        c = topo.coord(rank)
        assert rank == (c["pp"] * dp + c["dp"]) * tp + c["tp"]
        assert topo.rank_at(**c) == rank


def test_coordinates_of_the_8_rank_cube() -> None:
    topo = Topology(pp=2, dp=2, tp=2)
    for rank, (pp, dp, tp) in COORDS_222.items():
        assert topo.coord(rank) == {"pp": pp, "dp": dp, "tp": tp}
        assert topo.rank_at(pp=pp, dp=dp, tp=tp) == rank


def test_model_parallel_group_is_pp_times_tp() -> None:
    # The gradient norm's second sum: the ranks differing only in pipeline stage or TP shard.
    assert Topology(pp=2, dp=2, tp=2).axes_groups("pp", "tp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert Topology(pp=3, dp=2, tp=1).axes_groups("pp", "tp") == [[0, 2, 4], [1, 3, 5]]
    assert Topology(pp=2, dp=2, tp=2).axes_ranks(6, "pp", "tp") == [2, 3, 6, 7]
    assert Topology(dp=4).axes_groups("pp", "tp") == [[0], [1], [2], [3]]
    assert Topology(pp=2, dp=2, tp=2).axes_groups(*AXES) == [list(range(8))]


def test_node_split_subdivides_every_dp_group() -> None:
    # Data parallelism only (today): ZeRO++'s node / cross lists, as comm/groups.node_rank_lists.
    assert Topology(dp=4).node_split(2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert Topology(dp=6).node_split(3) == ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]])
    # tp 2 x dp 4: dp groups [0, 2, 4, 6] and [1, 3, 5, 7], each cut into nodes of 2 dp ranks.
    nodes, cross = Topology(dp=4, tp=2).node_split(2)
    assert nodes == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert cross == [[0, 4], [2, 6], [1, 5], [3, 7]]


def test_for_world_derives_dp_and_refuses_what_does_not_divide() -> None:
    assert Topology.for_world(8, pp=2, tp=2) == Topology(pp=2, dp=2, tp=2)
    assert Topology.for_world(6, pp=3) == Topology(pp=3, dp=2, tp=1)
    assert Topology.for_world(3) == Topology(dp=3)
    with pytest.raises(ValueError, match=r"pp \* tp \(4\) must divide the world size"):
        Topology.for_world(6, pp=2, tp=2)
    with pytest.raises(ValueError, match="positive integer"):
        Topology(dp=0)
    with pytest.raises(ValueError, match="outside"):
        Topology(dp=2).coord(2)
    with pytest.raises(ValueError, match="tp=2 is outside"):
        Topology(tp=2).rank_at(tp=2)
    with pytest.raises(ValueError, match="axis names"):
        Topology().axes_groups("sp")


def test_single_process_mesh_has_no_device_mesh_and_local_axes() -> None:
    world = ProcessGroups.single()
    mesh = build_mesh(world, Topology())
    assert mesh.mesh is None and mesh.coord == {"pp": 0, "dp": 0, "tp": 0}
    assert build_mesh(world, Topology()) is mesh  # built once
    for axis in AXES:
        assert mesh.axis(axis).world_size == 1 and mesh.axis(axis).dp_group is None
    assert mesh.axis("dp") is world  # dp spans the world: the world's own ProcessGroups
    assert mesh.axes("pp", "tp").world_size == 1
    with pytest.raises(Exception, match="has 2 ranks, but the process group has 1"):
        MeshGroups(world, Topology(dp=2), None)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize(("pp", "dp", "tp"), [(2, 2, 2), (3, 2, 1), (1, 3, 2), (2, 3, 2)])
def test_same_layout_as_deepspeed(pp: int, dp: int, tp: int) -> None:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    theirs = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    ours = Topology(pp=pp, dp=dp, tp=tp)
    for axis, name in (("pp", "pipe"), ("dp", "data"), ("tp", "model")):
        assert ours.axis_groups(axis) == theirs.get_axis_comm_lists(name)
    for rank in range(ours.world_size):
        c = theirs.get_coord(rank)
        assert ours.coord(rank) == {"pp": c.pipe, "dp": c.data, "tp": c.model}
