"""Checked issue: a collective's data moves only after every rank's signature of it agreed.

Note: [collective signature check]
On CPU backends each collective is preceded by a 16-byte MAX all-reduce of (fingerprint,
-fingerprint) on a side group of the same ranks: equal on every rank exactly when
max == -max(-x) == min. gloo aborts the whole process (C++ terminate, SIGABRT) when a peer
sends a message larger than the receiver posted (an all-reduce, all-gather or reduce-scatter
whose sizes differ), before Python can say anything; the check finds the mismatch first, on
every rank, and raises the divergence report instead (Note: [divergence diagnostics]).

The side group carries nothing else, so checks pair one per collective in issue order,
whatever the ranks issue: an extra or a different collective on one rank is compared against
the other ranks' collective of the same sequence number.

Where every rank of the group is on this host, the check runs through shared memory instead
of the side group (Note: [signature board] in board.py): ~0.05 ms per collective against the
side group's ~1 ms round trip at 2 gloo ranks here. What follows holds for both routes.

The check is off the caller's path. ``checked_issue`` hands the check to the side group and
returns at once; the data collective is handed to the data group by the check's completion
callback (run by the side group's one worker thread, in issue order), and only if the
signatures agreed. The caller's ``wait`` first waits for that hand-over, then for the data.
Waiting for the check on the caller's thread (stop 31's design) turned every asynchronous
collective -- an overlapped bucket reduction, a prefetched ZeRO-3 gather -- into a point where
the rank stood still until its peers caught up: 6-9% of a step at 2 gloo ranks. A mismatch is
reported at the caller's next wait or next collective, on every rank, before any data of the
mismatched collective (or of a later one) moved. Stream backends (NCCL) skip the check: it would
synchronise the host. ``ZEROSHARD_COMM_VERIFY=0`` turns it off (`verify_wanted`), for zeroshard's
collectives and the script's alike (Note: [script collectives] in user_collectives.py).

Imports nothing of ours but ``errors``, ``comm.board``, ``comm.call_record``, ``comm.divergence``
and ``comm.divergence_report``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from zeroshard.comm.board import Board
from zeroshard.comm.call_record import CallRecord, signature
from zeroshard.comm.divergence import CollectiveTracker
from zeroshard.comm.divergence_report import mismatch_text
from zeroshard.errors import CommError


def verify_wanted() -> bool:
    """Whether collectives are signature-checked (``ZEROSHARD_COMM_VERIFY`` not "0"; CPU backends)."""
    return os.environ.get("ZEROSHARD_COMM_VERIFY", "1") != "0"


class CollectiveMismatchError(RuntimeError):
    """The ranks' collectives of one sequence number differ in operation, size or dtype."""


class PendingIssue:
    """A collective handed to the signature check; its data is issued once the check agreed.

    ``wait_issued`` blocks until then and returns the data collective's ``Work``, or raises
    what stopped it (the check failed or timed out, the signatures differed, the issue raised).
    """

    __slots__ = ("rec", "_issue", "_work", "_error", "_ready")

    def __init__(self, rec: CallRecord, issue: Callable[[], dist.Work] | None) -> None:
        self.rec = rec
        self._issue = issue
        """None: check only (the caller issues the data itself once ``wait_issued`` returned)."""
        self._work: dist.Work | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()

    def is_issued(self) -> bool:
        """Whether the check has ended (the data collective issued, or an error recorded)."""
        return self._ready.is_set()

    def issued_work(self) -> dist.Work | None:
        """The data collective's Work once issued (None before, or when the check stopped it)."""
        return self._work if self._ready.is_set() else None

    def wait_issued(self, timeout_s: float | None) -> dist.Work | None:
        """The data collective's Work once issued (None for a check only); raises what stopped it."""
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the collective signature check did not end after {timeout_s:g} s")
        if self._error is not None:
            raise self._error
        return self._work

    def _end(self, error: BaseException | None) -> None:
        if error is None and self._issue is not None:
            try:
                self._work = self._issue()
            except BaseException as e:  # recorded for the caller's thread, which raises it
                error = e
        self._error = error
        self._issue = None
        self._ready.set()


