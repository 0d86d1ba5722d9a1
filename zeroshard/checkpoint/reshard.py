"""Resharding arithmetic: which saved fragments cover a wanted range of a parameter.

Pure functions on ranges (no files, no process group), so every rule is unit-tested with
plain ints. A saved checkpoint is a set of *sources* (one per saved rank, or per file), each a
list of ranges `(param, offset, numel)`; loading at any world size or stage asks for this
rank's ranges and gets, for each, the slices of saved entries that tile it exactly.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from zeroshard.errors import CheckpointError


@dataclass(frozen=True, slots=True)
class Read:
    """Copy `numel` elements from entry `entry` of `source` (starting `src_offset` into that
    entry) to `dst_offset` of the wanted range."""

    source: int
    entry: int
    src_offset: int
    dst_offset: int
    numel: int


class RangeIndex:
    """Saved ranges of each parameter, sorted by offset, for fast intersection."""

    def __init__(self, sources: Sequence[Sequence[tuple[int, int, int]]], params: Sequence[str],
                 prefer: int | None = None) -> None:
        """`prefer`: where several sources saved the same range (stage 0: every rank saves
        everything), read it from this source, e.g. the loading rank's own file, so per-rank
        optimizer state (1-bit Adam's error buffers) comes back to the rank that wrote it."""
        self._params = list(params)
        self._by_param: dict[int, list[tuple[int, int, int, int]]] = {}  # offset, numel, source, entry
        for s, ranges in enumerate(sources):
            for e, (param, offset, numel) in enumerate(ranges):
                self._by_param.setdefault(param, []).append((offset, numel, s, e))
        for entries in self._by_param.values():
            # `reads` starts from the last entry at an offset: the preferred source sorts last.
            entries.sort(key=lambda x: (x[0], x[2] == prefer, x[1], x[2], x[3]))
        self._starts = {p: [e[0] for e in entries] for p, entries in self._by_param.items()}

    def reads(self, param: int, offset: int, numel: int) -> list[Read]:
        """The reads that assemble `[offset, offset + numel)` of `param`, in order.

        Raises:
            CheckpointError: part of the range is in no saved entry (a damaged manifest).
        """
        entries = self._by_param.get(param, [])
        starts = self._starts.get(param, [])
        out: list[Read] = []
        pos, end = offset, offset + numel
        i = max(bisect_right(starts, pos) - 1, 0)
        while pos < end:
            if i >= len(entries) or entries[i][0] > pos:
                raise CheckpointError(
                    f"no saved fragment covers elements [{pos}, {end}) of parameter "
                    f"{self._params[param] if param < len(self._params) else param}")
            e_off, e_numel, source, entry = entries[i]
            e_end = e_off + e_numel
            if e_end <= pos:
                i += 1
                continue
            n = min(end, e_end) - pos
            out.append(Read(source, entry, pos - e_off, pos - offset, n))
            pos += n
            i += 1
        return out

    def sources_for(self, wanted: Sequence[tuple[int, int, int]]) -> set[int]:
        """Every source a set of wanted ranges reads from (files to open)."""
        return {r.source for p, o, n in wanted for r in self.reads(p, o, n)}
