"""Progress of long work (to-fp32, checkpoint save/load, plan --probe, sharded from_pretrained).

On a terminal: a tqdm bar when tqdm is installed (`pip install 'zeroshard[progress]'`), else a
plain bar redrawn in place. Otherwise (a log file, CI): one line per update, at most one per 10%
of the total when updates are many. Imports nothing of zeroshard's, so every layer may use it.

    with Progress(total_bytes, "save", unit="B") as bar:
        for name, nbytes in files:
            write(name)
            bar.advance(nbytes, name)

    for shard in progress_iter(shard_files, "load shards", unit="file"):   # from_pretrained
        ...
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

PROGRESS_MIN_BYTES = 2**30
"""Checkpoint save/load show progress from this size on (small ones finish in a blink)."""

MANY_UPDATES = 20
"""Above this many updates, a non-terminal stream gets a line per 10% instead of one per update."""


def _fmt(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:,.0f}"
    return f"{n / 2**20:,.1f} MiB"


class Progress:
    """A progress bar over `total` units (bytes when unit is "B").

    Args:
        total: the amount of work; `advance(n)` adds n done.
        desc: what is being done, the line's prefix ("to-fp32", "save checkpoint").
        enabled: False draws nothing (other ranks, --no-progress).
        unit: "B" for bytes (shown in MiB), else a noun ("file", "candidate").
        stream: where to draw; default stderr.
        expected_updates: how many `advance` calls are coming, when known (picks one line per update).
    """

    def __init__(self, total: int, desc: str = "", enabled: bool = True, *, unit: str = "B",
                 stream: TextIO | None = None, expected_updates: int | None = None) -> None:
        self.total, self.done, self.enabled = max(int(total), 1), 0, enabled
        self.desc, self.unit = desc, unit
        self.stream = stream or sys.stderr
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._line_per_update = expected_updates is not None and expected_updates <= MANY_UPDATES
        self._last_decile = -1
        self._start = time.perf_counter()
        self._tqdm: Any = None
        if enabled and self._tty:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                scale = {"unit": "B", "unit_scale": True, "unit_divisor": 1024} if unit == "B" else {"unit": f" {unit}"}
                self._tqdm = tqdm(total=self.total, desc=desc, file=self.stream, leave=True, **scale)

    def advance(self, n: int, label: str = "") -> None:
        """`n` more units done; `label` names the step just finished."""
        self.done += n
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(label[-40:], refresh=False)
            self._tqdm.update(n)
            return
        frac = min(self.done / self.total, 1.0)
        line = (f"{self.desc} [{'#' * int(frac * 30):<30}] {frac * 100:5.1f}% "
                f"{_fmt(self.done, self.unit)}/{_fmt(self.total, self.unit)} "
                f"{time.perf_counter() - self._start:.1f}s {label}")
        if self._tty:
            self.stream.write("\r" + line[:150].ljust(150))
        elif self._line_per_update or int(frac * 10) != self._last_decile:
            self._last_decile = int(frac * 10)
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._tty:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_iter(items: Iterable[T], desc: str, *, unit: str = "item", enabled: bool = True,
                  stream: TextIO | None = None) -> Iterator[T]:
    """Yield `items`, advancing a Progress of one unit per item (labelled with the item)."""
    seq = list(items)
    with Progress(len(seq), desc, enabled, unit=unit, stream=stream, expected_updates=len(seq)) as bar:
        for item in seq:
            yield item
            bar.advance(1, str(item))
