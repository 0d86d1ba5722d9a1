"""MeshGroups (comm/topology.py) over a real process group: every pp x dp x tp layout of the
world, a collective on every axis checked against the topology's table, ZeRO++'s node split of
the dp axis, and the gradient norm's second sum over pp x tp reaching the ZeRO strategies.

Runs at any world size (1 under plain pytest; 2, 3 and 4 ranks under torchrun). Each test
builds its meshes and leaves the data-parallel-only mesh current, as initialize() builds it.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from zeroshard.comm import Comm, ProcessGroups
from zeroshard.comm.topology import AXES, MeshGroups, Topology, build_mesh
from zeroshard.zero.stage0 import Stage0Strategy
from zeroshard.zero.stage12 import PartitionOptions, Stage1Strategy
from zeroshard.zero.strategy import ModelParallelNorm


def layouts(world: int) -> list[Topology]:
    """Every (pp, dp, tp) whose product is the world size."""
    return [Topology(pp=pp, dp=world // (pp * tp), tp=tp)
            for pp in range(1, world + 1) for tp in range(1, world + 1) if world % (pp * tp) == 0]


def test_data_parallel_mesh_is_the_world(groups: ProcessGroups) -> None:
    mesh = build_mesh(groups, Topology.for_world(groups.world_size))
    assert build_mesh(groups, Topology.for_world(groups.world_size)) is mesh  # built once
    assert mesh.axis("dp") is groups  # ZeRO's group is unchanged: the same object, tracker and cache
    assert mesh.coord == {"pp": 0, "dp": groups.rank, "tp": 0}
    for axis in ("pp", "tp"):
        assert mesh.axis(axis).world_size == 1 and mesh.axis(axis).dp_group is None
    assert mesh.axes("pp", "tp").world_size == 1
    if groups.dp_group is None:
        assert mesh.mesh is None
    else:
        assert mesh.mesh is not None and mesh.mesh.mesh_dim_names == AXES
        assert mesh.mesh.shape == (1, groups.world_size, 1)


def _check_group(mesh: MeshGroups, names: tuple[str, ...], rank: int) -> None:
    want = mesh.topology.axes_ranks(rank, *names)
    pg = mesh.axes(*names)
    assert pg.world_size == len(want) and pg.rank == want.index(rank), (names, pg)
    comm = Comm(pg)
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t)
    assert t.item() == sum(r + 1 for r in want), (mesh.topology, names)
    out = torch.zeros(len(want), dtype=torch.int64)
    comm.all_gather(out, torch.tensor([rank]))
    assert out.tolist() == want, (mesh.topology, names)  # positions follow the topology's order


@pytest.mark.parametrize("index", range(6))
def test_collective_on_every_axis(groups: ProcessGroups, index: int) -> None:
    """Layout `index` of the world's factorizations (2 ranks: 3 layouts; 3: 3; 4: 6)."""
    all_layouts = layouts(groups.world_size)
    if index >= len(all_layouts):
        pytest.skip(f"a world of {groups.world_size} has {len(all_layouts)} layouts")
    topo = all_layouts[index]
    mesh = build_mesh(groups, topo)
    assert mesh.coord == topo.coord(groups.rank)
    if mesh.mesh is not None:
        assert mesh.mesh.shape == (topo.pp, topo.dp, topo.tp)
        for axis in AXES:  # DeviceMesh agrees with the arithmetic
            assert mesh.mesh.get_local_rank(axis) == mesh.coord[axis]
    for names in (("pp",), ("dp",), ("tp",), ("pp", "tp"), ("dp", "tp"), AXES):
        _check_group(mesh, names, groups.rank)


def test_node_split_is_a_subdivision_of_dp(groups: ProcessGroups) -> None:
    """ZeRO++'s node / cross groups, from the mesh and from a Comm on its dp axis: the same."""
    world = groups.world_size
    for topo in layouts(world):
        mesh = build_mesh(groups, topo)
        dp = mesh.axis("dp")
        for size in [s for s in range(1, topo.dp + 1) if topo.dp % s == 0]:
            node, cross = mesh.node_split(size)
            nodes, crosses = topo.node_split(size)
            (want_node,) = [g for g in nodes if groups.rank in g]
            (want_cross,) = [g for g in crosses if groups.rank in g]
            assert (node.world_size, cross.world_size) == (len(want_node), len(want_cross))
            node_comm, cross_comm = Comm(dp).node_split(size)
            assert node_comm.groups.dp_group is node.dp_group and cross_comm.groups.dp_group is cross.dp_group
            for pg, want in ((node, want_node), (cross, want_cross)):
                out = torch.zeros(len(want), dtype=torch.int64)
                Comm(pg).all_gather(out, torch.tensor([groups.rank]))
                assert out.tolist() == want, (topo, size)


def _norm_after_backward(strategy: Stage0Strategy | Stage1Strategy, param: nn.Parameter,
                         grad: torch.Tensor) -> float:
    strategy.begin_micro_batch(True)
    (param * grad).sum().backward()
    strategy.after_backward()
    return strategy.prepare_step(1.0, 0.0).norm


@pytest.mark.parametrize("stage", [0, 1])
def test_gradient_norm_sums_over_tp(groups: ProcessGroups, stage: int) -> None:
    """Each tensor-parallel rank holds a different slice of the gradient: the norm every rank
    reports is the norm of the whole (the dp-average of identical slices, summed over tp)."""
    world = groups.world_size
    topo = Topology.for_world(world, tp=world) if world > 1 else Topology()
    mesh = build_mesh(groups, topo)
    dp, tp = mesh.axis("dp"), mesh.axis("tp")
    tp_rank = mesh.coord["tp"]
    grad = torch.arange(1.0, 9.0) * (tp_rank + 1)  # this tp slice's gradient, equal on its dp ranks
    whole = torch.cat([torch.arange(1.0, 9.0) * (r + 1) for r in range(topo.tp)])
    param = nn.Parameter(torch.zeros(8))
    # every rank holds a different slice: nothing replicated to drop
    norm_group = ModelParallelNorm(Comm(tp), frozenset()) if tp.world_size > 1 else None
    if stage == 0:
        strategy: Stage0Strategy | Stage1Strategy = Stage0Strategy(
            [param], comm=Comm(dp), world_size=dp.world_size, grad_dtype=torch.float32, comm_dtype=None,
            reduce_bucket_numel=1 << 20, norm_group=norm_group)
    else:
        strategy = Stage1Strategy([param], comm=Comm(dp), rank=dp.rank, world_size=dp.world_size,
                                  options=PartitionOptions(grad_dtype=torch.float32, comm_dtype=None,
                                                           bucket_numel=1 << 20), norm_group=norm_group)
    norm = _norm_after_backward(strategy, param, grad)
    assert math.isclose(norm, whole.norm().item(), rel_tol=1e-6), (norm, whole.norm().item())
    if topo.tp > 1:  # without the second sum a rank would see only its own slice
        assert not math.isclose(norm, grad.norm().item(), rel_tol=1e-3)
