"""Divergence diagnostics: which collective each rank issued last, and why a group is stuck.

Note: [divergence diagnostics]
The hot path only counts: ``issue()`` bumps a per-group sequence number and keeps the call site
in local memory (no store traffic, a few microseconds). A daemon thread per process publishes
that state to the group's c10d store at most every ``POLL_S`` seconds when it changed, and on
demand. When a collective fails or times out, the failing rank asks every peer to publish
(``store.add(REQUEST_KEY)``), waits up to ``RESPONSE_S`` for the answers, and builds a message
naming each rank's last collective. A rank busy in Python (training, sleeping) answers from its
thread; a rank blocked in C without the GIL still left its last published state; a rank that
exited said so from ``atexit``. The report's text is divergence_report.py's. The same thread
beats for this rank and, while it waits, ends it when a peer falls silent (Note: [peer silence]
in silence.py). Imports nothing of ours but ``errors``, ``comm.board``, ``comm.call_record``,
``comm.divergence_report``,
``comm.env`` and ``comm.silence``.

Note: [watcher shutdown]
The watcher must never be inside a c10d store call when the interpreter finalizes: the call
returns without the GIL, pybind11 re-acquires it in a noexcept destructor, the finalizing
interpreter ends the thread with pthread_exit, and the forced unwind through that noexcept
frame is std::terminate -- "terminate called without an active exception", SIGABRT, on a rank
that had finished cleanly. A daemon thread joined from ``atexit`` with a short timeout left
exactly that window open on a loaded machine. So the watcher is a non-daemon thread, and a
``threading`` exit hook (run before Python joins non-daemon threads, before ``atexit`` and
long before finalization) stops it and waits for its current store call to finish.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zeroshard.comm.board import Board, checks_wanted
from zeroshard.comm.call_record import CallRecord, call_site, record_dict
from zeroshard.comm.divergence_report import (
    describe_states,
    disagreement,
    first_line,
    mismatch_text,
)
from zeroshard.comm.env import PEER_SILENCE_ENV, resolve_peer_silence_s
from zeroshard.comm.silence import BEAT_S, SilenceWatch, StoreWatch, beat_key, silence_report, store_silence_report
from zeroshard.errors import CommError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

POLL_S = 0.2
"""How often the watcher thread looks for requests and publishes a changed state (at world
sizes above 1000 it polls less often, keeping the store under ~5000 requests/s)."""
RESPONSE_S = 2.0
"""How long a failing rank waits for its peers' answers before reporting without them
(at least three polling periods)."""


_PREFIX = "zeroshard.comm/"
REQUEST_KEY = _PREFIX + "request"
_MAX_PENDING = 4096
"""Records of async collectives never waited are dropped beyond this many."""


_HOST = socket.gethostname()

_register_thread_exit: Callable[[Callable[[], None]], None] | None = getattr(
    threading, "_register_atexit", None)
"""Runs a callback when the interpreter starts shutting down, before non-daemon threads are
joined (what concurrent.futures uses). Without it, fall back to a daemon thread + atexit."""


def _poll_s(world_size: int) -> float:
    return max(POLL_S, world_size / 5000)


_UNTRIED = object()
"""`CollectiveTracker._check_board` before the first `shared_board` call."""


class _InFlight:
    """A count of checks in flight that a closing tracker can wait to reach zero."""

    def __init__(self) -> None:
        self._count = 0
        self._cv = threading.Condition()

    def started(self) -> None:
        with self._cv:
            self._count += 1

    def ended(self) -> None:
        with self._cv:
            self._count -= 1
            if self._count == 0:
                self._cv.notify_all()

    def wait_idle(self, timeout: float) -> tuple[bool, int]:
        """Wait until none is in flight, at most `timeout` seconds: (reached zero, still in flight)."""
        with self._cv:
            ended = self._cv.wait_for(lambda: self._count == 0, timeout=timeout)
            return ended, self._count


def _weak_at_exit(ref: "weakref.ref[CollectiveTracker]") -> Callable[[], None]:
    """The exit hook of the tracker `ref` names, if it still exists at exit."""

    def at_exit() -> None:
        tracker = ref()
        if tracker is not None:
            tracker._at_exit()

    return at_exit


class CollectiveTracker:
    """Sequence numbers and call sites of one process group's collectives on this rank.

    One per (process, group), shared by every ``Comm`` on that group, so sequence numbers
    line up across ranks. See Note: [divergence diagnostics].
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int, *,
                 store: Store | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self._group = group
        self._store = store
        self._seq = 0
        self._last: CallRecord | None = None
        self._done_seq = 0
        self._waiting: CallRecord | None = None
        self._wait_since = 0.0
        self._pending: dict[int, CallRecord] = {}
        self._version = 0
        self._published_version = -1
        self._served = 0
        self._state = "running"
        self._reason = ""
        self.broken: str | None = None
        """Set after a collective failed: the group can no longer be trusted."""
        self._check_pg: dist.ProcessGroup | None = None
        """The side group the signature checks run on (Note: [collective signature check])."""
        self._check_board: Board | None | object = _UNTRIED
        """Or the shared-memory board, when every rank is on this host (Note: [signature board])."""
        self.mismatch: CallRecord | None = None
        """The first collective whose signature differed across ranks (set by the check's
        callback thread; read by the caller's)."""
        self._checks = _InFlight()
        # A deque: appended by the caller's thread, rotated by the watcher's (both atomic).
        self._stream_works: deque[tuple[CallRecord, dist.Work, float]] = deque()
        self._stuck_reported: set[int] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # serialises this object's store traffic
        self._thread: threading.Thread | None = None
        if store is not None:
            silence = SilenceWatch(rank, world_size, limit := resolve_peer_silence_s(os.environ))  # bad: raised here
            # Note: [store silence]; a weak reference, as the exit hook's (Note: [groups die before finalization])
            me = weakref.ref(self)
            store_watch = (StoreWatch(limit, lambda: (t._waiting_since() if (t := me()) is not None else None),
                                      lambda *how: None if (t := me()) is None else t._end_for_silent_store(*how),
                                      self._stop) if limit is not None and world_size > 1 else None)
            self._publish()
            # Note: [watcher shutdown]
            self._thread = threading.Thread(target=self._watch, args=(silence, store_watch),
                                            name="zeroshard-comm-watch", daemon=_register_thread_exit is None)
            self._thread.start()
            # Registered through a weak reference (Note: [groups die before finalization]): a
            # bound method would keep this tracker, and through it the process group and gloo's
            # threads, alive until the interpreter finalizes.
            at_exit = _weak_at_exit(weakref.ref(self))
            if _register_thread_exit is not None:
                _register_thread_exit(at_exit)
            else:
                atexit.register(at_exit)

    # ---- hot path -------------------------------------------------------------------------
    def issue(self, op: str, numel: int, dtype: torch.dtype | None, api: str = "") -> CallRecord:
        """Record the next collective of this group; called before it is handed to torch.
        ``api``: the API the script issued it through (``CallRecord.api``), "" for zeroshard's."""
        if self.broken is not None:
            raise CommError(f"rank {self.rank}: {op} refused, the process group is broken:\n"
                            f"{self.broken}")
        self._seq += 1
        rec = CallRecord(self._seq, op, numel, dtype, call_site(), time.monotonic(), api)
        self._last = rec
        pending = self._pending
        pending[rec.seq] = rec
        if len(pending) > _MAX_PENDING:
            del pending[next(iter(pending))]
        self._version += 1
        return rec

    # ---- signature checks (Note: [collective signature check] in comm/checked.py) ----------
    def check_route(self, timeout: timedelta) -> Board | dist.ProcessGroup:
        """Where the signature checks run, chosen at the first check (every rank's first
        collective on this group reaches it): the shared-memory board when every rank is on
        this host (Note: [signature board] in board.py), else a side gloo group with one worker
        thread, so checks complete, and their callbacks run, in issue order. The group itself
        without a store."""
        board = self.shared_board(timeout)
        if board is not None and checks_wanted():  # the board may exist for the data arena alone
            return board
        if self._check_pg is not None:
            return self._check_pg
        if self._store is None:
            self._check_pg = self._group
            return self._group
        store = self._build_store("side")
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._threads = 1
        opts._devices = _gloo_devices()
        self._check_pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, opts)
        return self._check_pg

    def shared_board(self, timeout: timedelta) -> Board | None:
        """The group's shared-memory board (signature checks, and the data arena of Note:
        [shared-memory collectives] in shm.py), built at the first call (a collective: every
        rank's first collective on this group reaches it), or None where the ranks cannot
        share one (several hosts, no store, both of its uses switched off: comm/board.py)."""
        if self._check_board is _UNTRIED:
            self._check_board = None  # one try: a board that cannot be built is not tried again
            if self._store is not None:
                self._check_board = Board.create(self._build_store("board"), self.rank, self.world_size,
                                                 timeout.total_seconds())
        return self._board

    def _build_store(self, what: str) -> dist.PrefixStore:
        base = f"{_PREFIX}check/{getattr(self._group, 'group_name', '')}/{what}"
        # A generation per build, equal on every rank: each rank adds 1 once per build.
        generation = (self._store.add(base + "/builds", 1) - 1) // self.world_size
        return dist.PrefixStore(f"{base}/{generation}/", self._store)

    @property
    def _board(self) -> Board | None:
        """The board, once `shared_board` built it (None before, or where it cannot be built)."""
        return self._check_board if isinstance(self._check_board, Board) else None

    @property
    def checks_on_board(self) -> bool:
        """Whether the signature checks run on the shared-memory board (else the side group)."""
        return self._board is not None and checks_wanted()

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group this tracker sequences."""
        return self._group

    def check_started(self) -> None:
        self._checks.started()

    def check_ended(self) -> None:
        self._checks.ended()

    def note_mismatch(self, rec: CallRecord) -> None:
        """The ranks' collective ``rec.seq`` differed: no later collective's data may move."""
        if self.mismatch is None:
            self.mismatch = rec
            self._version += 1

    def raise_if_mismatched(self, timeout_s: float) -> None:
        """Raise the divergence report if a signature check found a mismatch (the caller's next
        collective after it, when no wait came first)."""
        rec = self.mismatch
        if rec is not None and self.broken is None:
            raise self.fail(rec, RuntimeError(mismatch_text(rec.seq)), timeout_s)

    def begin_wait(self, rec: CallRecord) -> None:
        """This rank now waits for ``rec`` (again: the wait is counted from the first call)."""
        if self._waiting is not rec:
            self._waiting = rec
            self._wait_since = time.monotonic()
            self._version += 1

    def end_wait(self, rec: CallRecord, *, done: bool) -> None:
        self._waiting = None
        if done:
            self._pending.pop(rec.seq, None)
            if rec.seq > self._done_seq:
                self._done_seq = rec.seq
        self._version += 1

    def watch_stream_work(self, rec: CallRecord, work: dist.Work, timeout_s: float) -> None:
        """Track a stream-ordered work (NCCL) until it completes; report it if it never does."""
        self._stream_works.append((rec, work, timeout_s))

    # ---- state shared with peers ----------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """This rank's state as published to the store."""
        waiting = self._waiting
        pending = sorted(self._pending.values(), key=lambda r: r.seq)[:4]
        return {
            "rank": self.rank, "host": _HOST, "pid": os.getpid(), "seq": self._seq, "done": self._done_seq,
            "last": None if self._last is None else record_dict(self._last),
            "waiting": None if waiting is None else record_dict(waiting),
            "wait_s": round(time.monotonic() - self._wait_since, 1) if waiting else 0.0,
            "pending": [record_dict(r) for r in pending if waiting is None or r is not waiting],
            "state": self._state, "reason": self._reason, "served": self._served,
            "mismatch": None if self.mismatch is None else record_dict(self.mismatch),
        }

    def _publish(self) -> None:
        if self._store is None:
            return
        version = self._version
        payload = json.dumps(self.snapshot())
        with self._lock:
            self._store.set(f"{_PREFIX}state/{self.rank}", payload)
        self._published_version = version

    def _watch(self, silence: SilenceWatch, store_watch: StoreWatch | None) -> None:
        try:
            self._watch_store(silence, store_watch)
        finally:  # the store watch outlives a dead store's watcher; both end at close, before atexit
            if store_watch is not None:
                store_watch.join()

    def _watch_store(self, silence: SilenceWatch, store_watch: StoreWatch | None) -> None:
        failures, next_beat = 0, 0.0
        while not self._stop.wait(_poll_s(self.world_size)):
            try:
                with self._lock:
                    if self._store is None:
                        return
                    requested = self._store.add(REQUEST_KEY, 0)
                if requested > self._served or self._version != self._published_version:
                    self._served = max(self._served, requested)
                    self._publish()
                if self._stream_works:
                    self._check_stream_works()
                now = time.monotonic()
                if now >= next_beat:  # Note: [peer silence] in comm/silence.py
                    next_beat = now + BEAT_S
                    with self._lock:
                        self._store.add(beat_key(self.rank), 1)
                    silent = silence.poll(now, self._waiting_since(), self._read_beat)
                    if silent:
                        self._end_for_silent_peers(silent, silence.limit_s or 0.0)
                failures = 0
                if store_watch is not None:
                    store_watch.answered()
            except Exception:  # the store's host is gone: nothing left to tell anyone
                failures += 1
                if failures >= 5:
                    return

    def _waiting_since(self) -> float | None:
        """When this rank's current wait began: a collective it waits in, or the oldest
        stream-ordered work (NCCL) not yet seen complete; None when it waits for nothing."""
        if self._waiting is not None:
            return self._wait_since
        return min((rec.issued_at for rec, _, _ in list(self._stream_works)), default=None)

    def _read_beat(self, peer: int) -> int:
        with self._lock:
            return self._store.add(beat_key(peer), 0) if self._store is not None else 0

    def _end_for_silent_peers(self, silent: list[tuple[int, float]], limit_s: float) -> None:
        """Name the silent peers (host, pid, last collective) and end this process: its wait
        would otherwise last until the collective timeout (Note: [peer silence])."""
        states, note = self._gather_peer_states()
        gone = [(peer, quiet) for peer, quiet in silent
                if peer not in states or states[peer].get("state") == "running"]
        if not gone:  # each exited with a state of its own: the collective's own error names it
            return
        rec = self._waiting
        waited = time.monotonic() - (self._waiting_since() or time.monotonic())
        call = "" if rec is None else f" in {rec.op} (seq {rec.seq}) at {record_dict(rec)['where']}"
        head = silence_report(self.rank, waited, call, gone, states, f"{PEER_SILENCE_ENV}={limit_s:g}")
        # the per-rank lines only: describe_states's verdict is about ranks that diverged
        lines = describe_states(states, self.world_size)[:1 + self.world_size]
        message = "\n".join([head, *lines] + ([f"  ({note})"] if note else []))
        self.broken = message
        print(f"CommError: {message}", file=sys.stderr, flush=True)
        self._state, self._reason = "exited", f"peer rank(s) {[p for p, _ in gone]} silent"
        self._stop.set()
        try:
            self._publish()  # what the others' reports say about this rank
        except Exception:
            pass
        sys.stdout.flush()
        os._exit(1)

    def _end_for_silent_store(self, waited_s: float, quiet_s: float, limit_s: float) -> None:
        """Name the silent store and end (Note: [store silence]); on the store watch's thread: no store calls."""
        rec, lines = self._waiting, describe_states({self.rank: self.snapshot()}, self.world_size)
        call = "" if rec is None else f" in {rec.op} (seq {rec.seq}) at {record_dict(rec)['where']}"
        self.broken = "\n".join([store_silence_report(self.rank, waited_s, call, quiet_s, self._store,
                                                       f"{PEER_SILENCE_ENV}={limit_s:g}"),
                                  lines[0], lines[1 + self.rank]])
        print(f"CommError: {self.broken}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    def _check_stream_works(self) -> None:
        now = time.monotonic()
        works = self._stream_works
        for _ in range(len(works)):
            rec, work, timeout_s = works.popleft()
            if work.is_completed():
                continue
            works.append((rec, work, timeout_s))
            if now - rec.issued_at > timeout_s and rec.seq not in self._stuck_reported:
                self._stuck_reported.add(rec.seq)
                error = RuntimeError(f"not completed after {timeout_s:.0f} s")
                print(self.describe_failure(rec, error, timeout_s), file=sys.stderr, flush=True)

    def _at_exit(self) -> None:
        # sys.last_value is set when the interpreter printed an uncaught exception.
        exc = getattr(sys, "last_value", None)
        reason = "" if exc is None else f"{type(exc).__name__}: {first_line(exc)}"[:200]
        self.close("exited", reason=reason)
        self._end_checks()

    def _end_checks(self) -> None:
        """Let signature checks still in flight end before the interpreter finalizes.

        Note: [stranded checks]
        A rank leaving on an error may leave checks in flight: collectives it issued
        asynchronously after the one that failed, which no peer will match. Each ends in a
        Python callback on gloo's thread, which must not meet a finalizing interpreter (Note:
        [watcher shutdown]: pthread_exit through a noexcept frame, SIGABRT). Such a check ends
        when its peers leave too (their sockets close) or at its timeout. Peers leave within
        their own report's wait (RESPONSE_S), so this waits twice that; a check still in
        flight then would outlive finalization, so the process ends here, hard, with status 1
        (it is leaving on an error, and its report is already out)."""
        ended, stranded = self._checks.wait_idle(2 * RESPONSE_S + 1.0)
        if ended:
            # Destroy the side group now, while the interpreter is whole: left to finalization,
            # its worker thread could drop the last reference to a check's tensor or callback,
            # which needs the GIL (the same hazard as Note: [watcher shutdown]).
            if self._check_pg is not None and self._check_pg is not self._group:
                self._check_pg = None
            if self._board is not None:
                self._board.close()
            return
        print(f"rank {self.rank}: {stranded} collective signature check(s) still in flight at exit; "
              "ending the process now (Note: [stranded checks] in comm/divergence.py)",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    def close(self, state: str, *, reason: str = "") -> None:
        """Stop the watcher and publish a final state ("exited", "left the group")."""
        if self._state != "running":
            return
        self._state, self._reason = state, reason
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            # Wait for the whole current store call (Note: [watcher shutdown]): it ends with
            # the store's own timeout at worst, and an abandoned one aborts the process later.
            self._thread.join()
        try:
            self._publish()
        except Exception:
            pass

    # ---- failure path ---------------------------------------------------------------------
    def _gather_peer_states(self) -> tuple[dict[int, dict[str, Any]], str]:
        """Ask every peer to publish, wait up to RESPONSE_S; returns states and a store note."""
        states: dict[int, dict[str, Any]] = {self.rank: self.snapshot()}
        if self._store is None:
            return states, "no c10d store: peers' states are unknown"
        store = self._store
        try:
            self._publish()
            with self._lock:
                request = store.add(REQUEST_KEY, 1)
            deadline = time.monotonic() + max(RESPONSE_S, 3 * _poll_s(self.world_size))
            peers = [r for r in range(self.world_size) if r != self.rank]
            answered: set[int] = set()
            while True:
                for r in peers:
                    if r in answered:
                        continue
                    key = f"{_PREFIX}state/{r}"
                    with self._lock:
                        if not store.check([key]):
                            continue
                        state = json.loads(store.get(key))
                    states[r] = state
                    if state["served"] >= request or state["state"] != "running":
                        answered.add(r)
                if len(answered) == len(peers) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            for r in peers:
                if r in states and r not in answered:
                    states[r]["stale"] = True
            return states, ""
        except Exception as e:
            return states, f"c10d store unreachable ({type(e).__name__}: {e}); peers unknown"

    def describe_failure(self, rec: CallRecord, error: BaseException, timeout_s: float) -> str:
        """The CommError message: what failed here (for a mismatch, what each rank issued, with
        call sites, in that first line), then every rank's last collective."""
        waited = time.monotonic() - rec.issued_at
        states, note = self._gather_peer_states()
        cause = first_line(error)
        if rec is self.mismatch and (differ := disagreement(states, rec.seq)) is not None:
            cause = f"collective mismatch at seq {rec.seq}, found before any data moved: {differ}"
        call = record_dict(rec)
        head = (f"rank {self.rank}: {call['op']} (seq {rec.seq}) at {call['where']} failed after "
                f"{waited:.1f} s (timeout {timeout_s:g} s): {cause}")
        return "\n".join([head, *describe_states(states, self.world_size)]
                         + ([f"  ({note})"] if note else []))

    def fail(self, rec: CallRecord, error: BaseException, timeout_s: float) -> CommError:
        """Mark the group broken and build the error to raise."""
        message = self.describe_failure(rec, error, timeout_s)
        self.broken = message
        return CommError(message)


def _gloo_devices() -> list[Any]:
    """The devices torch's own gloo groups use: GLOO_SOCKET_IFNAME's interfaces, or the default."""
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    if names:
        return [dist.ProcessGroupGloo.create_device(interface=n) for n in names]
    return [dist.ProcessGroupGloo.create_default_device()]


_TRACKERS: dict[int, CollectiveTracker] = {}


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker) is not a rank: it must not answer, or publish
    # "exited" for, its parent.
    for tracker in _TRACKERS.values():
        tracker._store = None
        tracker._state = "forked"
    _TRACKERS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def tracker_for(group: dist.ProcessGroup, rank: int, world_size: int,
                store_of: Callable[[dist.ProcessGroup], Store | None]) -> CollectiveTracker:
    """The tracker of ``group`` in this process, created (and its thread started) once."""
    tracker = _TRACKERS.get(id(group))
    if tracker is None or tracker._group is not group:
        tracker = CollectiveTracker(group, rank, world_size, store=store_of(group))
        _TRACKERS[id(group)] = tracker
    return tracker


def tracker_of(group: dist.ProcessGroup | None) -> CollectiveTracker | None:
    """The tracker of ``group`` in this process if zeroshard tracks it (a `Comm` was built on it)."""
    tracker = _TRACKERS.get(id(group)) if group is not None else None
    return tracker if tracker is not None and tracker._group is group else None


def tracker_is_idle(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is healthy with no collective issued and not yet completed."""
    tracker = _TRACKERS.get(id(group))
    if tracker is None:
        return True
    return tracker.broken is None and tracker._waiting is None and not tracker._pending


def forget_tracker(group: dist.ProcessGroup, state: str = "left the process group") -> None:
    """Close ``group``'s tracker (before the group is destroyed)."""
    tracker = _TRACKERS.pop(id(group), None)
    if tracker is not None:
        tracker.close(state)
        if tracker._board is not None:  # its poller thread ends; the mapping goes with the object
            tracker._board.close()


def exited_peers(group: dist.ProcessGroup | None) -> dict[int, str]:
    """Peers of ``group`` whose last published state says they left (rank -> "exited: reason"),
    read from the store without asking anyone (a dead peer cannot answer). Empty without a store."""
    tracker = tracker_of(group)
    if tracker is None or tracker._store is None:
        return {}
    out = {}
    for r in range(tracker.world_size):
        key = f"{_PREFIX}state/{r}"
        try:
            with tracker._lock:
                if r == tracker.rank or not tracker._store.check([key]):
                    continue
                state = json.loads(tracker._store.get(key))
        except Exception:  # the store's host is gone too
            return out
        if state.get("state") != "running":
            out[r] = f"{state['state']}" + (f" ({state['reason']})" if state.get("reason") else "")
    return out
