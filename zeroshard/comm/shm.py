"""Same-host collectives through shared memory: all-gather, all-reduce, reduce-scatter, broadcast.

Note: [shared-memory collectives]
When every rank of a group runs on this host (the signature board's vote, Note: [signature
board] in board.py), the board's file also holds a data arena, and the CPU collectives that move
the most bytes in training run through it instead of gloo's loopback sockets: each rank copies
its data into its own slot and reads its peers' slots, one memory copy each way. At 2 ranks on
the 2-core test machine a 25M-element fp32 all-gather took 21 ms against gloo's 79, an
all-reduce 44 ms against 96 (``bench/collectives.py``).

Layout: per rank, a row of two halves of ``half_bytes``; per rank, a phase counter (one int64,
alone in a 64-byte line). A collective is cut into *pieces* of at most one half; pieces are
numbered across collectives (``_piece``, equal on every rank: the ranks run the same
collectives in the same order), piece g uses half g % 2, and each piece has three phases; rank
r's counter is 3g + k once it finished phase k of piece g:

1. every rank copies its input piece into its half (a broadcast: the root only);
2. all-reduce / reduce-scatter: each rank reduces its sub-range of the piece over the ranks, in
   rank order (so every rank's result is the same bits, at any world size);
3. all-reduce: each rank copies the other ranks' reduced sub-ranges.

A rank waits for every counter to reach 3g + 1 before it reads the piece (and 3g + 2 before
phase 3), and for 3g - 3 (piece g - 2 finished everywhere) before it writes into a half again.
The writes a reader relies on are ordered by x86's store order (TSO): the data is stored before
the counter that says so, by the same thread; the arena is only used on x86-64.

A collective runs in the thread that issues its data (the caller's, or the board's poller for
an asynchronous one whose check the poller decided), so collectives of one group still run in
check order on every rank; a waiting rank sees a dead peer by the board's liveness check and
gives up at the collective timeout. ``ZEROSHARD_COMM_SHM=0`` keeps every collective on gloo.
"""

from __future__ import annotations

import os
import platform
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from zeroshard.comm.wait import spin_wait
from zeroshard.errors import CommError

if TYPE_CHECKING:
    import mmap


class PeerLiveness(Protocol):
    """What an arena asks of the board it lives in (comm/board.py's `Board`): whether this process
    closed it, and whether a peer has exited (its pid, or None while it lives)."""

    @property
    def closed(self) -> bool: ...

    def peer_gone(self, rank: int) -> int | None: ...

HALF_BYTES = 4 << 20
"""Bytes of one half of a rank's row: a piece moves at most this much per rank (less past 2
ranks: ``ROWS_BYTES``). At 2 MiB a 25M-element all-reduce took 53 ms here, at 4 MiB 41."""
ROWS_BYTES = 16 << 20
"""The rows of one group's arena take at most this much (every rank maps and touches all of
it: it counts in each rank's resident memory)."""
MIN_HALF_BYTES = 256 << 10
"""Smaller than this (a small /dev/shm) and the arena is not worth it: gloo carries the data."""
_LINE = 8  # int64 words per counter (one 64-byte cache line each)
_SUMMABLE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
             torch.int16, torch.int32, torch.int64}


def wanted() -> bool:
    """Whether this process may use the arena (x86-64, ``ZEROSHARD_COMM_SHM`` not "0")."""
    return (os.environ.get("ZEROSHARD_COMM_SHM", "1") != "0"
            and platform.machine().lower() in ("x86_64", "amd64"))


def half_bytes_for(world_size: int, free_bytes: int) -> int:
    """The half size an arena of ``world_size`` rows uses when ``free_bytes`` are free where
    it lives: ``HALF_BYTES``, less past 2 ranks (``ROWS_BYTES`` in all) and on a small
    /dev/shm (a quarter of it at most), 0 for none."""
    half = HALF_BYTES
    while half > MIN_HALF_BYTES and 2 * world_size * half > ROWS_BYTES:
        half //= 2
    while half >= MIN_HALF_BYTES and 4 * 2 * world_size * half > free_bytes:
        half //= 2
    return half if half >= MIN_HALF_BYTES else 0


