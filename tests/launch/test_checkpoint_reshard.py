"""Reshard on load: a checkpoint saved by 2 ranks (stages 1 and 2) loads at 1 and 3 ranks, into
the same and another stage, and the next 10 steps match an uninterrupted run at that world size within
fp32 round-off (scripts/ckpt_reshard.py). The world-1 and world-3 jobs run concurrently."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from torchrun_cmd import python_or_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_reshard.py"
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _start(nproc: int, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(python_or_torchrun(nproc, str(SCRIPT), *args), cwd=ROOT, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen[str], what: str) -> str:
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    if proc.returncode != 0:
        raise AssertionError(f"{what} exited {proc.returncode}:\n{out[-6000:]}")
    return out


def test_save_at_2_load_at_1_and_3(tmp_path: Path) -> None:
    _finish(_start(2, "save", str(tmp_path)), "save at world 2")
    jobs = {world: _start(world, "check", str(tmp_path)) for world in (1, 3)}
    for world, proc in jobs.items():
        out = _finish(proc, f"load at world {world}")
        for saved, stage in [(1, 1), (1, 0), (2, 2), (2, 1)]:
            for rank in range(world):
                pattern = (rf"RESHARD OK world {world} rank {rank}: saved stage {saved} at world 2, "
                           rf"loaded stage {stage}: 10 steps")
                assert re.search(pattern, out), out[-4000:]
