"""A collective the script issues itself with torch.distributed, on one rank only, between
zeroshard's steps, is reported by every rank within the timeout (issue 42 item 5; Note: [script
collectives] in comm/user_collectives.py).

Before: no exit within 2 minutes at the default timeout; with a 30 s timeout, gloo's "Timed out
waiting 30000ms for recv operation to complete" on rank 0 (no rank, no call site) after 30 s, and
rank 1 blaming rank 0 for never reaching its next collective. Each case is its own 2-process
torchrun job (scripts/user_collective.py), all started at once.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from torchrun_cmd import collect_jobs, torchrun

SCRIPT = Path(__file__).parent / "scripts" / "user_collective.py"
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 20
"""zeroshard's collective timeout in these jobs (ZEROSHARD_COMM_TIMEOUT_S)."""
KILL_AFTER_S = 240
"""A job still running then is killed (a hang). Start-up of three 2-rank jobs at once on a
loaded 2-core machine takes 15-60 s, so the bound on the reports is their own "failed after"."""
WALL_BOUND_S = 180
"""Start to exit of a failing job, start-up included (measured 17-22 s alone at 2 ranks)."""
MODES = ("extra", "same-size", "both")


def line_of(marker: str) -> int:
    """Line number of the script line containing ``marker``."""
    for number, line in enumerate(SCRIPT.read_text().splitlines(), start=1):
        if marker in line:
            return number
    raise AssertionError(f"expected {marker!r} in {SCRIPT}")


@pytest.fixture(scope="module")
def jobs() -> dict[str, tuple[int, str, float]]:
    """mode -> (exit code, output, seconds from start to exit)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "ZEROSHARD_COMM_TIMEOUT_S": str(TIMEOUT_S)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ZEROSHARD_COMM_VERIFY"):
        env.pop(key, None)
    # "same-size" keeps the data on gloo (no shared-memory arena): gloo alone would pair rank 0's
    # all_reduce with rank 1's bucket all-reduce of the same size and dtype, and train on.
    extra = {"same-size": {"ZEROSHARD_COMM_SHM": "0"}}
    start = time.monotonic()
    procs = {mode: subprocess.Popen(torchrun(2, str(SCRIPT), mode), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env={**env, **extra.get(mode, {})},
                                    cwd=ROOT)
             for mode in MODES}
    return collect_jobs(procs, KILL_AFTER_S, start)


@pytest.mark.parametrize("mode", ["extra", "same-size"])
def test_collective_on_one_rank_is_named_by_every_rank(jobs: dict[str, tuple[int, str, float]],
                                                      mode: str) -> None:
    code, output, elapsed = jobs[mode]
    assert code != 0 and elapsed < WALL_BOUND_S, f"exit {code} after {elapsed:.0f} s\n{output}"
    assert "returned" not in output, output  # no data of it moved on rank 0
    assert "rank 1: done" not in output, output  # rank 1 did not train on
    extra_at = f"user_collective.py:{line_of('rank 0 only, 1 element' if mode == 'extra' else 'rank 0 only, the size')}"
    numel = "1" if mode == "extra" else "161"
    ours = "reduce_scatter(numel=192" if mode == "extra" else "all_reduce(numel=161"
    for rank in (0, 1):
        # Each rank's error, its first line: the rank that issued the script's collective, which one,
        # where, and what the other rank issued instead (zeroshard's own, with its call site).
        found = re.search(rf"CommError: rank {rank}: \S+ \(seq (\d+)\) at \S+(?: via \S+)? failed after ([0-9.]+) s "
                          rf"\(timeout {TIMEOUT_S} s\): collective mismatch at seq \1, found before any data "
                          rf"moved: rank 0 issued torch\.distributed\.all_reduce\(numel={numel}, float32\) "
                          rf"at {re.escape(extra_at)}; rank 1 issued zeroshard's {re.escape(ours)}, float32\) "
                          r"at \w+\.py:\d+ via user_collective\.py:\d+\n", output)
        assert found, output
        assert float(found.group(2)) < TIMEOUT_S, output
        # torchrun's summary: every rank ended non-zero (1 by the error; SIGTERM when torchrun
        # stopped it after the other's exit, while its own report was already out)
        status = re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)\s*exitcode\s*: (-?\d+)", output)
        assert status and int(status.group(1)) != 0, output
    assert "CommError: rank 0: torch.distributed.all_reduce (seq" in output, output
    assert "terminate called" not in output and "Timed out waiting" not in output, output


def test_same_collectives_on_every_rank_train_on(jobs: dict[str, tuple[int, str, float]]) -> None:
    code, output, elapsed = jobs["both"]
    assert code == 0, output
    for rank in (0, 1):
        assert (f"rank {rank}: all_reduce [3.0, 3.0, 3.0] broadcast [1.0, 1.0] objects "
                "[{'rank': 0}, {'rank': 1}]") in output, output
        assert f"rank {rank}: done" in output, output
    assert "CommError" not in output, output
