"""Bytes on the wire, intra-node and inter-node, from the comm log: what each rank sends.

The comm log records each call's message size as nccl-tests counts it (comm/log.py), on the
group that ran it (`CommRecord.group`: "world", "node", "cross"). This module turns one
rank's records into the bytes that rank *sends*, split by whether they cross nodes, under
these algorithms (gloo's, and NCCL's ring within one node), with g ranks in the group:

- all_gather (B = gathered output), reduce_scatter (B = input): a ring; each rank sends
  (g - 1) / g * B to its successor.
- all_reduce (B = the tensor): a ring reduce-scatter then all-gather: 2 (g - 1) / g * B.
- all_to_all (B = input): B / g to each of the g - 1 others.
- broadcast, reduce (B = the tensor), scatter, gather (B = the whole list): a chain or a root
  that sends or receives (g - 1) / g * B in all; counted as (g - 1) / g * B / g per rank.
- barrier: 0.

Which bytes cross nodes: none on a "node" group; all on a "cross" group (one rank per node);
on the world group, ranks are node-major (node n = ranks [n s, (n + 1) s)), so in a ring only
the last rank of each node sends to another node (N of the W links cross), and an all-to-all
sends (W - s) / W of its input across. Summing `split` over every rank gives the cluster's
totals; bench/zeropp_step.py does so and compares with the veth counters of bench/two_node.py.
Imports nothing of ours but comm/log.py (the records it reads).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from zeroshard.comm.log import CommRecord

_RING = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}
_ROOTED = {"broadcast", "reduce", "scatter", "gather"}


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Where one rank sits: `world_size` ranks, `node_size` per node, node-major."""

    rank: int
    world_size: int
    node_size: int

    def __post_init__(self) -> None:
        if self.node_size < 1 or self.world_size % self.node_size:
            raise ValueError(f"node_size {self.node_size} must divide world_size {self.world_size}")

    @property
    def nodes(self) -> int:
        return self.world_size // self.node_size

    def group_size(self, group: str) -> int:
        return {"world": self.world_size, "node": self.node_size, "cross": self.nodes}[group]


@dataclass(frozen=True, slots=True)
class WireBytes:
    """Bytes one rank sends (or, summed, a cluster sends): within nodes and across them."""

    intra: float = 0.0
    inter: float = 0.0

    def __add__(self, other: WireBytes) -> WireBytes:
        return WireBytes(self.intra + other.intra, self.inter + other.inter)


def sent(record: CommRecord, layout: NodeLayout) -> WireBytes:
    """The bytes this rank sends for one logged call (see the module docstring)."""
    g = layout.group_size(record.group)
    if g <= 1 or record.op == "barrier":
        return WireBytes()
    b = float(record.bytes)
    if record.op in _RING:
        out = _RING[record.op] * (g - 1) / g * b
        crosses = _ring_link_crosses(record.group, layout)
        return WireBytes(inter=out) if crosses else WireBytes(intra=out)
    if record.op == "all_to_all":
        if record.group == "node":
            return WireBytes(intra=(g - 1) / g * b)
        if record.group == "cross":
            return WireBytes(inter=(g - 1) / g * b)
        s, w = layout.node_size, layout.world_size
        return WireBytes(intra=(s - 1) / w * b, inter=(w - s) / w * b)
    if record.op in _ROOTED:
        out = (g - 1) / g * b / g
        return _split_rooted(out, record.group, layout)
    raise ValueError(f"unknown collective {record.op!r} in the comm log")


def _ring_link_crosses(group: str, layout: NodeLayout) -> bool:
    """Whether this rank's ring successor in `group` is on another node."""
    if group == "node":
        return False
    if group == "cross":
        return True
    return layout.nodes > 1 and (layout.rank + 1) % layout.node_size == 0


def _split_rooted(out: float, group: str, layout: NodeLayout) -> WireBytes:
    """A rooted call's per-rank share, split as its peers are: the fraction of the group on
    other nodes crosses."""
    if group == "node":
        return WireBytes(intra=out)
    if group == "cross":
        return WireBytes(inter=out)
    s, w = layout.node_size, layout.world_size
    return WireBytes(intra=out * (s - 1) / (w - 1), inter=out * (w - s) / (w - 1))


def split(records: Iterable[CommRecord], layout: NodeLayout, ops: Iterable[str] | None = None) -> WireBytes:
    """Bytes this rank sends for `records` (only `ops`, if given), intra- and inter-node."""
    wanted = None if ops is None else set(ops)
    total = WireBytes()
    for r in records:
        if wanted is None or r.op in wanted:
            total = total + sent(r, layout)
    return total
