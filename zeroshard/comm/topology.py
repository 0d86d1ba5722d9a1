"""One source of process groups, with named dimensions: pipeline (pp) x data (dp) x tensor (tp).

:class:`Topology` is the arithmetic (which rank sits where, which ranks form each group) and
needs no process group. :class:`MeshGroups` turns it into process groups once per process
(:func:`build_mesh`, collective), over torch's ``DeviceMesh`` with ``mesh_dim_names`` ``AXES``;
every consumer asks it for a group by name: ZeRO partitions over ``axis("dp")``, the gradient
norm sums its squares over ``axes("pp", "tp")`` as well, and ZeRO++'s node / cross-node split
(hpZ, hierarchical qgZ) is :meth:`MeshGroups.node_split`, a sub-division of ``dp``.

Rank layout (DeepSpeed's ``PipeModelDataParallelTopology``, torchtitan's ``ParallelDims``):
row-major over ``AXES`` = ("pp", "dp", "tp"), so the tensor-parallel ranks of one (pp, dp)
coordinate are adjacent (the fastest links) and a pipeline stage is a contiguous block::

    rank = (pp * dp_size + dp) * tp_size + tp

Where torch's ``DeviceMesh`` is not used, and why:

- world size 1 without a process group (``python train.py``): ``DeviceMesh`` needs an initialized
  default group; ``mesh`` is None and every axis is a local one-rank group.
- an axis of size 1 uses no process group at all (``Comm`` runs its collectives locally), as
  ``subgroup`` always did; ``DeviceMesh`` still creates one-rank groups for it (about 20 ms at 3
  ranks on gloo, once per process).
- an axis spanning the world is the world's own ``ProcessGroups``: ``DeviceMesh`` reuses the
  default group on a CPU build but creates a second gloo group when CUDA is available, which
  would give the data-parallel group a second divergence tracker without the store diagnostics.
- several axes at once (``axes("pp", "tp")``) come from ``subgroup`` over the topology's
  partition: ``DeviceMesh`` flattens dimensions only through the private ``_flatten``.

The groups ``DeviceMesh`` creates get a divergence tracker as ``subgroup``'s do (local
diagnostics: they share the default group's store), closed by ``destroy_distributed``. They do
not enter ``subgroup``'s cache: a split of an axis (ZeRO++'s node / cross groups) always gets
groups of its own, as a split of the world always did, so that collectives on a split and on its
parent never share one group's issue order. Axis groups carry ``siblings`` (the partition of the
world they belong to), so a split of one axis group is made in every sibling at once: every rank
of the world creates the same groups in the same order, as ``new_group`` requires.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zeroshard.comm.groups import (
    ProcessGroups,
    adopt_subgroup,
    node_rank_lists,
    node_size,
    on_destroy,
    subgroup,
)
from zeroshard.errors import CommError

logger = logging.getLogger("zeroshard")

AXES: tuple[str, str, str] = ("pp", "dp", "tp")
"""DeepSpeed's axis order, slowest to fastest: tensor-parallel ranks are adjacent."""


def _check_axes(names: tuple[str, ...]) -> None:
    unknown = [n for n in names if n not in AXES]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"expected distinct axis names from {AXES}, got {names}")


