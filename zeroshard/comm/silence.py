"""Peer silence: a rank waiting in a collective names a peer that stopped answering, long before
the collective timeout. Imports nothing of ours.

Note: [peer silence]
A peer that crashes or exits is seen at once (its sockets close; on one host the signature board
sees its pid go). A peer whose process is stopped or hung outside Python (SIGSTOP, a frozen
node, a swap storm) or whose machine drops off the network closes nothing: its peers wait in
the collective until its timeout (30 minutes by default), and gloo's message then names no rank.
So each process's comm watcher thread (divergence.py) bumps a counter of its rank in the group's
c10d store every ``BEAT_S``. The thread needs the GIL only for a moment, so a rank busy in
training, in a long kernel or a slow save still beats; only a process that is not running, or
that cannot reach the store, falls silent. While this rank waits in a collective (longer than
one beat), the same thread reads every peer's counter every ``BEAT_S`` (less often in large
groups); a counter unchanged for ``ZEROSHARD_PEER_SILENCE_S`` seconds (default 60; 0: off)
makes this rank print the peers' names, hosts and pids and end, so the launcher (torchrun's
agent, `zeroshard launch --max-restarts`) restarts the job without them and auto-resume reloads
the last good checkpoint. Silence is measured on this host's clock from the first reading, so
clocks need not agree across hosts.

Note: [store silence] The counters live in the c10d store, so the host that runs it (the
launcher's rendezvous: torchrun's agent on the first node, usually beside rank 0) is the one
peer the counters cannot watch: when it stops or drops off the network, every rank's store
calls block (or fail), the watcher thread blocks with them, and the ranks would wait out the
collective timeout. So a second thread (``StoreWatch``), which never touches the store, checks
every ``BEAT_S`` when the watcher's store calls last answered; while this rank waits in a
collective, silence from the store for the same ``ZEROSHARD_PEER_SILENCE_S`` ends the rank with
the store's address. Such a job cannot restart by itself (torchrun's rendezvous lived on that
host): the message says to start it again, and auto-resume loads the last good checkpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

BEAT_S = 1.0
"""How often a rank bumps its counter, and (while waiting) reads its peers'."""


def beat_key(rank: int) -> str:
    return f"zeroshard.comm/beat/{rank}"


class SilenceWatch:
    """The peers' counters as this rank saw them while it waited: which stopped changing.

    Lives on the watcher thread only (no locking). ``read(rank)`` returns a peer's counter."""

    def __init__(self, rank: int, world_size: int, limit_s: float | None) -> None:
        self.rank, self.world_size, self.limit_s = rank, world_size, limit_s
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (counter, when it last changed)
        self._next_read = 0.0

    def poll(self, now: float, waiting_since: float | None, read: Callable[[int], int]) -> list[tuple[int, float]]:
        """The peers silent for at least the limit, with how long; [] while not waiting (the
        readings start afresh at the next wait) or when none is."""
        limit = self.limit_s
        if limit is None or self.world_size == 1 or waiting_since is None or now - waiting_since < BEAT_S:
            self._seen.clear()
            return []
        if now < self._next_read:
            return []
        self._next_read = now + max(BEAT_S, self.world_size / 200)  # ~200 reads/s per waiting rank at most
        silent = []
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            value = read(peer)
            seen = self._seen.get(peer)
            if seen is None or seen[0] != value:
                self._seen[peer] = (value, now)
            elif now - seen[1] >= limit:
                silent.append((peer, now - seen[1]))
        return silent


def silence_report(rank: int, waited_s: float, call: str, gone: list[tuple[int, float]],
                   states: Mapping[int, Mapping[str, Any]], limit: str) -> str:
    """The first line a rank prints before it ends for silent peers: how long it waited and in
    which collective (`call`), each silent peer with its host and pid, and what that means."""
    named = "; ".join(f"rank {peer} (host {states.get(peer, {}).get('host', '?')}, "
                      f"pid {states.get(peer, {}).get('pid', '?')}) silent for {quiet:.0f} s"
                      for peer, quiet in gone)
    return (f"rank {rank}: waited {waited_s:.0f} s{call}; {named} ({limit}): no heartbeat, so its process is "
            "stopped or hung outside Python, or its machine is off the network. This rank ends now (exit "
            "status 1) so the launcher can restart the job without it.")


class StoreWatch:
    """Ends this rank when the c10d store stops answering while it waits (Note: [store silence]);
    its thread starts at once.

    Args:
        limit_s: how long the store may be silent during a wait (the peer-silence limit).
        waiting_since: when this rank's current wait began, None when it waits for nothing.
        on_silent: called once, on this watch's thread, with (seconds waited, seconds silent,
            the limit); it is expected to end the process.
        stop: set when the tracker closes; the watch ends with it.
    """

    def __init__(self, limit_s: float, waiting_since: Callable[[], float | None],
                 on_silent: Callable[[float, float, float], None], stop: threading.Event) -> None:
        self.limit_s = limit_s
        self._waiting_since, self._on_silent, self._stop = waiting_since, on_silent, stop
        self._answered_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="zeroshard-store-watch", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait until `stop` is set, then for the thread (which wakes at once)."""
        self._stop.wait()
        self._thread.join()

    def answered(self) -> None:
        """The watcher's store calls of one round came back (called by the watcher thread)."""
        self._answered_at = time.monotonic()

    def silent_for(self, now: float) -> float | None:
        """How long the store has been silent during this rank's wait, once that reaches the
        limit; None before (or while this rank waits for nothing)."""
        since = self._waiting_since()
        quiet = now - self._answered_at
        if since is None or now - since < self.limit_s or quiet < self.limit_s:
            return None
        return quiet

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            now = time.monotonic()
            quiet = self.silent_for(now)
            if quiet is not None:
                self._on_silent(now - (self._waiting_since() or now), quiet, self.limit_s)
                return


def store_silence_report(rank: int, waited_s: float, call: str, quiet_s: float, store: Any, limit: str) -> str:
    """The first line a rank prints before it ends because the c10d store `store` fell silent."""
    base = store
    for _ in range(8):  # PrefixStores over the launcher's TCPStore
        base = getattr(base, "underlying_store", None) or base
    where = f"{getattr(base, 'host', '?')}:{getattr(base, 'port', '?')}"
    return (f"rank {rank}: waited {waited_s:.0f} s{call}; the c10d store at {where} has not answered for "
            f"{quiet_s:.0f} s ({limit}): the host that runs it (the launcher's rendezvous, usually the first "
            "node) is stopped or off the network, so no peer can be heard from. This rank ends now (exit status "
            "1). The job cannot restart by itself without that host: start it again, and auto-resume loads the "
            "last good checkpoint.")
