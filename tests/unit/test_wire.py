"""comm/wire.py: the bytes each rank sends per logged collective, intra- vs inter-node,
against hand-counted rings and all-to-alls on 2 nodes x 2 ranks."""

from __future__ import annotations

import pytest

from zeroshard.comm.log import CommRecord
from zeroshard.comm.wire import NodeLayout, WireBytes, split


def rec(op: str, nbytes: int, group: str = "world") -> CommRecord:
    return CommRecord(op, nbytes, 0.0, False, group)


def cluster(records: list[CommRecord], world: int = 4, node: int = 2) -> WireBytes:
    total = WireBytes()
    for rank in range(world):
        total = total + split(records, NodeLayout(rank, world, node))
    return total


def test_world_ring_all_gather_crosses_on_one_link_per_node() -> None:
    # 4 ranks, 4000-byte output: each rank sends 3 chunks of 1000; ranks 1 and 3 send across.
    assert cluster([rec("all_gather", 4000)]) == WireBytes(intra=6000, inter=6000)
    assert split([rec("all_gather", 4000)], NodeLayout(1, 4, 2)) == WireBytes(inter=3000)
    assert split([rec("all_gather", 4000)], NodeLayout(0, 4, 2)) == WireBytes(intra=3000)
    # one node: nothing crosses
    assert cluster([rec("all_gather", 4000)], node=4) == WireBytes(intra=12000)


def test_all_reduce_is_twice_a_ring_and_groups_classify() -> None:
    assert cluster([rec("all_reduce", 4000)]) == WireBytes(intra=12000, inter=12000)
    # node group of 2: 2000-byte gather, each rank sends 1000 inside its node
    assert cluster([rec("all_gather", 2000, "node")]) == WireBytes(intra=4000)
    # cross group of 2 (one rank per node): everything crosses
    assert cluster([rec("all_gather", 2000, "cross")]) == WireBytes(inter=4000)


def test_all_to_all_splits_by_peer_node() -> None:
    # world all-to-all of 4000 bytes input: 1000 to each of 3 peers, 2 of them on the other node
    assert split([rec("all_to_all", 4000)], NodeLayout(0, 4, 2)) == WireBytes(intra=1000, inter=2000)
    assert cluster([rec("all_to_all", 2000, "node")]) == WireBytes(intra=4000)


def test_barrier_single_rank_and_unknown() -> None:
    assert cluster([rec("barrier", 0)]) == WireBytes()
    assert split([rec("all_gather", 4000)], NodeLayout(0, 1, 1)) == WireBytes()
    with pytest.raises(ValueError, match="unknown collective"):
        split([rec("send", 4)], NodeLayout(0, 4, 2))
    with pytest.raises(ValueError, match="must divide"):
        NodeLayout(0, 4, 3)
