"""Peer silence (Note: [peer silence] in comm/silence.py): which peers a waiting rank names, and
when; the launch test (tests/launch/test_comm_divergence.py, "stop") stops a real peer, and
("storestop") the host of the store (Note: [store silence])."""

from __future__ import annotations

import threading
import time

import pytest

from zeroshard.comm.env import resolve_peer_silence_s
from zeroshard.comm.silence import BEAT_S, SilenceWatch, StoreWatch, store_silence_report
from zeroshard.errors import CommError


def test_silence_limit_comes_from_the_environment() -> None:
    assert resolve_peer_silence_s({}) == 60.0
    assert resolve_peer_silence_s({"ZEROSHARD_PEER_SILENCE_S": "7.5"}) == 7.5
    assert resolve_peer_silence_s({"ZEROSHARD_PEER_SILENCE_S": "0"}) is None  # off
    for bad in ("soon", "-1", "inf"):
        with pytest.raises(CommError, match="ZEROSHARD_PEER_SILENCE_S"):
            resolve_peer_silence_s({"ZEROSHARD_PEER_SILENCE_S": bad})


def _run(watch: SilenceWatch, beats: dict[int, list[int]], seconds: int, waiting_since: float | None = 0.0
         ) -> list[list[tuple[int, float]]]:
    """Poll once a second for `seconds`; peer r's counter at second t is beats[r][t]."""
    return [watch.poll(float(t), waiting_since, lambda peer, t=t: beats[peer][t]) for t in range(seconds)]


def test_only_the_peer_whose_counter_stopped_is_named_after_the_limit() -> None:
    watch = SilenceWatch(rank=0, world_size=3, limit_s=4.0)
    beats = {1: list(range(10)), 2: [1, 2, 3] + [3] * 7}  # rank 2 stops after its third beat
    found = _run(watch, beats, 10)
    assert found[:6] == [[]] * 6  # unchanged since t=2: silent 4 s at t=6
    assert [[(p, round(s)) for p, s in f] for f in found[6:]] == [[(2, 4)], [(2, 5)], [(2, 6)], [(2, 7)]]


def test_no_reading_while_not_waiting_and_a_fresh_start_at_each_wait() -> None:
    watch = SilenceWatch(rank=1, world_size=2, limit_s=2.0)
    reads: list[int] = []

    def read(peer: int) -> int:
        reads.append(peer)
        return 5  # never changes

    assert watch.poll(10.0, None, read) == [] and reads == []  # not waiting
    assert watch.poll(10.0, 9.5, read) == [] and reads == []  # waiting less than a beat
    assert watch.poll(11.0, 9.5, read) == [] and reads == [0]  # first reading
    assert watch.poll(13.0, 9.5, read) == [(0, 2.0)]
    assert watch.poll(14.0, None, read) == []  # the wait ended: readings dropped
    assert watch.poll(16.0, 14.0, read) == []  # a new wait: silence counted afresh
    assert watch.poll(18.0, 14.0, read) == [(0, 2.0)]


def test_off_or_alone_reads_nothing() -> None:
    for watch in (SilenceWatch(0, 4, None), SilenceWatch(0, 1, 5.0)):
        assert watch.poll(100.0, 0.0, lambda peer: pytest.fail("read")) == []


def test_large_groups_read_less_often() -> None:
    watch = SilenceWatch(rank=0, world_size=1000, limit_s=30.0)
    reads = []
    for t in range(20):
        watch.poll(float(t) + BEAT_S, 0.0, lambda peer: reads.append(peer) or 0)
    assert len(reads) == 999 * 4  # every 5 s (1000 / 200) over 20 s, not every second


def test_a_silent_store_counts_only_while_this_rank_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("zeroshard.comm.silence.time.monotonic", lambda: clock[0])
    waiting: list[float | None] = [None]
    stopped = threading.Event()
    stopped.set()  # its thread ends at once: the readings below are the test's
    ended: list[tuple[float, float, float]] = []
    watch = StoreWatch(5.0, lambda: waiting[0], lambda *how: ended.append(how), stopped)
    watch.join()
    clock[0] = 120.0  # the store silent for 20 s, but this rank waits for nothing: no hang to end
    assert watch.silent_for(clock[0]) is None
    waiting[0] = 117.0  # a wait of 3 s: under the limit
    assert watch.silent_for(clock[0]) is None
    clock[0] = 122.0
    assert watch.silent_for(clock[0]) == 22.0
    watch.answered()  # the store answered again: silence counts from here
    clock[0] = 126.0
    assert watch.silent_for(clock[0]) is None
    clock[0] = 127.0
    assert watch.silent_for(clock[0]) == 5.0
    assert ended == []


def test_the_store_watch_ends_the_rank_once_from_its_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("zeroshard.comm.silence.BEAT_S", 0.01)
    start = time.monotonic()
    ended: list[tuple[float, float, float]] = []
    stop = threading.Event()
    watch = StoreWatch(0.05, lambda: start, lambda *how: ended.append(how), stop)  # waiting, never answered
    deadline = time.monotonic() + 10
    while not ended and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    watch.join()
    assert len(ended) == 1 and ended[0][1] >= 0.05 and ended[0][2] == 0.05, ended


def test_the_silent_store_is_named_by_its_address() -> None:
    class TCP:
        host, port = "node0", 29500

    class Prefix:
        underlying_store = TCP()

    line = store_silence_report(1, 64.0, " in all_reduce (seq 7) at train.py:10", 61.0, Prefix(),
                                "ZEROSHARD_PEER_SILENCE_S=60")
    assert line.startswith("rank 1: waited 64 s in all_reduce (seq 7) at train.py:10; the c10d store at "
                           "node0:29500 has not answered for 61 s (ZEROSHARD_PEER_SILENCE_S=60)"), line
    assert "start it again" in line
