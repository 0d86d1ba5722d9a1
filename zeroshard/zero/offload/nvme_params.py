"""Stage-3 parameter shards on NVMe (`offload_param.device: "nvme"`): the shard is a file under
`nvme_path`, memory-mapped, and at most `max_in_cpu` of its elements stay mapped in.

Note: [parameters on NVMe] A rank's low-precision parameter shard is one flat tensor that the
gathers read unit by unit, the optimizer writes after each step, and checkpoints read. Here that
tensor is a shared mapping of a swap file (`torch.frombuffer` over `mmap`), so every reader and
writer of the CPU-offload path works unchanged and the values are the same bits (a trajectory
equal to `offload_param.device: "cpu"` is a property of the design, tested bitwise). What NVMe
adds is residency:

- `use(start, end)` before a unit's shard is read: the kernel is asked to read it ahead
  (`MADV_WILLNEED`, asynchronous). The gathers run in the recorded execution order with
  prefetch (zero/schedule.py), so the shards of the next units are being read while the current
  one computes. Units are kept in least-recently-used order; past `max_in_cpu` elements the
  oldest are written back (`msync`) and dropped from this process (`MADV_DONTNEED`) and from the
  page cache (`POSIX_FADV_DONTNEED`).
- `evict_all()` after the optimizer has written every shard (the step) and after the shards were
  first filled: everything is written back and dropped, so between steps the parameters are on
  disk and the next forward pages them in again.

Files follow Note: [swap files are scratch] (zero/offload/nvme_swap.py): a run directory per process
under `<nvme_path>/zeroshard-swap/`, stale ones of dead processes removed on start, removed at
a clean exit; a checkpoint holds the values, never the swap file. No compiler and no library:
`mmap`, `madvise`, `posix_fadvise` are in Python's standard library.
"""

from __future__ import annotations

import atexit
import mmap
import os
import shutil
from collections import OrderedDict
from pathlib import Path

import torch
from torch import Tensor

from zeroshard.zero.offload.nvme_swap import new_run_dir

PAGE = mmap.PAGESIZE


class MappedParamShard:
    """One rank's `numel`-element parameter shard in a swap file, mapped into memory.

    Args:
        root: `offload_param.nvme_path` (checked beforehand with `nvme_io.check_swap_dir`).
        numel: elements of the shard; dtype: its dtype (the training dtype).
        rank: this rank, for the directory name.
        max_in_cpu: the most shard elements kept mapped in between uses (`offload_param.max_in_cpu`);
            at least the largest unit in use is always allowed.
    """

    def __init__(self, root: Path, numel: int, dtype: torch.dtype, *, rank: int, max_in_cpu: int) -> None:
        self.numel, self.dtype, self.max_in_cpu = numel, dtype, max(0, int(max_in_cpu))
        self._item = torch.empty((), dtype=dtype).element_size()
        self.dir = new_run_dir(Path(root), rank)
        self.path = self.dir / "params.swp"
        size = max(PAGE, -(-numel * self._item // PAGE) * PAGE)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, size)  # sparse: reads as zeros until written
        self._mm: mmap.mmap | None = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED,
                                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor: Tensor = torch.frombuffer(self._mm, dtype=dtype, count=numel)
        self._resident: OrderedDict[tuple[int, int], None] = OrderedDict()  # element ranges, LRU first
        self._resident_numel = 0
        self.reads_advised = 0
        """Ranges asked to be read ahead (for tests and the bench)."""
        atexit.register(self.close)

    def __repr__(self) -> str:
        return (f"MappedParamShard({self.numel} x {self.dtype}, {self.resident_numel} resident, "
                f"max_in_cpu {self.max_in_cpu}, {self.path})")

    @property
    def resident_numel(self) -> int:
        """Elements of the ranges currently kept mapped in (what `max_in_cpu` bounds)."""
        return self._resident_numel

    def _bytes(self, start: int, end: int) -> tuple[int, int]:
        """The page-aligned byte range covering elements [start, end)."""
        lo = start * self._item // PAGE * PAGE
        hi = min(len(self._mm) if self._mm is not None else 0, -(-end * self._item // PAGE) * PAGE)
        return lo, max(0, hi - lo)

    def use(self, start: int, end: int) -> None:
        """Elements [start, end) are about to be read: read them ahead; evict the least recently
        used ranges beyond `max_in_cpu`."""
        if self._mm is None or end <= start:
            return
        key = (start, end)
        if key in self._resident:
            self._resident.move_to_end(key)
        else:
            lo, n = self._bytes(start, end)
            if n:
                self._mm.madvise(mmap.MADV_WILLNEED, lo, n)
                self.reads_advised += 1
            self._resident[key] = None
            self._resident_numel += end - start
        while self.resident_numel > self.max_in_cpu and len(self._resident) > 1:
            old = next(iter(self._resident))
            del self._resident[old]
            self._resident_numel -= old[1] - old[0]
            self._drop(*old)

    def _drop(self, start: int, end: int) -> None:
        """Write elements [start, end) back to the file and drop their pages from memory."""
        if self._mm is None:
            return
        lo, n = self._bytes(start, end)
        if not n:
            return
        # Pages are shared with neighbouring ranges at the edges; writing back and dropping a
        # page another range still uses only costs that range a re-read, never its data.
        self._mm.flush(lo, n)
        self._mm.madvise(mmap.MADV_DONTNEED, lo, n)
        os.posix_fadvise(self._fd, lo, n, os.POSIX_FADV_DONTNEED)

    def evict_all(self) -> None:
        """Write everything back and drop it from memory (after the step wrote every shard)."""
        if self._mm is None:
            return
        self._resident.clear()
        self._resident_numel = 0
        self._drop(0, self.numel)

    def close(self) -> None:
        """Unmap and remove the swap file (Note: [swap files are scratch])."""
        if self._mm is None:
            return
        self.tensor = torch.empty(0, dtype=self.dtype)  # no view of the mapping may outlive it
        try:
            self._mm.close()
        except BufferError:  # a view is still exported (a caller holds a slice): leave the map
            pass
        self._mm = None
        os.close(self._fd)
        shutil.rmtree(self.dir.parent, ignore_errors=True)
        atexit.unregister(self.close)
