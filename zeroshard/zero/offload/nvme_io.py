"""Asynchronous file I/O for NVMe swapping, with no compiler and no system library.

DeepSpeed's `aio` needs libaio and a JIT C++ build. Here a pool of Python threads issues
`os.preadv` / `os.pwritev`, which release the GIL for the whole system call, so `thread_count x
queue_depth` requests are in flight at the device at once: the same concurrency libaio gives
with `thread_count` threads of `queue_depth` each, traded for a few more (blocked, idle) threads.

Note: [direct I/O] Files are opened twice: with `O_DIRECT` (no page cache: the disk's own
speed, and host memory is not filled with a second copy of what was swapped out) when the
filesystem accepts it, and buffered. A block goes through the direct descriptor when its memory
address, file offset and length are all multiples of `ALIGN`; the rest (an unaligned tail, or a
tensor that is not page-aligned) goes through the buffered one. Linux writes back and drops
cached pages around direct I/O on the same file, so the two views stay coherent.
`aligned_empty` allocates page-aligned tensors whose byte size is padded up to `ALIGN`, so
swapping them is all direct.

Imports nothing of ours but `errors`.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from zeroshard.errors import ConfigError, ZeroshardError

ALIGN = 4096
"""Alignment of direct I/O: memory address, file offset and length (the page size, a multiple of
every logical block size in use)."""

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


class NvmeIOError(ZeroshardError, OSError):
    """A swap read or write failed; the message names the file, the byte range and the cause."""


@dataclass(frozen=True, kw_only=True, slots=True)
class IOOptions:
    """How requests are cut and issued (the `aio` config block).

    Args:
        block_size: bytes per system call; a request is split into blocks of this size.
        queue_depth: blocks in flight per thread.
        thread_count: threads (`aio.intra_op_parallelism`); `thread_count x queue_depth`
            blocks are in flight at once.
        direct: True: O_DIRECT is required (ConfigError if the filesystem refuses it);
            False: never; None: used when the filesystem accepts it.
    """

    block_size: int = 1 << 20
    queue_depth: int = 8
    thread_count: int = 1
    direct: bool | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "thread_count"):
            if getattr(self, name) < 1:
                raise ConfigError(f"aio.{name}: must be at least 1, got {getattr(self, name)}")

    @property
    def in_flight(self) -> int:
        return self.thread_count * self.queue_depth


def round_up(nbytes: int, align: int = ALIGN) -> int:
    return -(-nbytes // align) * align


def aligned_empty(numel: int, dtype: torch.dtype, *, pin: bool = False) -> Tensor:
    """A 1-D uninitialised tensor whose storage is page-aligned and padded up to `ALIGN` bytes,
    so reading or writing it is all direct I/O. Pinned (page-locked) when `pin` and CUDA exist;
    otherwise backed by an anonymous mmap (always page-aligned)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    padded = round_up(max(numel * itemsize, 1))
    if pin and torch.cuda.is_available():
        raw = torch.empty(padded + ALIGN, dtype=torch.uint8, pin_memory=True)
        skip = (-raw.data_ptr()) % ALIGN
        return raw[skip : skip + padded].view(dtype)[:numel]
    buf = mmap.mmap(-1, padded)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)[:numel]  # keeps `buf` alive


def _memory(t: Tensor, start: int, nbytes: int) -> memoryview:
    """A writable view of `nbytes` bytes of `t`'s memory from byte `start` (no copy)."""
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr() + start)).cast("B")


def direct_supported(directory: Path) -> bool:
    """Whether files under `directory` can be opened with O_DIRECT (tmpfs and some network
    filesystems refuse it with EINVAL)."""
    if not _O_DIRECT:
        return False
    probe = directory / f".zeroshard-odirect-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | _O_DIRECT, 0o600)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    os.close(fd)
    probe.unlink(missing_ok=True)
    return True


