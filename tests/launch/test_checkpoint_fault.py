"""A save killed anywhere leaves the previous checkpoint loadable, and training resumes from it.

- scripts/ckpt_fault.py (one process, world size 1): a forked child is SIGKILLed at every
  protocol step of save_checkpoint (each open, fsync, rename, mkdir, remove: 21 of them) and at
  20 random data writes (files cut mid-way); then again at every protocol step while re-saving
  the very tag `latest` names. Each time a fresh engine loads `latest` and checks the weights,
  and resuming reproduces the next step bit for bit.
- scripts/ckpt_kill_rank.py (2 ranks): rank 1 is SIGKILLed while writing its optimizer file;
  torchrun ends the job; a new 2-rank job loads `latest` and resumes exactly.
- The same two with `checkpoint.async_save`: the kill lands in the snapshot's preparation, in the
  background writer while the next step trains, or in the join's publish; `latest` still loads
  the previous checkpoint (or the new one, holding the state at the save, never a later step).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_cmd import torchrun

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parents[2]
RANDOM_WRITES = 20


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ZEROSHARD_CHECKPOINT_FAULT_AT"):
        env.pop(key, None)
    return env


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, env=_env(), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_at_many_points_during_save(tmp_path: Path, mode: str) -> None:
    proc = _run([sys.executable, str(SCRIPTS / "ckpt_fault.py"), str(tmp_path), str(RANDOM_WRITES), "1234",
                 *(["async"] if mode == "async" else [])])
    assert proc.returncode == 0, proc.stdout[-6000:]
    m = re.search(r"FAULT OK (\d+) kill points \((\d+) protocol steps, (\d+) random writes\)", proc.stdout)
    assert m, proc.stdout[-4000:]
    total, steps, writes = map(int, m.groups())
    assert total >= 20 + steps and writes == RANDOM_WRITES and steps >= 15, m.group(0)
    m2 = re.search(r"RESAVE OK (\d+) kill points", proc.stdout)
    assert m2 and int(m2.group(1)) >= 15, proc.stdout[-4000:]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_one_rank_of_two_during_save(tmp_path: Path, mode: str) -> None:
    script = str(SCRIPTS / "ckpt_kill_rank.py")
    killed = _run(torchrun(2, script, "save", str(tmp_path), "10", "1", *(["async"] if mode == "async" else [])))
    assert killed.returncode != 0 and "SAVE COMPLETED" not in killed.stdout, killed.stdout[-4000:]
    assert "Signal 9 (SIGKILL)" in killed.stdout or "SIGKILL" in killed.stdout, killed.stdout[-4000:]
    resumed = _run(torchrun(2, script, "resume", str(tmp_path)))
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    assert "KILL RESUME OK rank 0" in resumed.stdout and "KILL RESUME OK rank 1" in resumed.stdout