_BUFFERS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
"""The arenas' rows and sum scratch in this process, by data pointer (``is_arena_buffer``)."""


def is_arena_buffer(data_ptr: int) -> bool:
    """True if a storage at ``data_ptr`` is an arena's rows or sum scratch: communication
    memory, which a census of tensor memory leaves out (as CUDA's allocator count would not
    see a shared-memory mapping either)."""
    return data_ptr in _BUFFERS


def arena_bytes(world_size: int, half_bytes: int) -> int:
    """Bytes of the counters and rows (the rows start 4 KiB-aligned within the arena)."""
    return 4096 + 2 * world_size * half_bytes if half_bytes else 0


class Arena:
    """One group's shared-memory data arena on this rank (Note: [shared-memory collectives])."""

    def __init__(self, mm: mmap.mmap, offset: int, rank: int, world_size: int, half_bytes: int,
                 board: PeerLiveness) -> None:
        self.rank, self.world_size, self.half_bytes = rank, world_size, half_bytes
        self._board = board
        self._counters = memoryview(mm)[offset:offset + 4096].cast("q")
        self._rows = torch.frombuffer(mm, dtype=torch.uint8, offset=offset + 4096,
                                      count=2 * world_size * half_bytes).view(world_size, 2, half_bytes)
        self._scratch = torch.empty(-(-half_bytes // world_size) + 64, dtype=torch.uint8)
        """A rank's all-reduce sub-range of a piece is summed here (allocated once: a fresh
        tensor per piece costs page faults)."""
        for buffer in (self._rows, self._scratch):
            _BUFFERS[buffer.untyped_storage().data_ptr()] = buffer
        self._piece = 0
        """Pieces run so far on this group (the next piece's number)."""

    # ---- the phases -------------------------------------------------------------------------
    def _arrive(self, phase: int) -> None:
        self._counters[_LINE * self.rank] = phase

    def _await(self, phase: int, deadline: float, what: str) -> None:
        """Until every rank's counter reached ``phase``; a dead peer or the deadline raises."""
        counters, world = self._counters, self.world_size

        def behind() -> list[int]:
            return [j for j in range(world) if counters[_LINE * j] < phase]

        def reached() -> bool | None:
            for j in range(world):
                if counters[_LINE * j] < phase:
                    return None
            return True

        def gone() -> BaseException | None:
            if self._board.closed:
                return CommError(f"shared-memory {what}: the arena was closed (the process is leaving)")
            for j in behind():
                pid = self._board.peer_gone(j)
                if pid is not None:
                    return CommError(f"rank {j} (pid {pid}) exited during the shared-memory {what}")
            return None

        def late(waited: float) -> BaseException:
            ranks = behind()
            return TimeoutError(f"Timed out after {waited:.1f} s in the shared-memory {what}: rank"
                                f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} did not reach it")

        result = spin_wait(reached, deadline, gone, late)
        if isinstance(result, BaseException):
            raise result

    def _pieces(self, numel: int, per_piece: int) -> list[tuple[int, int, int, int]]:
        """(g, half, start, stop) of each piece of ``numel`` elements, ``per_piece`` at most."""
        out = []
        for start in range(0, numel, per_piece):
            g = self._piece
            self._piece += 1
            out.append((g, g % 2, start, min(numel, start + per_piece)))
        return out

    def _slot(self, rank: int, half: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        return self._rows[rank, half, :numel * size].view(dtype)

    def _begin_piece(self, g: int, deadline: float, what: str) -> None:
        if g >= 2:  # its half was last used by piece g - 2: every rank must have finished that
            self._await(3 * g - 3, deadline, what)

    @staticmethod
    def _sub(p: int, world: int, j: int) -> tuple[int, int]:
        k = -(-p // world)
        return min(p, j * k), min(p, (j + 1) * k)

    @staticmethod
    def _reducer(op: str) -> Callable[..., torch.Tensor]:
        return {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]

    @staticmethod
    def supports(dtype: torch.dtype, op: str | None = None) -> bool:
        """Whether the arena runs this collective (else gloo does)."""
        return dtype in _SUMMABLE and (op is None or op in ("sum", "max", "min"))

    def _elements(self, t: torch.Tensor) -> int:
        return self.half_bytes // t.element_size()

    # ---- collectives ------------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, in_: torch.Tensor, timeout_s: float) -> None:
        """``out[r * n:(r + 1) * n] = in_`` of rank r (flat, contiguous, one dtype)."""
        deadline, what = time.monotonic() + timeout_s, "all-gather"
        n, world = in_.numel(), self.world_size
        outs = out.view(world, n)
        for g, h, a, b in self._pieces(n, self._elements(in_)):
            self._begin_piece(g, deadline, what)
            self._slot(self.rank, h, in_.dtype, b - a).copy_(in_[a:b])
            self._arrive(3 * g + 1)
            self._await(3 * g + 1, deadline, what)
            for j in range(world):
                outs[j, a:b].copy_(in_[a:b] if j == self.rank else self._slot(j, h, in_.dtype, b - a))
            self._arrive(3 * g + 3)

    def broadcast(self, t: torch.Tensor, src: int, timeout_s: float) -> None:
        deadline, what = time.monotonic() + timeout_s, "broadcast"
        for g, h, a, b in self._pieces(t.numel(), self._elements(t)):
            self._begin_piece(g, deadline, what)
            if self.rank == src:
                self._slot(src, h, t.dtype, b - a).copy_(t[a:b])
            self._arrive(3 * g + 1)
            self._await(3 * g + 1, deadline, what)
            if self.rank != src:
                t[a:b].copy_(self._slot(src, h, t.dtype, b - a))
            self._arrive(3 * g + 3)

    def all_reduce(self, t: torch.Tensor, op: str, timeout_s: float) -> None:
        """``t`` = the reduction over ranks of ``t``, summed in rank order on every rank."""
        deadline, what = time.monotonic() + timeout_s, "all-reduce"
        world, reduce = self.world_size, self._reducer(op)
        for g, h, a, b in self._pieces(t.numel(), self._elements(t)):
            self._begin_piece(g, deadline, what)
            p = b - a
            slots = [self._slot(j, h, t.dtype, p) for j in range(world)]
            slots[self.rank].copy_(t[a:b])
            self._arrive(3 * g + 1)
            self._await(3 * g + 1, deadline, what)
            lo, hi = self._sub(p, world, self.rank)
            if hi > lo:
                # Into this rank's scratch, never a slot a later term still reads, then its slot.
                acc = self._scratch[:(hi - lo) * t.element_size()].view(t.dtype)
                reduce(slots[0][lo:hi], slots[1][lo:hi], out=acc)
                for j in range(2, world):
                    reduce(acc, slots[j][lo:hi], out=acc)
                slots[self.rank][lo:hi].copy_(acc)
            self._arrive(3 * g + 2)
            self._await(3 * g + 2, deadline, what)
            for j in range(world):
                lo, hi = self._sub(p, world, j)
                if hi > lo:
                    t[a + lo:a + hi].copy_(slots[j][lo:hi])
            self._arrive(3 * g + 3)

    def reduce_scatter(self, out: torch.Tensor, in_: torch.Tensor, op: str, timeout_s: float) -> None:
        """``out`` = the reduction over ranks of ``in_[rank * n:(rank + 1) * n]``, in rank order."""
        deadline, what = time.monotonic() + timeout_s, "reduce-scatter"
        world, reduce, n = self.world_size, self._reducer(op), out.numel()
        ins = in_.view(world, n)
        per_piece = max(1, self._elements(in_) // world)
        for g, h, a, b in self._pieces(n, per_piece):
            self._begin_piece(g, deadline, what)
            p = b - a
            rows = [self._slot(j, h, in_.dtype, world * p).view(world, p) for j in range(world)]
            rows[self.rank].copy_(ins[:, a:b])
            self._arrive(3 * g + 1)
            self._await(3 * g + 1, deadline, what)
            dst = out[a:b]
            reduce(rows[0][self.rank], rows[1][self.rank], out=dst)
            for j in range(2, world):
                reduce(dst, rows[j][self.rank], out=dst)
            self._arrive(3 * g + 3)


class DoneWork:
    """What an arena collective returns in place of a backend Work: it is already complete."""

    __slots__ = ()

    def wait(self, timeout: object = None) -> bool:
        del timeout
        return True

    def is_completed(self) -> bool:
        return True
