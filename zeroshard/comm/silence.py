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
clocks need not agree across hosts. Not covered: the host of the store itself dropping off the
network (every rank's store calls then fail or block; the collective timeout still ends them).
"""

from __future__ import annotations

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
