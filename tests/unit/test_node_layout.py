"""The node layout of the node-aware features (ZeRO++ hpZ, hierarchical qgZ): node and cross
groups from the ranks per node, and the ZEROSHARD_NODE_SIZE override."""

from __future__ import annotations

import pytest

from zeroshard.comm import ProcessGroups
from zeroshard.comm.groups import node_rank_lists, node_size
from zeroshard.errors import CommError


def test_node_and_cross_groups() -> None:
    assert node_rank_lists(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert node_rank_lists(6, 3) == ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]])
    assert node_rank_lists(3, 3) == ([[0, 1, 2]], [[0], [1], [2]])
    with pytest.raises(AssertionError):
        node_rank_lists(4, 3)


def test_node_size_from_launcher_or_override(monkeypatch) -> None:
    groups = ProcessGroups.single()
    monkeypatch.delenv("ZEROSHARD_NODE_SIZE", raising=False)
    assert node_size(groups) == 1
    monkeypatch.setenv("ZEROSHARD_NODE_SIZE", "2")
    assert node_size(groups) == 2
    for bad in ("0", "two"):
        monkeypatch.setenv("ZEROSHARD_NODE_SIZE", bad)
        with pytest.raises(CommError, match="ZEROSHARD_NODE_SIZE"):
            node_size(groups)
