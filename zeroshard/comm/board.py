"""The signature board: the collective signature check of same-host ranks, through shared memory.

Note: [signature board]
When every rank of a group runs on this host and can map one shared file, the signature check
(Note: [collective signature check] in checked.py) needs no collective at all. Check c of rank
r is one 64-bit word in slot c % SLOTS of row r, ``(c mod 2**32) << 32 | 32-bit signature``,
written with one aligned store (a reader sees the whole word or the old one); check c is
decided when every row's slot holds check c, and agrees when the low halves are equal.

- A rank whose peers already wrote decides at once, in the caller's thread; a synchronous
  collective whose peers have not yet written waits in the caller's thread too (spinning, then
  short sleeps). At 2 gloo ranks on the 2-core test machine the side group's 16-byte all-reduce
  cost ~1 ms of latency per collective; the board ~0.05 ms.
- An asynchronous collective whose peers have not yet written is handed to the board's one
  poller thread, which decides checks strictly in order (a later check waits behind an earlier
  undecided one even when it could be decided), so data collectives are still issued in the
  same order on every rank.
- A slot is reused (check c + SLOTS) only once every rank has decided check c: each rank's
  decided count is in the header, read before writing.
- A peer process that dies is seen within ``wait.LIVENESS_S`` by its pid and start time (Linux
  ``/proc``), instead of at the collective timeout; elsewhere the timeout decides.

Built once per tracked group by a vote over the group's store (``create``): rank 0 makes the
file with a random token, every rank maps it and checks the token, and the board is used only
if all ranks could (ranks on several hosts, or hosts that do not share the directory, vote no
and keep the gloo side group). Rank 0 unlinks the file once every rank voted: the mapping lives
on, the name does not (nothing to clean up after a crash).

The mapping has two users, each with its own switch: the signature checks
(``ZEROSHARD_COMM_CHECK_BOARD=0`` sends them to the gloo side group, `checks_wanted`) and the
data arena of the shared-memory collectives (``ZEROSHARD_COMM_SHM=0`` keeps the data on gloo,
`shm.wanted`). The board is built while either is on; each switch turns off only its own use.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import tempfile
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

from zeroshard.comm import shm
from zeroshard.comm.wait import spin_wait
from zeroshard.errors import CommError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

SLOTS = 1024
"""Checks a rank may run ahead of the slowest rank's decided count (bursts of async collectives)."""
MAX_WORLD = 512
"""No board beyond this many ranks (one host does not run more; the file would be large)."""
_ASYNC_SPINS = 20
"""Yields an asynchronous collective's check waits for its peers in the caller's thread before
the poller takes it over."""
_M32 = (1 << 32) - 1
_M64 = (1 << 64) - 1
_HEADER = 2  # int64 words of the token


class Decidable(Protocol):
    """What the board decides: a check (checked.py's ``_Check``)."""

    def conclude(self, verdict: bool | BaseException) -> None: ...


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); -1 if
    unknown (no /proc), -2 if the process is gone or a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return -2
    except OSError:
        return -1
    try:
        fields = stat[stat.rindex(b")") + 2:].split()
        return -2 if fields[0] in (b"Z", b"X") else int(fields[19])
    except (ValueError, IndexError):
        return -1


def _directory() -> str:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()



def checks_wanted() -> bool:
    """Whether the signature checks may use the board (``ZEROSHARD_COMM_CHECK_BOARD`` not "0")."""
    return os.environ.get("ZEROSHARD_COMM_CHECK_BOARD", "1") != "0"

