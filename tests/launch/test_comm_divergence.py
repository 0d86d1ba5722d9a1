"""A rank that skips a collective makes its peer fail fast, naming both ranks' last collectives.

Each case runs its own 2-process torchrun job (scripts/comm_diverge.py) with a 3 s collective
timeout: a divergent job breaks its process group, so it cannot share the group of tests/dist.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from torchrun_cmd import collect_jobs, torchrun

SCRIPT = Path(__file__).parent / "scripts" / "comm_diverge.py"
ROOT = Path(__file__).resolve().parents[2]


MODES = ("skip", "exit", "mismatch")
KILL_AFTER_S = 300
"""A hung job (the default timeout is 30 minutes) is killed here; start-up of five concurrent
torchrun jobs on a loaded 2-core machine has taken over 60 s, so the wall time of a job is not
what "fails fast" is measured by: the CommError's own "failed after X s" is (see fails_fast)."""


def fails_fast(output: str) -> bool:
    """Every CommError in the output came within a few seconds of its collective (timeout 3 s)."""
    waited = [float(x) for x in re.findall(r"failed after ([0-9.]+) s \(timeout 3 s\)", output)]
    return bool(waited) and max(waited) < 30
MISMATCH_MODES = ("size", "extra", "async", "together")
DSCOMM_MODES = ("dscomm",)
SIDE_MODES = ("skip", "async", "stop")
"""Run again with the checks on the side gloo group (ZEROSHARD_COMM_CHECK_BOARD=0: ranks on
several hosts), the route that is not the default here: a rank that never comes (the timeout
report) and mismatched asynchronous collectives (the side group's completion callback). Two
jobs, not all: each batch of jobs costs the CI about a minute of start-up on 2 cores."""


