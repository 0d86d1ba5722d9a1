"""DeepSpeed's process-grid classes (`deepspeed.pipe.ProcessTopology` and its two subclasses).

A ProcessTopology maps named coordinates to ranks, the last axis varying fastest. The two
pipeline subclasses are views of `comm/topology.py`'s Topology (`as_topology`), which builds
the process groups; nothing here creates a group. Imports nothing of ours but comm/topology.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

from zeroshard.comm.topology import Topology

_OUR_AXIS = {"pipe": "pp", "data": "dp", "model": "tp"}


class ProcessTopology:
    """A grid of ranks with named axes, as DeepSpeed's: `axes=["x", "y"], dims=[2, 3]` puts
    (x, y) and (x, y + 1) on adjacent ranks.

    Args:
        axes: the axis names, slowest first.
        dims: the length of each axis.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {list(axes)} but {len(dims)} dims {list(dims)}")
        if any(int(d) < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dim must be >= 1, got {list(dims)}")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        self.mapping: dict[Any, int] = {}
        for rank, coord in enumerate(itertools.product(*(range(d) for d in self.dims))):
            self.mapping[self.ProcessCoord(*coord)] = rank

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at a full coordinate, e.g. `get_rank(pipe=1, data=0)`."""
        if len(coord_kwargs) != len(self.axes):
            raise ValueError("get_rank() needs every axis (it does not take slices); use filter_match()")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"get_rank({coord_kwargs}): no such coordinate in dims {self.dims}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """`rank`'s coordinate as text, e.g. "model_01" (used in checkpoint file names)."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{ax}{inner_sep}{getattr(coord, ax):02d}" for ax in self.axes if ax not in omit_axes)

    def get_dim(self, axis: str) -> int:
        """The length of `axis`; 0 for an axis the topology does not have (DeepSpeed's rule)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        """The ProcessCoord namedtuple of `rank`."""
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"rank {rank} not found in topology")

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups of ranks that differ only along `axis`; [] for an unknown axis."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for coord in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, coord))
            lists.append([self.mapping[self.ProcessCoord(**fixed, **{axis: i})] for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinates match every given axis value."""
        return [r for c, r in self.mapping.items() if all(getattr(c, k) == v for k, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate along `axis` is `idx`."""
        pos = self.axes.index(axis)
        return [r for c, r in self.mapping.items() if c[pos] == idx]

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)

    def as_topology(self) -> Topology:
        """zeroshard's Topology for this grid (which builds the groups).

        Raises:
            ValueError: the axes are not a pipeline grid zeroshard's Topology orders the same way.
        """
        names = [_OUR_AXIS.get(a) for a in self.axes]
        ours = [a for a in ("pp", "dp", "tp") if a in names]
        if None in names or names != ours:
            raise ValueError(
                f"a topology with axes {self.axes} has no zeroshard equivalent: use PipeDataParallelTopology "
                "or PipeModelDataParallelTopology (axes pipe, data[, model], in that order)")
        sizes = dict(zip(names, self.dims))
        return Topology(pp=sizes.get("pp", 1), dp=sizes.get("dp", 1), tp=sizes.get("tp", 1))


class PipeDataParallelTopology(ProcessTopology):
    """Hybrid pipeline and data parallelism: axes `pipe`, `data` (data-parallel ranks adjacent)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline, data and model (tensor) parallelism: axes `pipe`, `data`, `model`."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
