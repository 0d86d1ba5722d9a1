"""Handle: an issued collective, waited with a timeout; the wait policy a Comm hands it.

Imports nothing of ours but ``errors`` and ``comm``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from time import perf_counter

import torch
import torch.distributed as dist

from zeroshard.comm.call_record import CallRecord
from zeroshard.comm.checked import PendingIssue, wait_checked
from zeroshard.comm.divergence import CollectiveTracker
from zeroshard.comm.log import CommLog
from zeroshard.errors import CommError


@dataclass(frozen=True, slots=True)
class WaitPolicy:
    """How a Comm's handles wait: one per Comm, shared by all its handles."""

    tracker: CollectiveTracker | None
    """The group's tracker; None without a process group (local collectives)."""
    timeout_s: float
    """The per-collective timeout, as given to the backend with each operation."""
    wait_timeout: timedelta | None
    """CPU backends: block in Work.wait at most this long. None for stream backends (NCCL),
    whose wait only orders the current stream; the backend's watchdog enforces the per-op
    timeout there and the tracker's thread reports a work still pending past it."""
    log: CommLog | None
    """Where to record (op, bytes, seconds, async) per call, or None."""
    sync_device: torch.device | None
    """An accelerator to synchronise before timing a logged call (time the transfer, not the
    enqueue); None on CPU."""
    group: str = "world"
    """The label the comm log gives this Comm's calls (CommRecord.group)."""


class Handle:
    """An issued collective. ``wait()`` blocks until its result is in the caller's tensors.

    Returned by every ``Comm`` collective; already complete unless ``async_op=True``.

    Raises (from ``wait``):
        CommError: the collective failed or exceeded the timeout; the message names every
            rank's last collective.
    """

    __slots__ = ("_policy", "_work", "_rec", "_finish", "_op", "_nbytes", "_t0", "_async",
                 "_done", "_error", "_pending")

    def __init__(self, policy: WaitPolicy, work: dist.Work | None, rec: CallRecord | None,
                 finish: Callable[[], None] | None, op: str, nbytes: int, t0: float,
                 async_op: bool, pending: PendingIssue | None = None) -> None:
        self._policy, self._work, self._rec, self._finish = policy, work, rec, finish
        self._pending = pending
        """Set while the collective waits for its signature check (comm/checked.py); the Work
        is taken from it at wait()."""
        self._op, self._nbytes, self._t0, self._async = op, nbytes, t0, async_op
        self._done = False
        self._error: CommError | None = None

    def is_completed(self) -> bool:
        """Whether ``wait()`` would return without blocking on communication."""
        if self._done:
            return True
        pending = self._pending
        if pending is not None:
            if not pending.is_issued():
                return False
            work = pending.issued_work()
            return work is None or bool(work.is_completed())  # None: wait() raises at once
        return self._work is None or bool(self._work.is_completed())

    def wait(self) -> None:
        """Block until the collective is done and its result written (idempotent)."""
        if self._done:
            return
        if self._error is not None:
            raise self._error
        policy = self._policy
        if self._pending is not None and self._rec is not None:
            tracker = policy.tracker
            if tracker is None:
                raise AssertionError("expected a tracker for a checked collective")
            wait_s = None if policy.wait_timeout is None else policy.wait_timeout.total_seconds()
            try:
                self._work = wait_checked(tracker, self._pending, wait_s, policy.timeout_s)
            except CommError as e:
                self._error = e
                raise
            self._pending = None
        if self._work is not None and self._rec is not None:
            self._wait_work(policy, self._work, self._rec)
        if self._finish is not None:
            self._finish()
        self._done = True
        if policy.log is not None:
            if policy.sync_device is not None:
                torch.accelerator.synchronize(policy.sync_device)
            policy.log.record(self._op, self._nbytes, perf_counter() - self._t0, self._async, policy.group)

    def _wait_work(self, policy: WaitPolicy, work: dist.Work, rec: CallRecord) -> None:
        tracker = policy.tracker
        if tracker is None:
            raise AssertionError("expected a tracker for a collective with a process group")
        tracker.begin_wait(rec)
        try:
            if policy.wait_timeout is None:
                ok = work.wait()
            else:
                ok = work.wait(policy.wait_timeout)
            if ok is False:
                raise TimeoutError(f"Work.wait returned False after {policy.timeout_s:g} s")
        except Exception as e:
            self._error = tracker.fail(rec, e, policy.timeout_s)
            tracker.end_wait(rec, done=False)
            raise self._error from e
        tracker.end_wait(rec, done=True)