@dataclass(frozen=True)
class Topology:
    """The sizes of the pp x dp x tp grid and the rank arithmetic over it (no process group).

    >>> t = Topology(pp=2, dp=2, tp=2)
    >>> t.coord(5), t.rank_at(pp=1, dp=0, tp=1)
    ({'pp': 1, 'dp': 0, 'tp': 1}, 5)
    >>> t.axis_groups("dp")
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in AXES:
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"Topology.{name}: expected a positive integer, got {size!r}")

    @classmethod
    def for_world(cls, world_size: int, *, pp: int = 1, tp: int = 1) -> Topology:
        """The topology of `world_size` ranks with `pp` stages and `tp`-way tensor parallelism;
        the data-parallel size is what remains.

        Raises:
            ValueError: pp * tp does not divide the world size.
        """
        if pp < 1 or tp < 1 or world_size < 1 or world_size % (pp * tp):
            raise ValueError(
                f"a world of {world_size} ranks cannot hold pipeline size {pp} x tensor-parallel size {tp}: "
                f"pp * tp ({pp * tp}) must divide the world size; start a multiple of {pp * tp} ranks or "
                "change the pipeline / tensor-parallel sizes.")
        return cls(pp=pp, dp=world_size // (pp * tp), tp=tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def size(self, *names: str) -> int:
        """The number of ranks in a group along `names` (1 for no names)."""
        _check_axes(names)
        return math.prod(getattr(self, n) for n in names)

    def coord(self, rank: int) -> dict[str, int]:
        """`rank`'s position along every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks ({self})")
        rest, tp = divmod(rank, self.tp)
        pp, dp = divmod(rest, self.dp)
        return {"pp": pp, "dp": dp, "tp": tp}

    def rank_at(self, *, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        """The rank at a coordinate (the inverse of :meth:`coord`)."""
        for name, value in (("pp", pp), ("dp", dp), ("tp", tp)):
            if not 0 <= value < getattr(self, name):
                raise ValueError(f"{name}={value} is outside {self}")
        return (pp * self.dp + dp) * self.tp + tp

    def axes_groups(self, *names: str) -> list[list[int]]:
        """The partition of the world into the groups of ranks that differ only along `names`,
        each in rank order; groups ordered by their first rank."""
        _check_axes(names)
        fixed = [a for a in AXES if a not in names]
        parts: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coord(rank)
            parts.setdefault(tuple(c[a] for a in fixed), []).append(rank)
        return list(parts.values())

    def axis_groups(self, axis: str) -> list[list[int]]:
        """The partition of the world into the groups along `axis`."""
        return self.axes_groups(axis)

    def axis_ranks(self, axis: str, rank: int) -> list[int]:
        """The group along `axis` holding `rank`."""
        return self.axes_ranks(rank, axis)

    def axes_ranks(self, rank: int, *names: str) -> list[int]:
        """The ranks that differ from `rank` only along `names`."""
        c = self.coord(rank)
        return [r for r in range(self.world_size)
                if all(self.coord(r)[a] == c[a] for a in AXES if a not in names)]

    def groups_across_nodes(self, axis: str, ranks_per_node: int) -> list[list[int]]:
        """The groups along `axis` that span more than one node, when nodes hold `ranks_per_node`
        consecutive ranks (every launcher numbers ranks node-major: `zeroshard launch` gives node n
        ranks [n * size, (n + 1) * size)). Tensor-parallel ranks are adjacent, so a TP group stays
        inside a node exactly when `tp` divides the ranks per node (the seed chapter's placement:
        the costliest traffic on the fastest links).

        >>> Topology(dp=2, tp=2).groups_across_nodes("tp", 2)
        []
        >>> Topology(dp=2, tp=2).groups_across_nodes("dp", 2)
        [[0, 2], [1, 3]]
        """
        if ranks_per_node < 1:
            raise ValueError(f"ranks per node must be >= 1, got {ranks_per_node}")
        return [g for g in self.axis_groups(axis) if len({r // ranks_per_node for r in g}) > 1]

    def node_split(self, dp_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
        """ZeRO++'s split of every data-parallel group, in global ranks: (node groups, cross
        groups). Each dp group's positions are cut into nodes of `dp_per_node` consecutive
        positions; a cross group holds one position per node (``node_rank_lists``).

        >>> Topology(dp=4).node_split(2)
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
        """
        nodes, cross = node_rank_lists(self.dp, dp_per_node)
        dp_groups = self.axis_groups("dp")
        return ([[g[p] for p in part] for g in dp_groups for part in nodes],
                [[g[p] for p in part] for g in dp_groups for part in cross])


class MeshGroups:
    """This process's groups along every axis of a :class:`Topology`; built by :func:`build_mesh`.

    Each group is a :class:`ProcessGroups` whose ``rank`` / ``world_size`` / ``dp_group`` are this
    rank's group along the axis (device, backend, timeout and launcher are the world's), so a
    ``Comm`` built on ``axis("dp")`` runs ZeRO unchanged.
    """

    def __init__(self, world: ProcessGroups, topology: Topology, mesh: DeviceMesh | None) -> None:
        if topology.world_size != world.world_size:
            raise CommError(f"the topology {topology} has {topology.world_size} ranks, but the process group "
                            f"has {world.world_size}; build it with Topology.for_world({world.world_size}, ...).")
        self.topology, self.world, self.mesh = topology, world, mesh
        self.coord = topology.coord(world.rank)
        self._cache: dict[tuple[str, ...], ProcessGroups] = {}

    def axis(self, name: str) -> ProcessGroups:
        """This rank's group along `name` ("pp", "dp" or "tp")."""
        return self.axes(name)

    def axes(self, *names: str) -> ProcessGroups:
        """The ranks that differ from this one only along `names` (``axes()``: this rank alone)."""
        _check_axes(names)
        key = tuple(a for a in AXES if a in names)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._build(key)
        return found

    def _build(self, names: tuple[str, ...]) -> ProcessGroups:
        t, world = self.topology, self.world
        partition = t.axes_groups(*names)
        size = t.size(*names)
        if size == world.world_size:
            return world
        mine = t.axes_ranks(world.rank, *names)
        position = mine.index(world.rank)
        siblings = tuple(tuple(p) for p in partition)
        if size == 1:
            return replace(world, rank=0, world_size=1, dp_group=None, siblings=siblings)
        if len(names) == 1 and self.mesh is not None:
            pg = self.mesh.get_group(names[0])
            if sorted(dist.get_process_group_ranks(pg)) != mine:
                raise AssertionError(f"DeviceMesh's {names[0]} group {dist.get_process_group_ranks(pg)} "
                                     f"is not the topology's {mine}")
            adopt_subgroup(pg, position, size)
            return replace(world, rank=position, world_size=size, dp_group=pg, siblings=siblings)
        return subgroup(world, partition)

    def node_split(self, size: int) -> tuple[ProcessGroups, ProcessGroups]:
        """ZeRO++'s (node, cross) groups inside this rank's data-parallel group, `size`
        data-parallel ranks per node (:meth:`Topology.node_split`); the same groups as
        ``Comm(axis("dp")).node_split(size)``."""
        dp = self.axis("dp")
        nodes, cross = node_rank_lists(dp.world_size, size)
        return subgroup(dp, nodes), subgroup(dp, cross)

    def __repr__(self) -> str:
        return f"MeshGroups({self.topology}, coord={self.coord}, mesh={self.mesh!r})"


_BUILT: dict[Topology, MeshGroups] = {}
"""Every mesh `build_mesh` made over the current world, by topology: a memo of groups (creating them
is collective and slow, and they outlive the engines that use them), never a source of the layout,
which each caller decides (comm/parallel_dims.py) and passes in."""


def _forget_meshes() -> None:
    _BUILT.clear()


on_destroy(_forget_meshes)  # Note: [groups die before finalization] in groups.py


def build_mesh(world: ProcessGroups, topology: Topology) -> MeshGroups:
    """The :class:`MeshGroups` of `topology` over `world` (collective: every rank calls it with the
    same topology). Built once per topology: a later call with the same world and topology returns
    the same groups.

    Raises:
        CommError: the topology's size is not the world size.
    """
    cached = _BUILT.get(topology)
    if cached is not None and cached.world is world:
        return cached
    mesh = None
    if world.dp_group is not None:
        if topology.world_size != world.world_size:
            MeshGroups(world, topology, None)  # raises the size mismatch
        mesh = init_device_mesh(world.device.type, (topology.pp, topology.dp, topology.tp), mesh_dim_names=AXES)
    built = _BUILT[topology] = MeshGroups(world, topology, mesh)
    _check_placement(world, topology)
    return built


def _check_placement(world: ProcessGroups, topology: Topology) -> None:
    """Warn (once, on rank 0) when a tensor-parallel group spans nodes: it still trains the same
    numbers, but its per-layer all-reduces then cross the inter-node link."""
    size = node_size(world)
    if topology.tp == 1 or world.rank != 0 or size >= world.world_size:
        return
    across = topology.groups_across_nodes("tp", size)
    if across:
        logger.warning(
            "tensor-parallel group %s spans nodes (%d ranks per node): its all-reduces cross the inter-node link. "
            "Choose a tensor-parallel size dividing the ranks per node (%d), or start more ranks per node.",
            across[0], size, size)