def _run_jobs(modes: tuple[str, ...], extra_env: dict[str, str]) -> dict[str, tuple[int, str, float]]:
    """Run the jobs at once (their timeouts overlap): mode -> (exit code, output, s)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra_env}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    start = time.monotonic()
    # "kill": torchrun must not end rank 0 as soon as rank 1 died; rank 0 has to notice itself.
    procs = {mode: subprocess.Popen(
        torchrun(2, *(["--monitor-interval=60"] if mode == "kill" else []), str(SCRIPT), mode),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        for mode in modes}
    return collect_jobs(procs, KILL_AFTER_S, start)


@pytest.fixture(scope="module")
def jobs() -> dict[str, tuple[int, str, float]]:
    results = _run_jobs(MODES + MISMATCH_MODES + DSCOMM_MODES + ("kill", "stop", "storestop"), {})
    for _, output, _ in results.values():
        assert "rank 0: check route board" in output and "rank 1: check route board" in output, output
        assert "rank 0: data arena on" in output, output
    return results


@pytest.fixture(scope="module")
def side_jobs() -> dict[str, tuple[int, str, float]]:
    results = _run_jobs(SIDE_MODES, {"ZEROSHARD_COMM_CHECK_BOARD": "0"})
    for _, output, _ in results.values():
        assert "rank 0: check route side group" in output, output
        # each switch turns off only its own use of the shared mapping: the data still goes through it
        assert "rank 0: data arena on" in output and "rank 1: data arena on" in output, output
    return {f"{mode}@side": result for mode, result in results.items()}


def _job(request: pytest.FixtureRequest, mode: str, route: str) -> tuple[int, str, float]:
    """One job's outcome: the default route (the board), or the side group's run of it."""
    if route == "board":
        return request.getfixturevalue("jobs")[mode]
    return request.getfixturevalue("side_jobs")[f"{mode}@side"]


def _cases(modes: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(m, "board") for m in modes] + [(m, "side") for m in modes if m in SIDE_MODES]


def line_of(marker: str) -> int:
    """Line number of the script line containing ``marker``."""
    for number, line in enumerate(SCRIPT.read_text().splitlines(), start=1):
        if marker in line:
            return number
    raise AssertionError(f"expected {marker!r} in {SCRIPT}")


@pytest.mark.parametrize("mode, route", _cases(MODES))
def test_divergent_rank_fails_fast_with_both_ranks_named(request: pytest.FixtureRequest, mode: str,
                                                         route: str) -> None:
    code, output, elapsed = _job(request, mode, route)
    assert code != 0, output
    assert elapsed < KILL_AFTER_S and fails_fast(output), f"took {elapsed:.0f} s\n{output}"
    all_reduce_at = f"comm_diverge.py:{line_of('seq 2: rank 1 never joins')}"
    assert f"CommError: rank 0: all_reduce (seq 2) at {all_reduce_at} failed" in output, output
    barrier_at = f"comm_diverge.py:{line_of('seq 1 on both ranks')}"
    assert re.search(rf"rank 0: seq 2 all_reduce\(numel=4, float32\) at {all_reduce_at}"
                     r" — waiting \d", output), output
    if mode == "skip":
        assert (f"rank 1: seq 1 barrier at {barrier_at} — not in a collective "
                "(never reached seq 2)") in output, output
        assert "Timed out" in output, output
    elif mode == "exit":
        assert f"rank 1: exited after seq 1 barrier at {barrier_at}" in output, output
    if mode in ("skip", "exit"):
        assert "Ranks [1] never reached seq 2." in output, output
    else:  # both ranks time out, and each names the other's collective
        broadcast_at = f"comm_diverge.py:{line_of('not what rank 0 issued')}"
        assert f"CommError: rank 1: broadcast (seq 2) at {broadcast_at} failed" in output, output
        assert (f"rank 1: seq 2 broadcast(numel=8, float32) at {broadcast_at} — waiting"
                in output), output
        assert ("Ranks disagree on seq 2: ranks [0] all_reduce(numel=4, float32); ranks [1] "
                "broadcast(numel=8, float32).") in output, output
    assert "the all_reduce completed" not in output


@pytest.mark.parametrize("mode, route", _cases(MISMATCH_MODES))
def test_collective_mismatch_is_reported_by_every_rank(request: pytest.FixtureRequest, mode: str,
                                                       route: str) -> None:
    # gloo alone: "terminate called after throwing gloo::EnforceNotMet ... Is there a
    # distributed collective mismatch in your code?" and SIGABRT on one rank, nothing else.
    # With the signature check (Note: [collective signature check] in comm/collectives.py)
    # each rank raises a CommError naming the first differing collective of every rank.
    code, output, elapsed = _job(request, mode, route)
    assert code != 0 and elapsed < KILL_AFTER_S and fails_fast(output), output
    assert "terminate called" not in output and "SIGABRT" not in output, output
    for rank in (0, 1):
        assert re.search(rf"CommError: rank {rank}: \w+ \(seq 2\) at comm_diverge\.py:\d+ failed after [0-9.]+ s "
                         r"\(timeout 3 s\): collective mismatch", output), output
    if mode == "size":
        at = f"comm_diverge.py:{line_of('seq 2: sizes differ')}"
        assert f"rank 0: seq 2 all_reduce(numel=4, float32) at {at}" in output, output
        assert f"rank 1: seq 2 all_reduce(numel=1000, float32) at {at}" in output, output
    elif mode == "extra":
        gather_at = f"comm_diverge.py:{line_of('seq 2: rank 0 only')}"
        reduce_at = f"comm_diverge.py:{line_of('seq 2 on rank 1, seq 3 on rank 0')}"
        assert f"rank 0: seq 2 all_gather(numel=3, float32) at {gather_at}" in output, output
        assert f"rank 1: seq 2 all_reduce(numel=100, float32) at {reduce_at}" in output, output
    elif mode == "together":  # one check for the burst: no data of it moved on either rank
        assert "a mismatched burst completed" not in output, output
        assert "Ranks [1] never reached seq 3." in output, output
        return
    else:  # async: the verdict names seq 2 although later collectives were issued before any wait
        assert "Ranks disagree on seq 2: ranks [0] all_gather(numel=3, float32); ranks [1] " \
            "all_reduce(numel=100, float32)." in output, output
        assert "asynchronous collectives completed" not in output, output
    assert "Ranks disagree on seq 2" in output, output


def test_extra_collective_through_deepspeed_comm_is_reported_by_every_rank(
        jobs: dict[str, tuple[int, str, float]]) -> None:
    # An extra deepspeed.comm collective on one rank (issue 24 item 4): it met the other rank's
    # next collective in gloo, which said "op.preamble.length <= op.nbytes" (or aborted). It is now
    # sequenced and signature-checked like zeroshard's own: both ranks raise zeroshard's report.
    code, output, elapsed = jobs["dscomm"]
    assert code != 0 and elapsed < KILL_AFTER_S and fails_fast(output), output
    assert "terminate called" not in output and "preamble" not in output, output
    for rank in (0, 1):
        # rank 0's check ran in deepspeed.comm, under the group's timeout (60 s), not the Comm's 3 s
        assert re.search(rf"CommError: rank {rank}: (deepspeed\.comm\.)?all_reduce \(seq 2\) at comm_diverge\.py:\d+ "
                         r"failed after [0-9.]+ s \(timeout [0-9.]+ s\): collective mismatch", output), output
    extra_at = f"comm_diverge.py:{line_of('seq 2: rank 0 only, through deepspeed.comm')}"
    both_at = f"comm_diverge.py:{line_of('seq 2 on rank 1 (dscomm)')}"
    assert f"rank 0: seq 2 deepspeed.comm.all_reduce(numel=1, float32) at {extra_at}" in output, output
    assert f"rank 1: seq 2 all_reduce(numel=100, float32) at {both_at}" in output, output
    assert "Ranks disagree on seq 2" in output, output


def test_killed_peer_is_named_within_seconds(jobs: dict[str, tuple[int, str, float]]) -> None:
    # Note: [signature board]: a peer SIGKILLed (no exit hook, no final state) while rank 0 waits
    # in a collective's check is seen by its pid and start time, not after the 60 s timeout.
    code, output, elapsed = jobs["kill"]
    assert code != 0 and elapsed < KILL_AFTER_S, output
    found = re.search(r"CommError: rank 0: all_reduce \(seq 2\) at \S+ failed after ([0-9.]+) s \(timeout 60 s\): "
                      r"rank 1 \(pid \d+\) exited before collective check 2", output)
    assert found and float(found.group(1)) < 10, output
    assert "the all_reduce completed" not in output


@pytest.mark.parametrize("route", ["board", "side"])
def test_stopped_peer_is_named_long_before_the_timeout(request: pytest.FixtureRequest, route: str) -> None:
    # Note: [peer silence]: a SIGSTOPped peer keeps its pid and sockets, so neither the board's
    # liveness check nor gloo sees it; without its heartbeat rank 0 would wait the whole 60 s.
    code, output, _ = _job(request, "stop", route)
    assert code != 0, output
    found = re.search(r"CommError: rank 0: waited ([0-9]+) s in all_reduce \(seq 2\) at \S+; rank 1 \(host \S+, "
                      r"pid \d+\) silent for ([0-9]+) s \(ZEROSHARD_PEER_SILENCE_S=3\)", output)
    assert found, output
    assert 3 <= int(found.group(2)) < 20 and int(found.group(1)) < 30, found.group(0)
    assert "Last collective of each rank" in output and "the all_reduce completed" not in output, output


def test_silent_store_is_named_long_before_the_timeout(jobs: dict[str, tuple[int, str, float]]) -> None:
    # Note: [store silence]: with the store's host stopped, rank 1's watcher blocks in a store call
    # and no peer's heartbeat can be read; the store watch names the store instead of waiting 60 s.
    code, output, _ = jobs["storestop"]
    assert "rank 1: agent store True" in output, output  # the stopped agent is the store rank 1 uses
    assert code != 0, output
    found = re.search(r"CommError: rank 1: waited ([0-9]+) s in all_reduce \(seq 2\) at \S+; the c10d store at "
                      r"\S+:\d+ has not answered for ([0-9]+) s \(ZEROSHARD_PEER_SILENCE_S=3\)", output)
    assert found, output
    assert 3 <= int(found.group(2)) < 20 and int(found.group(1)) < 30, found.group(0)
    assert "rank 1: seq 2 all_reduce(numel=4, float32)" in output, output  # its own last collective
    assert "the all_reduce completed" not in output and "CommError: rank 0" not in output, output