class IOHandle:
    """A request in flight: `wait()` blocks until every block is done and raises the first error."""

    def __init__(self, futures: list[Future[None]]) -> None:
        self._futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        errors = [f.exception() for f in self._futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first


class SwapFile:
    """One file read and written asynchronously through an `AsyncIO` pool.

    Created (truncated) and sized to `nbytes` rounded up to `ALIGN`; `close()` and `remove()` end it.
    """

    def __init__(self, io: "AsyncIO", path: Path, nbytes: int) -> None:
        self.path, self.nbytes, self._io = path, round_up(nbytes), io
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        self._fd = os.open(path, flags, 0o600)
        self._direct_fd: int | None = None
        try:
            os.ftruncate(self._fd, self.nbytes)
            if self.nbytes:  # reserve the blocks now: no ENOSPC mid-step, no allocation in the writes
                os.posix_fallocate(self._fd, 0, self.nbytes)
            if io.direct:
                self._direct_fd = os.open(path, os.O_RDWR | _O_DIRECT)
        except OSError as e:
            self.close()
            raise NvmeIOError(f"{path}: cannot prepare a {self.nbytes}-byte swap file: {e.strerror}") from e

    @property
    def direct(self) -> bool:
        return self._direct_fd is not None

    def write(self, src: Tensor, offset: int = 0) -> IOHandle:
        """Write `src` (contiguous, CPU) at byte `offset` of the file."""
        return self._io.submit(self, src, offset, write=True)

    def read(self, dst: Tensor, offset: int = 0) -> IOHandle:
        """Read into `dst` (contiguous, CPU) from byte `offset` of the file."""
        return self._io.submit(self, dst, offset, write=False)

    def _blocks(self, t: Tensor, offset: int) -> Iterator[tuple[int, int, int, bool]]:
        """(memory start, file offset, length, direct) for each system call of a request."""
        nbytes = t.numel() * t.element_size()
        if offset < 0 or offset + nbytes > self.nbytes:
            raise NvmeIOError(f"{self.path}: bytes [{offset}, {offset + nbytes}) lie outside the "
                              f"{self.nbytes}-byte swap file")
        aligned = self.direct and t.data_ptr() % ALIGN == 0 and offset % ALIGN == 0
        body = (nbytes // ALIGN) * ALIGN if aligned else 0
        block = max(ALIGN, (self._io.options.block_size // ALIGN) * ALIGN)
        for start in range(0, body, block):
            yield start, offset + start, min(block, body - start), True
        if body < nbytes:  # Note: [direct I/O] the unaligned rest is buffered
            tail_block = self._io.options.block_size
            for start in range(body, nbytes, tail_block):
                yield start, offset + start, min(tail_block, nbytes - start), False

    def _transfer(self, t: Tensor, mem_start: int, file_offset: int, length: int, direct: bool,
                  write: bool) -> None:
        fd = self._direct_fd if direct else self._fd
        assert fd is not None
        view = _memory(t, mem_start, length)
        done = 0
        while done < length:  # a short transfer is retried from where it stopped
            part = view[done:]
            try:
                n = os.pwritev(fd, [part], file_offset + done) if write else os.preadv(fd, [part], file_offset + done)
            except OSError as e:
                op = "write" if write else "read"
                raise NvmeIOError(f"{self.path}: {op} of bytes [{file_offset + done}, {file_offset + length}) "
                                  f"failed: {e.strerror} (errno {e.errno})") from e
            if n == 0:
                raise NvmeIOError(f"{self.path}: read of bytes [{file_offset + done}, {file_offset + length}) "
                                  "hit the end of the file (truncated swap file?)")
            done += n

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        for fd in (self._direct_fd, self._fd):
            if fd is not None:
                os.close(fd)
        self._fd, self._direct_fd = -1, None

    def remove(self) -> None:
        if self._fd != -1:
            self.close()
        self.path.unlink(missing_ok=True)


class AsyncIO:
    """A pool of I/O threads shared by the swap files of one directory.

    Args:
        directory: where swap files go (must exist).
        options: block size, depth, threads, and whether O_DIRECT is required.
    """

    def __init__(self, directory: Path, options: IOOptions = IOOptions()) -> None:
        self.directory, self.options = Path(directory), options
        can_direct = options.direct is not False and direct_supported(self.directory)
        if options.direct and not can_direct:
            raise ConfigError(f"{self.directory}: the filesystem refuses O_DIRECT, which was required; "
                              "put the swap directory on a local disk (ext4, xfs), or allow buffered I/O.")
        self.direct = can_direct
        self._pool = ThreadPoolExecutor(options.in_flight, thread_name_prefix="zeroshard-io")
        self._limit = threading.BoundedSemaphore(options.in_flight)

    def open(self, name: str, nbytes: int) -> SwapFile:
        return SwapFile(self, self.directory / name, nbytes)

    def submit(self, file: SwapFile, t: Tensor, offset: int, *, write: bool) -> IOHandle:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise NvmeIOError(f"{file.path}: swap I/O needs a contiguous CPU tensor, got {t.device} "
                              f"{'contiguous' if t.is_contiguous() else 'strided'}")
        futures = []
        for mem_start, file_offset, length, direct in file._blocks(t, offset):
            self._limit.acquire()  # at most `in_flight` blocks queued or running
            fut = self._pool.submit(file._transfer, t, mem_start, file_offset, length, direct, write)
            fut.add_done_callback(lambda _: self._limit.release())
            futures.append(fut)
        return IOHandle(futures)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "AsyncIO":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def check_swap_dir(path: Path | str, need_bytes: int, *, key: str, direct: bool | None = None) -> Path:
    """Check a swap directory before any step: it exists, is a directory, is writable, has
    `need_bytes` free, and accepts O_DIRECT when `direct` is True. Returns it resolved.

    Raises:
        ConfigError: naming `key` (e.g. "zero_optimization.offload_optimizer.nvme_path"), the
            path, what is wrong and the fix.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{key}: {str(p)!r} does not exist; create it (mkdir -p {p}) or point "
                          "nvme_path at a directory on the NVMe drive.")
    if not p.is_dir():
        raise ConfigError(f"{key}: {str(p)!r} is not a directory; set nvme_path to a directory.")
    probe = p / f".zeroshard-write-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}: {str(p)!r} is not writable ({e.strerror}); choose a directory this "
                          "user can write, or fix its permissions.") from e
    free = shutil.disk_usage(p).free
    if free < need_bytes:
        raise ConfigError(f"{key}: the swap files need {_gib(need_bytes)} but {str(p)!r} has {_gib(free)} "
                          "free; free space there, choose a larger drive, or shard over more ranks.")
    if direct and not direct_supported(p):
        raise ConfigError(f"{key}: the filesystem of {str(p)!r} refuses O_DIRECT, which was required; "
                          "use a local disk (ext4, xfs).")
    return p.resolve()


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB ({nbytes} bytes)"
