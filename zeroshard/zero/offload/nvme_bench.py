"""Swap bandwidth on a directory for a grid of `aio` settings (`zeroshard bench-io`, like
DeepSpeed's ds_io), and the `aio` block that did best.

Each point writes (once untimed, to lay the blocks out, then timed: every optimizer step
overwrites its swap files), then reads a scratch file of `file_bytes` through `zero/offload/nvme_io.py`, as the
optimizer swap does: requests of `request_bytes` (one swap buffer) from page-aligned memory,
`overlap` requests in flight, each cut into `block_size` system calls. Direct I/O bypasses the
page cache, so reads measure the disk; without O_DIRECT the numbers are the page cache's and the
report says so.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroshard.zero.offload.nvme_io import AsyncIO, IOHandle, IOOptions, SwapFile, aligned_empty


@dataclass(frozen=True, slots=True)
class IOPoint:
    block_size: int
    queue_depth: int
    thread_count: int
    write_bytes_per_s: float
    read_bytes_per_s: float
    direct: bool


def _timed(file: SwapFile, buffers: Sequence[torch.Tensor], file_bytes: int, *, write: bool) -> float:
    """Bytes per second for moving `file_bytes` through `file`, cycling over `buffers` (each one
    request in flight at a time)."""
    request = buffers[0].numel()
    pending: list[IOHandle | None] = [None] * len(buffers)
    start = time.perf_counter()
    for i, offset in enumerate(range(0, file_bytes, request)):
        slot = i % len(buffers)
        if pending[slot] is not None:
            pending[slot].wait()  # type: ignore[union-attr]
        n = min(request, file_bytes - offset)
        buf = buffers[slot][:n]
        pending[slot] = file.write(buf, offset) if write else file.read(buf, offset)
    for h in pending:
        if h is not None:
            h.wait()
    if write and not file.direct:
        file.sync()
    return file_bytes / (time.perf_counter() - start)


def measure(directory: Path, options: IOOptions, *, file_bytes: int, request_bytes: int,
            overlap: int = 2) -> IOPoint:
    """Write then read one scratch file under `directory` with `options`; the file is removed."""
    buffers = [aligned_empty(request_bytes, torch.uint8) for _ in range(overlap)]
    for b in buffers:
        b.fill_(0x5A)
    with AsyncIO(directory, options) as io:
        f = io.open(f".zeroshard-bench-io-{os.getpid()}.swp", file_bytes)
        try:
            _timed(f, buffers, file_bytes, write=True)  # lay the file out, as fio does before timing
            w = _timed(f, buffers, file_bytes, write=True)  # the swap's steady state: overwriting
            r = _timed(f, buffers, file_bytes, write=False)
            direct = f.direct
        finally:
            f.remove()
    return IOPoint(options.block_size, options.queue_depth, options.thread_count, w, r, direct)


def sweep(directory: Path, *, block_sizes: Sequence[int], queue_depths: Sequence[int],
          thread_counts: Sequence[int], file_bytes: int, request_bytes: int,
          on_point: Callable[[IOPoint], None] | None = None) -> list[IOPoint]:
    """`measure` at every point of the grid."""
    points = []
    for bs, qd, tc in itertools.product(block_sizes, queue_depths, thread_counts):
        p = measure(directory, IOOptions(block_size=bs, queue_depth=qd, thread_count=tc),
                    file_bytes=file_bytes, request_bytes=request_bytes)
        points.append(p)
        if on_point is not None:
            on_point(p)
    return points


def best(points: Sequence[IOPoint]) -> IOPoint:
    """The point with the best worse-of-read-and-write bandwidth (the swap does both every step);
    ties go to fewer threads in flight."""
    return max(points, key=lambda p: (round(min(p.read_bytes_per_s, p.write_bytes_per_s) / 2**20),
                                      -p.queue_depth * p.thread_count))


def aio_block(p: IOPoint) -> dict[str, object]:
    """The ds_config `aio` section for point `p`."""
    return {"block_size": p.block_size, "queue_depth": p.queue_depth,
            "intra_op_parallelism": p.thread_count, "single_submit": False, "overlap_events": True}
