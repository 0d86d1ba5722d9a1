"""A pipeline stage whose process exits mid-batch is named on every other rank, within seconds.

Each world size runs its own torchrun job (scripts/pipe_dead_stage.py): a rank that exits ends
its process group, so it cannot share tests/dist's. The two jobs run at once.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from torchrun_cmd import torchrun

SCRIPT = Path(__file__).parent / "scripts" / "pipe_dead_stage.py"
ROOT = Path(__file__).resolve().parents[2]
KILL_AFTER_S = 300
"""A hung job (the collective timeout is 60 s) is killed here; start-up on a loaded machine is slow,
so how fast a rank noticed is its own report's "after X s", not the job's wall time."""


@pytest.fixture(scope="module")
def jobs() -> dict[int, tuple[int, str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    procs = {n: subprocess.Popen(torchrun(n, str(SCRIPT)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=env, cwd=ROOT) for n in (2, 4)}
    start, out = time.monotonic(), {}
    for n, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=max(1.0, KILL_AFTER_S - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            text = proc.communicate()[0] + f"\n[test] killed after {KILL_AFTER_S} s"
        out[n] = (proc.returncode, text)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_surviving_rank_names_the_dead_stage(jobs: dict[int, tuple[int, str]], world: int) -> None:
    code, output = jobs[world]
    dead = world - 1
    assert f"REPORT rank {dead}: exiting inside stage 1's forward" in output, output
    reports = dict(re.findall(r"REPORT rank (\d+) after ([0-9.]+) s: ", output))
    assert sorted(map(int, reports)) == list(range(world - 1)), output
    assert max(float(s) for s in reports.values()) < 30, output  # seconds, not the 60 s timeout
    for r in range(world - 1):
        line = next(x for x in output.splitlines() if x.startswith(f"REPORT rank {r} after"))
        assert "PipelineError" not in line and "pipeline train_batch failed on rank" in line, line
        assert f"stage 1 (rank {dead}) exited" in line, line
    assert code == 0, output
