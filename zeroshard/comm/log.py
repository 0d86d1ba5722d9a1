"""The comm log (ds_config ``comms_logger``): one record per collective, a summary per op.

Bytes are the message size in the communication dtype, counted as nccl-tests counts them:
all_reduce / reduce / broadcast: the tensor; all_gather: the gathered output
(world_size * input); reduce_scatter and all_to_all: the input; scatter / gather: the whole
list (world_size * shard); barrier: 0. Seconds run from issue to the end of ``wait()``, so an
async op that overlapped other work is charged its full latency. Imports nothing of ours.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One collective call as seen by this rank."""

    op: str
    """Collective name: "all_reduce", "all_gather", "reduce_scatter", ..."""
    bytes: int
    """Message size in bytes in the communication dtype (see the module docstring)."""
    seconds: float
    """Wall time from issue to completion of ``wait()``."""
    async_op: bool
    """Whether the caller asked for a handle (``async_op=True``)."""
    group: str = "world"
    """Which group ran it: "world" (the data-parallel group), "node" (the ranks of one node,
    ZeRO++ hpZ / hierarchical qgZ), "cross" (one rank per node, same local rank). See
    `comm/wire.py` for the bytes each puts on the inter-node link."""


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GB"


class CommLog:
    """Collects a :class:`CommRecord` per collective issued through a ``Comm``.

    Args:
        ops: record only these collectives (ds_config ``comms_logger.prof_ops``); None = all.
        verbose: also log every record at INFO level (``comms_logger.verbose``).

    Example::

        log = CommLog()
        comm = Comm(groups, log=log)
        comm.all_reduce(flat)
        print(log.summary())
    """

    def __init__(self, *, ops: Iterable[str] | None = None, verbose: bool = False) -> None:
        self.records: list[CommRecord] = []
        self._ops = None if ops is None else frozenset(ops)
        self._verbose = verbose

    def wants(self, op: str) -> bool:
        """Whether ``op`` is recorded (lets the caller skip timing what is not)."""
        return self._ops is None or op in self._ops

    def record(self, op: str, nbytes: int, seconds: float, async_op: bool, group: str = "world") -> None:
        """Append one record."""
        if not self.wants(op):
            return
        rec = CommRecord(op, nbytes, seconds, async_op, group)
        self.records.append(rec)
        if self._verbose:
            logger.info("comm %s: %s in %.3f ms%s", op, _human_bytes(nbytes), seconds * 1e3,
                        " (async)" if async_op else "")

    def reset(self) -> None:
        """Forget all records."""
        self.records.clear()

    def totals(self) -> dict[str, tuple[int, int, float]]:
        """Per op: (count, total bytes, total seconds), in first-seen order."""
        out: dict[str, tuple[int, int, float]] = {}
        for rec in self.records:
            count, nbytes, seconds = out.get(rec.op, (0, 0, 0.0))
            out[rec.op] = (count + 1, nbytes + rec.bytes, seconds + rec.seconds)
        return out

    def summary(self) -> str:
        """A table per op: count, total bytes, total seconds, algorithmic bandwidth."""
        header = f"{'op':<16}{'count':>8}{'total bytes':>14}{'total s':>11}{'algbw GB/s':>12}"
        lines = [header, "-" * len(header)]
        for op, (count, nbytes, seconds) in self.totals().items():
            algbw = f"{nbytes / seconds / 1e9:.3f}" if seconds > 0 and nbytes else "-"
            lines.append(f"{op:<16}{count:>8}{_human_bytes(nbytes):>14}{seconds:>11.4f}"
                         f"{algbw:>12}")
        if len(lines) == 2:
            lines.append("(no collectives recorded)")
        return "\n".join(lines)