class Board:
    """One group's signature board on this rank (Note: [signature board])."""

    def __init__(self, mm: mmap.mmap, rank: int, world_size: int) -> None:
        self._mm = mm
        self._mv = memoryview(mm).cast("q")
        self.rank, self.world_size = rank, world_size
        self._pid0 = _HEADER
        self._start0 = _HEADER + world_size
        self._decided0 = _HEADER + 2 * world_size
        self._rows0 = _HEADER + 3 * world_size
        self._next = 0
        self._room = 0
        """The least decided count of any rank last read: slots up to it + SLOTS are free (read
        again only past that, not at every check)."""
        self._queue: deque[tuple[int, int, Decidable, float]] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._visible: frozenset[int] = frozenset()
        self.arena: shm.Arena | None = None
        """The shared-memory data arena, when every rank mapped one (Note: [shared-memory collectives])."""
        """Peers whose process this rank sees (``_find_visible_peers``): watched while waited for."""
        self._mv[self._pid0 + rank] = os.getpid()
        self._mv[self._start0 + rank] = _start_time(os.getpid())

    @staticmethod
    def nbytes(world_size: int) -> int:
        return 8 * (_HEADER + 3 * world_size + world_size * SLOTS)

    @classmethod
    def _offset_of_arena(cls, world_size: int) -> int:
        """The data arena (Note: [shared-memory collectives] in shm.py) starts page-aligned after the board."""
        return -(-cls.nbytes(world_size) // 4096) * 4096

    @classmethod
    def _make_file(cls, world_size: int) -> dict[str, object]:
        """Rank 0: the shared file with a random token, and an arena when /dev/shm has room for
        one (its pages reserved now: a full tmpfs fails here, not with SIGBUS at a later store)."""
        directory = _directory()
        half = 0
        if shm.wanted():
            st = os.statvfs(directory)
            half = shm.half_bytes_for(world_size, st.f_bavail * st.f_frsize)
        fd, path = tempfile.mkstemp(prefix="zeroshard-check-", dir=directory)
        token = os.urandom(16)
        try:
            size = cls._offset_of_arena(world_size) + shm.arena_bytes(world_size, half)
            os.ftruncate(fd, size)
            if half:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError:
                    half = 0
                    os.ftruncate(fd, cls._offset_of_arena(world_size))
            os.pwrite(fd, token, 0)
        finally:
            os.close(fd)
        return {"path": path, "token": token.hex(), "half": half}

    # ---- building ---------------------------------------------------------------------------
    @classmethod
    def create(cls, store: Store, rank: int, world_size: int, timeout_s: float) -> Board | None:
        """Collective over ``store`` (a prefix store of this build): the board, or None on every
        rank when any rank cannot map it."""
        wanted = (checks_wanted() or shm.wanted()) and 1 < world_size <= MAX_WORLD
        if rank == 0:
            info: dict[str, object] = {"path": None}
            if wanted:
                try:
                    info = cls._make_file(world_size)
                except OSError:
                    pass
            store.set("board", json.dumps(info))
        board: Board | None = None
        info = json.loads(store.get("board"))
        path, half = info.get("path"), int(info.get("half", 0) or 0)
        if wanted and isinstance(path, str):
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    mm = mmap.mmap(fd, cls._offset_of_arena(world_size) + shm.arena_bytes(world_size, half))
                finally:
                    os.close(fd)
                if mm[:16].hex() == info["token"]:
                    board = cls(mm, rank, world_size)
                else:
                    mm.close()
            except (OSError, ValueError):
                board = None
        arena_ok = board is not None and half > 0 and shm.wanted()
        store.add("board-ok", 1 if board is not None else 0)
        store.add("arena-ok", 1 if arena_ok else 0)
        store.add("board-voted", 1)
        deadline = time.monotonic() + timeout_s
        while store.add("board-voted", 0) < world_size:
            if time.monotonic() > deadline:
                raise CommError(f"rank {rank}: the ranks did not all reach the collective check's set-up "
                                f"within {timeout_s:g} s")
            time.sleep(0.001)
        agreed = store.add("board-ok", 0) == world_size
        if agreed and board is not None and store.add("arena-ok", 0) == world_size:
            board.arena = shm.Arena(board._mm, cls._offset_of_arena(world_size), rank, world_size, half, board)
        if rank == 0 and isinstance(path, str):
            try:
                os.unlink(path)  # every rank has mapped it (or failed to): the name is not needed
            except OSError:
                pass
        if not agreed and board is not None:
            board.close()
            board = None
        if board is not None:
            board._find_visible_peers()
        return board

    def _find_visible_peers(self) -> None:
        """The peers whose process this rank can see (every rank wrote its pid and start time
        before voting): only those are watched. Ranks in another pid namespace that share the
        directory are not, so they are never taken for dead."""
        self._visible = frozenset(
            r for r in range(self.world_size)
            if r != self.rank and self._mv[self._start0 + r] >= 0
            and _start_time(self._mv[self._pid0 + r]) == self._mv[self._start0 + r])

    # ---- checks -----------------------------------------------------------------------------
    def submit(self, check: Decidable, signature: int, timeout_s: float, *, wait_here: bool) -> None:
        """Publish this rank's next check and decide it now if the peers already wrote theirs
        (or, with ``wait_here``, once they do, in this thread); else the poller decides it."""
        with self._cv:
            self._next += 1
            c = self._next
            deadline = time.monotonic() + timeout_s
            self._wait_for_room(c, deadline)
            word = ((c & _M32) << 32) | (signature & _M32)
            self._mv[self._rows0 + self.rank * SLOTS + c % SLOTS] = word - (1 << 64) if word >> 63 else word
            verdict = None if self._queue else self._decide(c, word)
            if verdict is None and not self._queue and not wait_here:
                # A peer is often microseconds behind: a few yields beat the poller's hand-over.
                for _ in range(_ASYNC_SPINS):
                    time.sleep(0)
                    verdict = self._decide(c, word)
                    if verdict is not None:
                        break
            if verdict is None and (self._queue or not wait_here):
                self._queue.append((c, word, check, deadline))
                self._start_poller()
                self._cv.notify()
                return
            if verdict is not None:
                self._mark_decided(c)
        if verdict is None:  # wait_here and nothing queued before it: wait in this thread
            verdict = self._wait(c, word, deadline)
            with self._cv:
                self._mark_decided(c)
        check.conclude(verdict)

    def _wait_for_room(self, c: int, deadline: float) -> None:
        """Check c reuses check c - SLOTS's slot: every rank must have decided that one."""
        if c - SLOTS <= self._room:  # known free: every rank had decided at least this far
            return
        while (room := min(self._mv[self._decided0 + r] for r in range(self.world_size))) < c - SLOTS:
            if time.monotonic() > deadline:
                raise CommError(f"rank {self.rank}: collective check {c} waited for a slot past the timeout")
            self._cv.wait(0.0001)  # releases the lock: the poller may be deciding this rank's own
        self._room = room

    def _decide(self, c: int, word: int) -> bool | None:
        """True/False once every rank wrote check c (equal signatures or not); None before."""
        mv, slot, tag = self._mv, c % SLOTS, c & _M32
        agree = True
        for r in range(self.world_size):
            w = mv[self._rows0 + r * SLOTS + slot] & _M64
            if w >> 32 != tag:
                return None
            if w != word:
                agree = False
        return agree

    def _mark_decided(self, c: int) -> None:
        self._mv[self._decided0 + self.rank] = c

    def _wait(self, c: int, word: int, deadline: float) -> bool | BaseException:
        """Wait in this thread until check c is decided, a peer died, or the deadline passed."""
        def decided() -> bool | BaseException | None:
            if self._closed:
                return CommError(f"collective check {c}: the check board was closed (the process is leaving)")
            return self._decide(c, word)

        return spin_wait(decided, deadline, lambda: self._dead_peer(c),
                         lambda waited: TimeoutError(f"Timed out after {waited:.1f} s: {self._absent(c)} did not "
                                                     f"reach collective check {c}"))

    def _reached(self, r: int, c: int) -> bool:
        """Whether rank r has written check c (the slow paths; `_decide` inlines it)."""
        return (self._mv[self._rows0 + r * SLOTS + c % SLOTS] & _M64) >> 32 == c & _M32

    def _absent(self, c: int) -> str:
        ranks = [r for r in range(self.world_size) if not self._reached(r, c)]
        return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"

    @property
    def closed(self) -> bool:
        return self._closed

    def peer_gone(self, r: int) -> int | None:
        """Rank r's pid if this rank sees its process and it has exited (else None: alive, or
        not visible from here, when only the timeout decides)."""
        if r not in self._visible:
            return None
        pid, start = self._mv[self._pid0 + r], self._mv[self._start0 + r]
        now = _start_time(pid)
        return pid if now != start and now != -1 else None

    def _dead_peer(self, c: int) -> CommError | None:
        """A peer that has not reached check c and whose process is gone, as an error."""
        for r in self._visible:  # others (no /proc, another pid namespace): the timeout decides
            if self._reached(r, c):
                continue
            pid, start = self._mv[self._pid0 + r], self._mv[self._start0 + r]
            now = _start_time(pid)
            if now != start and now != -1:
                return CommError(f"rank {r} (pid {pid}) exited before collective check {c}")
        return None

    # ---- the poller -------------------------------------------------------------------------
    def _start_poller(self) -> None:
        if self._thread is None:
            # Not a daemon (Note: [watcher shutdown] in divergence.py): a daemon thread still inside
            # a C++ call (a gloo issue, a Work's release) when the interpreter finalizes ends the
            # process with "terminate called without an active exception". The tracker's exit
            # hook closes the board first (CollectiveTracker._end_checks), so this thread is gone
            # before Python joins its threads.
            self._thread = threading.Thread(target=self._poll, name="zeroshard-comm-board",
                                            daemon=not hasattr(threading, "_register_atexit"))
            self._thread.start()

    def _poll(self) -> None:
        """Decide queued checks in order (their conclusions issue the data collectives)."""
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                c, word, check, deadline = self._queue[0]
            verdict = self._wait(c, word, deadline)
            with self._cv:
                self._mark_decided(c)
            # Concluded (its data issued) while still at the head of the queue: a check the
            # caller submits meanwhile queues behind it instead of issuing its data first.
            self._conclude(check, verdict)
            with self._cv:
                self._queue.popleft()
                failed: list[Decidable] = []
                if isinstance(verdict, BaseException):  # the group is broken: nothing after it moves
                    failed = [item[2] for item in self._queue]
                    self._queue.clear()
            for later in failed:
                self._conclude(later, CommError(f"not issued: collective check {c} failed before it"))
            # Drop this thread's references before it sleeps: a concluded check holds its data
            # collective's Work, and so its tensors (a gathered ZeRO-3 unit), until replaced.
            del check, verdict, failed

    @staticmethod
    def _conclude(check: Decidable, verdict: bool | BaseException) -> None:
        try:
            check.conclude(verdict)
        except BaseException as e:  # a conclusion records its own errors; never kill the poller
            print(f"zeroshard: collective check conclusion raised {type(e).__name__}: {e}", file=sys.stderr)

    def close(self) -> None:
        """Stop the poller (queued checks are dropped: the caller ended them or is exiting)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)

