"""User-facing stage-3 helpers: `GatheredParameters` (and, later, `Init`).

    with zeroshard.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if rank == 0:
            model.lm_head.weight.zero_()      # re-partitioned to every rank on exit

Parameters that are not partitioned (stages 0-2) pass through unchanged, so the same code
runs at every stage.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

from torch import nn


class GatheredParameters:
    """Gather stage-3 parameters whole on every rank for the duration of a `with` block.

    Args:
        params: a parameter or an iterable of parameters (e.g. `module.parameters()`).
        modifier_rank: the rank whose in-place changes are kept: on exit its values are
            broadcast and re-partitioned (master weights too). None: read-only, changes lost.
        enabled: False makes the block a no-op (for code shared across stages).

    Every rank must enter and leave the block together (the gather is collective).
    """

    def __init__(self, params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,
                 fwd_module: Any = None, enabled: bool = True) -> None:
        plist = [params] if isinstance(params, nn.Parameter) else list(params)
        self._modifier_rank = modifier_rank
        self._by_strategy: dict[int, tuple[Any, list[int]]] = {}
        if not enabled:
            return
        for p in plist:
            strategy = getattr(p, "_zs_strategy", None)
            if strategy is None:
                continue
            _, units = self._by_strategy.setdefault(id(strategy), (strategy, []))
            unit = strategy.unit_of(p)
            if unit not in units:
                units.append(unit)
        for _, units in self._by_strategy.values():
            units.sort()  # every rank gathers in the same order

    def __enter__(self) -> "GatheredParameters":
        for strategy, units in self._by_strategy.values():
            strategy.gather_units(units)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for strategy, units in self._by_strategy.values():
            strategy.release_units(units, None if exc_type is not None else self._modifier_rank)
