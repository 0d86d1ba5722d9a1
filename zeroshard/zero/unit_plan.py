"""Stage 3's unit plan: which parameters each unit gathers, which stay whole on every rank (the
persistent unit), and the `BucketedPartition` over them, one bucket per unit.

Decided once, when `Stage3Strategy` (zero/stage3.py) is built: a pure function of the model, its
units, the trainable parameters and the persistence thresholds; the world size is an int, no
process group. Imports nothing of ours but zero/flat.py and zero/units.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from zeroshard.zero.flat import BucketedPartition
from zeroshard.zero.units import assign_params


@dataclass(frozen=True, slots=True)
class UnitPlan:
    """The parameters in plan order (unit by unit, the persistent unit last) and where each goes."""

    params: list[nn.Parameter]
    """Every parameter of the model once, in plan order."""
    names: list[str]
    """Each parameter's name (the first name of a tied one), in plan order."""
    trainable: list[bool]
    """Whether each parameter (plan order) is one the optimizer steps."""
    unit_modules: list[nn.Module | None]
    """The module of each unit; None for the last, persistent unit."""
    unit_of: list[int]
    """The unit of each parameter (plan order)."""
    partition: BucketedPartition
    """The flat layout: one bucket per unit, split evenly over the ranks."""

    @property
    def persistent(self) -> int:
        """The persistent unit's index: the last one, never released."""
        return len(self.unit_modules) - 1


def persistent_ids(module: nn.Module, threshold: int, budget: int, include: set[int] | None = None) -> set[int]:
    """The parameters that stay gathered: fewer elements than `threshold`, taken in the model's
    parameter order while their total stays within `budget` (among `include` when given)."""
    out: set[int] = set()
    total = 0
    for _, p in module.named_parameters():
        if include is not None and id(p) not in include:
            continue
        n = p.numel()
        if n < threshold and total + n <= budget:
            out.add(id(p))
            total += n
    return out


def plan_units(module: nn.Module, units: Sequence[nn.Module], trainable: set[int], *, world_size: int,
               align: int, persistence_threshold: int, persistence_budget: int,
               include: set[int] | None = None) -> UnitPlan:
    """Assign the parameters to units (those `persistent_ids` picks to a last, persistent unit)
    and plan the partition over `world_size` ranks. `trainable`: ids of the optimizer's parameters.

    `include` (ids): partition only these parameters and leave the others to another owner (the
    dense and the expert parameters of a model with MoE layers: Note: [experts at stage 3] in
    zero/build.py); a unit other than the root that holds none of them is dropped."""
    assigned = assign_params(module, units)
    if include is not None:
        assigned = {i: [(n, p) for n, p in named if id(p) in include] for i, named in assigned.items()}
    persists = persistent_ids(module, persistence_threshold, persistence_budget, include)
    persistent: list[tuple[str, nn.Parameter]] = []
    groups: list[list[tuple[str, nn.Parameter]]] = []
    unit_modules: list[nn.Module | None] = []
    for i, unit in enumerate(units):
        if include is not None and i > 0 and not assigned[i]:
            continue
        keep = [(n, p) for n, p in assigned[i] if id(p) not in persists]
        persistent += [(n, p) for n, p in assigned[i] if id(p) in persists]
        groups.append(keep)
        unit_modules.append(unit)
    groups.append(persistent)          # the last unit: persistent, never released
    unit_modules.append(None)
    params = [p for g in groups for _, p in g]
    bounds, start = [], 0
    for g in groups:
        bounds.append((start, start + len(g)))
        start += len(g)
    partition = BucketedPartition([p.numel() for p in params], world_size=world_size, align=align, buckets=bounds)
    return UnitPlan(params=params, names=[n for g in groups for n, _ in g],
                    trainable=[id(p) in trainable for p in params], unit_modules=unit_modules,
                    unit_of=[u for u, (a, b) in enumerate(bounds) for _ in range(a, b)], partition=partition)
