"""Placement: tensor-parallel groups stay inside a node (the seed chapter's rule), as comm/topology.py
lays ranks out and as `zeroshard launch` numbers them (node n: ranks [n * size, (n + 1) * size)),
and the check that names a TP group spanning nodes."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from zeroshard.cli.launch import plan_launch
from zeroshard.comm import ProcessGroups
from zeroshard.comm.topology import Topology, _check_placement


def _node_of(rank: int, per_node: int) -> int:
    return rank // per_node


@pytest.mark.parametrize("per_node", [2, 4, 8])
@pytest.mark.parametrize("nodes", [2, 4])
def test_tp_groups_never_span_nodes_when_tp_divides_the_node(nodes: int, per_node: int) -> None:
    world = nodes * per_node
    checked = 0
    for tp in (t for t in range(1, per_node + 1) if per_node % t == 0):
        for pp in (p for p in range(1, world // tp + 1) if (world // tp) % p == 0):
            topo = Topology.for_world(world, pp=pp, tp=tp)
            for group in topo.axis_groups("tp"):
                assert len({_node_of(r, per_node) for r in group}) == 1, (topo, group)
            assert topo.groups_across_nodes("tp", per_node) == []
            checked += 1
    assert checked >= 4


def test_seed_chapter_32_devices_placement() -> None:
    # 4 stages x 4-way TP x 2 replicas on 8 nodes of 4 devices: TP groups are whole nodes, each
    # stage two nodes, each DP group of 2 ranks crosses two nodes, the pipeline crosses nodes.
    topo = Topology(pp=4, dp=2, tp=4)
    assert [sorted({_node_of(r, 4) for r in g}) for g in topo.axis_groups("tp")] == [[n] for n in range(8)]
    assert all(len({_node_of(r, 4) for r in g}) == 2 for g in topo.axis_groups("dp"))
    assert all(len({_node_of(r, 4) for r in g}) == 4 for g in topo.axis_groups("pp"))


def test_a_straddling_tp_group_is_found() -> None:
    # tp 4 on nodes of 2 ranks, and tp 4 on nodes of 6: groups cross a node boundary.
    assert Topology(dp=1, tp=4).groups_across_nodes("tp", 2) == [[0, 1, 2, 3]]
    assert Topology(dp=3, tp=4).groups_across_nodes("tp", 6) == [[4, 5, 6, 7]]
    with pytest.raises(ValueError, match="ranks per node"):
        Topology(tp=2).groups_across_nodes("tp", 0)


def test_build_mesh_warns_when_tp_spans_nodes(caplog: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # setup_logging (run by any earlier initialize in this process) stops "zeroshard" propagating to
    # the root logger caplog listens on: attach caplog's handler to it directly.
    monkeypatch.setattr(logging.getLogger("zeroshard"), "handlers", [caplog.handler])
    world = replace(ProcessGroups.single(), world_size=4, local_world_size=2)
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        _check_placement(world, Topology(dp=1, tp=4))
    assert "tensor-parallel group [0, 1, 2, 3] spans nodes (2 ranks per node)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        _check_placement(world, Topology(dp=2, tp=2))
    assert caplog.text == ""


def test_launch_numbers_ranks_node_major(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each node's torchrun gets its node rank and a static rendezvous: global rank = node_rank *
    # nproc_per_node + local_rank, so the adjacent TP ranks share a node.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    for node in (0, 1):
        (cmd,) = plan_launch(["--dry_run", "--num_nodes", "2", "--node_rank", str(node), "--nproc_per_node", "4",
                              "--master_addr", "h0", "train.py"]).commands
        shell = cmd.shell()
        assert f"--nnodes 2 --node_rank {node} --nproc_per_node 4 --master_addr h0 " in shell
        assert "rdzv" not in shell  # static rendezvous: ranks in node order
