"""The (pp, dp, tp) topology and the process groups along each axis: every group comes from here.

Stand-in written on the `tp` branch with exactly the names agreed for issue 25 item 6 (the
topology branch owns this file; its version replaces this one at merge). `Topology` is pure
arithmetic; `build_mesh` makes one sub-group per axis part with `comm/groups.py`'s `subgroup`.
Imports nothing of ours but `comm.groups` and `errors`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from zeroshard.comm.groups import ProcessGroups, subgroup
from zeroshard.errors import ConfigError

AXES = ("pp", "dp", "tp")
"""DeepSpeed's axis order: tp varies fastest, so a tensor-parallel group is adjacent ranks (one node)."""


@dataclass(frozen=True)
class Topology:
    """Sizes of the three axes; rank = (pp * dp_size + dp) * tp_size + tp."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in AXES:
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"topology: {name} = {getattr(self, name)}, expected an integer >= 1.")

    @classmethod
    def for_world(cls, world_size: int, *, pp: int = 1, tp: int = 1) -> Topology:
        """The topology with `dp` derived from the world size.

        Raises:
            ConfigError: `pp * tp` does not divide `world_size`.
        """
        if pp < 1 or tp < 1 or world_size % (pp * tp):
            raise ConfigError(
                f"world size {world_size} is not divisible by pipeline size {pp} x tensor-parallel size {tp}; "
                f"start a multiple of {pp * tp} ranks, or change the sizes.")
        return cls(pp=pp, dp=world_size // (pp * tp), tp=tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def _sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}

    def coord(self, rank: int) -> dict[str, int]:
        """{"pp": .., "dp": .., "tp": ..} of `rank`."""
        if not 0 <= rank < self.world_size:
            raise AssertionError(f"expected a rank in [0, {self.world_size}), got {rank}")
        return {"pp": rank // (self.dp * self.tp), "dp": rank // self.tp % self.dp, "tp": rank % self.tp}

    def rank_at(self, *, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def axis_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks that differ from `rank` only along `axis`, in axis order."""
        if axis not in AXES:
            raise AssertionError(f"expected an axis of {AXES}, got {axis!r}")
        c = self.coord(rank)
        return [self.rank_at(**{**c, axis: i}) for i in range(self._sizes()[axis])]

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Partition of range(world) into the groups along `axis`."""
        return self.axes_groups(axis)

    def axes_groups(self, *names: str) -> list[list[int]]:
        """Partition of range(world) into the groups of ranks that differ only along `names`."""
        seen: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coord(r)
            key = tuple(c[a] for a in AXES if a not in names)
            seen.setdefault(key, []).append(r)
        return list(seen.values())


@dataclass
class MeshGroups:
    """This process's groups along each axis of one topology (built by `build_mesh`)."""

    topology: Topology
    coord: dict[str, int]
    world: ProcessGroups
    mesh: Any = None
    """torch's DeviceMesh; None in this stand-in (the topology branch builds it)."""
    _cache: dict[tuple[str, ...], ProcessGroups] = field(default_factory=dict, repr=False)

    def axis(self, name: str) -> ProcessGroups:
        """ProcessGroups whose rank / world_size / dp_group are this rank's group along `name`."""
        return self.axes(name)

    def axes(self, *names: str) -> ProcessGroups:
        """The ranks that differ from this one only along `names`."""
        key = tuple(a for a in AXES if a in names)
        if key not in self._cache:
            if math.prod(self.topology._sizes()[a] for a in key) == self.topology.world_size:
                self._cache[key] = self.world
            else:
                self._cache[key] = subgroup(self.world, self.topology.axes_groups(*key))
        return self._cache[key]


_CURRENT: MeshGroups | None = None


def build_mesh(world: ProcessGroups, topology: Topology) -> MeshGroups:
    """The groups of `topology` over the world (collective: every rank calls it alike).

    Raises:
        ConfigError: the topology's world size is not the job's.
    """
    global _CURRENT
    if topology.world_size != world.world_size:
        raise ConfigError(f"topology {topology} needs {topology.world_size} ranks; the job has {world.world_size}.")
    mesh = MeshGroups(topology=topology, coord=topology.coord(world.rank), world=world)
    for name in AXES:  # every rank creates every axis's groups in the same order (new_group is collective)
        mesh.axis(name)
    _CURRENT = mesh
    return mesh


def current_mesh() -> MeshGroups | None:
    """The mesh built for this process, if any."""
    return _CURRENT
