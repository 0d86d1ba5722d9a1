"""One topology of named dimensions (pp, dp, tp) and the process groups along them.

Minimal stand-in for the interface agreed in issue 25 item 6 (the topology branch owns this
file; at merge its version replaces this one). Every group comes from here. Imports nothing of
ours but ``comm.groups``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zeroshard.comm.groups import ProcessGroups, subgroup

AXES = ("pp", "dp", "tp")
"""DeepSpeed's axis order: tp varies fastest (tensor-parallel ranks adjacent), then dp, then pp."""


@dataclass(frozen=True)
class Topology:
    """The shape of the job: pipeline stages x data-parallel replicas x tensor-parallel shards.

    Pure arithmetic (no process group). Rank = (pp * dp_size + dp) * tp_size + tp.
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"Topology.{axis}: got {getattr(self, axis)}, expected a positive size")

    @classmethod
    def for_world(cls, world_size: int, *, pp: int = 1, tp: int = 1) -> Topology:
        """The topology of `world_size` ranks with `pp` stages and `tp` shards; dp is derived.

        Raises:
            ValueError: pp * tp does not divide the world size.
        """
        if pp < 1 or tp < 1 or world_size % (pp * tp):
            raise ValueError(
                f"world size {world_size} is not divisible by pipeline stages ({pp}) x tensor-parallel "
                f"size ({tp}) = {pp * tp}; start a multiple of {pp * tp} ranks or change the stages")
        return cls(pp=pp, dp=world_size // (pp * tp), tp=tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coord(self, rank: int) -> dict[str, int]:
        """{"pp": .., "dp": .., "tp": ..} of `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the topology's {self.world_size} ranks")
        return {"pp": rank // (self.dp * self.tp), "dp": rank // self.tp % self.dp, "tp": rank % self.tp}

    def rank_at(self, *, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        """The rank at a coordinate."""
        for axis, value in (("pp", pp), ("dp", dp), ("tp", tp)):
            if not 0 <= value < getattr(self, axis):
                raise ValueError(f"{axis}={value} is outside the topology's {axis} size {getattr(self, axis)}")
        return (pp * self.dp + dp) * self.tp + tp

    def axis_groups(self, axis: str) -> list[list[int]]:
        """The partition of range(world) into groups of ranks that differ only along `axis`."""
        return self.axes_groups(axis)

    def axes_groups(self, *names: str) -> list[list[int]]:
        """The partition of range(world) into groups of ranks that differ only along `names`."""
        for name in names:
            if name not in AXES:
                raise ValueError(f"unknown axis {name!r}; expected one of {AXES}")
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coord(rank)
            groups.setdefault(tuple(c[a] for a in AXES if a not in names), []).append(rank)
        return list(groups.values())

    def axis_ranks(self, axis: str, rank: int) -> list[int]:
        """The group along `axis` that holds `rank`."""
        return next(g for g in self.axis_groups(axis) if rank in g)


class MeshGroups:
    """This process's groups along each axis of a Topology. Build with :func:`build_mesh`."""

    def __init__(self, world: ProcessGroups, topology: Topology) -> None:
        if topology.world_size != world.world_size:
            raise ValueError(f"the topology has {topology.world_size} ranks ({topology}), the job "
                             f"{world.world_size}")
        self.topology = topology
        self.world = world
        self.coord = topology.coord(world.rank)
        self.mesh: Any = None  # the stand-in builds no DeviceMesh
        self._cache: dict[tuple[str, ...], ProcessGroups] = {}
        for axis in AXES:  # collective: every rank creates every group, in the same order
            self.axis(axis)

    def axis(self, name: str) -> ProcessGroups:
        """This rank's group along `name` as a ProcessGroups (rank, world_size, dp_group)."""
        return self.axes(name)

    def axes(self, *names: str) -> ProcessGroups:
        """The ranks that differ from this one only along `names`."""
        key = tuple(a for a in AXES if a in names)
        if key not in self._cache:
            self._cache[key] = subgroup(self.world, self.topology.axes_groups(*key))
        return self._cache[key]


_CURRENT: MeshGroups | None = None


def build_mesh(world: ProcessGroups, topology: Topology) -> MeshGroups:
    """Build (collectively) and remember this process's groups for `topology`."""
    global _CURRENT
    _CURRENT = MeshGroups(world, topology)
    return _CURRENT


def current_mesh() -> MeshGroups | None:
    """The mesh built for this process, if any."""
    return _CURRENT