class _Check:
    """One signature check covering one collective, or several issued together (``checked_issue``)."""

    __slots__ = ("_tracker", "_items", "_sig", "_pair")

    def __init__(self, tracker: CollectiveTracker, items: list[PendingIssue]) -> None:
        self._tracker = tracker
        self._items = items
        sig = 0
        for item in items:  # order-sensitive fold: the same calls in another order differ
            sig = (sig * 1_000_003 + signature(item.rec.checked_op, item.rec.numel, item.rec.dtype)) & _SIG_MASK
        self._sig = sig
        self._pair: torch.Tensor | None = None

    def start(self, timeout: timedelta, *, wait_here: bool = False) -> None:
        tracker = self._tracker
        tracker.check_started()
        if wait_here:  # the caller's thread stands still from here (Note: [peer silence] in silence.py)
            tracker.begin_wait(self._items[0].rec)
        try:
            route = tracker.check_route(timeout)
            if isinstance(route, Board):  # Note: [signature board] in board.py
                route.submit(self, self._sig, timeout.total_seconds(), wait_here=wait_here)
                return
            opts = dist.AllreduceOptions()
            opts.reduceOp, opts.timeout = dist.ReduceOp.MAX, timeout
            self._pair = torch.tensor([self._sig, -self._sig], dtype=torch.int64)
            work = route.allreduce([self._pair], opts)
            if route is tracker.group:
                # No store for a side group: the check shares the data group, whose worker threads
                # would run a later check before this callback issues the data. Checked in line.
                work.wait()
        except Exception as e:
            self._end(e)
            return
        # Runs in the side group's worker thread when the check completes (in issue order: the
        # group has one worker), or here at once if it already has.
        work.get_future().then(self._on_checked)

    def _on_checked(self, fut: torch.futures.Future) -> None:
        """The side group's completion callback."""
        try:
            fut.value()  # raises the check's own failure (timeout, a peer gone)
            pair = self._pair
            verdict: bool | BaseException = pair is not None and int(pair[0]) == -int(pair[1])
        except BaseException as e:  # recorded for the caller's thread, which raises it
            verdict = e
        self.conclude(verdict)

    def conclude(self, verdict: bool | BaseException) -> None:
        """The check ended (every rank's signature agreed, or not, or it failed): issue the data
        if it agreed and no earlier check found a mismatch, else record why not."""
        tracker, first = self._tracker, self._items[0].rec
        error: BaseException | None = None
        try:
            earlier = tracker.mismatch
            if isinstance(verdict, BaseException):
                error = verdict
            elif earlier is not None:
                error = CollectiveMismatchError(
                    f"not issued: collective seq {earlier.seq} already differed across ranks")
            elif not verdict:
                tracker.note_mismatch(first)
                error = CollectiveMismatchError(mismatch_text(first.seq))
        except BaseException as e:
            error = e
        self._end(error)

    def _end(self, error: BaseException | None) -> None:
        try:
            for item in self._items:
                item._end(error)
        finally:
            self._tracker.check_ended()


_SIG_MASK = (1 << 62) - 1


def checked_issue(tracker: CollectiveTracker, items: list[PendingIssue], timeout: timedelta, *,
                  wait_here: bool = False) -> None:
    """Start one signature check of ``items`` (one collective, or several the caller issues
    together and waits after) and hand their issues to its completion; returns at once, or, with
    ``wait_here`` (the caller waits for the collective next) and the signature board, once the
    check is decided (Note: [signature board] in board.py).

    Every rank must call it for the same collectives, grouped the same way, in the same order
    (they are the group's collectives). See Note: [collective signature check].
    """
    _Check(tracker, items).start(timeout, wait_here=wait_here)


def wait_checked(tracker: CollectiveTracker, pending: PendingIssue, wait_s: float | None,
                 timeout_s: float) -> dist.Work | None:
    """Wait for ``pending``'s check (and hand-over); raise the divergence report as a CommError
    if it failed, differed across ranks, or an earlier collective already broke the group."""
    rec = pending.rec
    tracker.begin_wait(rec)
    try:
        return pending.wait_issued(wait_s)
    except Exception as e:
        if tracker.broken is not None:  # an earlier collective's report already told everything
            error = CommError(f"rank {tracker.rank}: {rec.op} (seq {rec.seq}) not issued, the "
                              f"process group is broken:\n{tracker.broken}")
        elif tracker.mismatch is not None:  # this collective's mismatch, or an earlier one's
            error = tracker.fail(tracker.mismatch, CollectiveMismatchError(mismatch_text(tracker.mismatch.seq)),
                                 timeout_s)
        else:
            error = tracker.fail(rec, e, timeout_s)
        tracker.end_wait(rec, done=False)
        if isinstance(e, CollectiveMismatchError):
            # The report names every rank's collective; the internal cause would only put a
            # second, vaguer "collective mismatch" traceback above it.
            raise error from None
        raise error from e
