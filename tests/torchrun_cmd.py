"""The torchrun command line every test uses to start a job: one place to change it.

The test directories import it by module name: pytest puts ``tests/`` on ``sys.path`` (the
directory of the top ``conftest.py``), and ``tests/run.py`` runs from ``tests/``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def torchrun(nproc: int, *args: str, rank0_output: bool = False) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=N ARGS``: one node, a
    rendezvous on a free port, `nproc` ranks running ``ARGS`` (a script or ``-m module``).

    Args:
        rank0_output: print rank 0's output only (``--local-ranks-filter=0``); the other ranks
            still run, and a failure on any of them still fails the job.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if rank0_output:
        cmd.append("--local-ranks-filter=0")
    return [*cmd, *args]


def python_or_torchrun(nproc: int, *args: str, rank0_output: bool = False) -> list[str]:
    """A plain ``python ARGS`` for one process (no process group), else :func:`torchrun`."""
    return [sys.executable, *args] if nproc == 1 else torchrun(nproc, *args, rank0_output=rank0_output)


def job_env(root: Path, *, deepspeed: bool = False) -> dict[str, str]:
    """The environment of a test's job: this checkout first on ``PYTHONPATH``, one thread per
    rank, none of a surrounding torchrun's variables; with `deepspeed`, DeepSpeed on its CPU
    accelerator, JIT-building its ops into the checkout's git-ignored ``.ds_build/`` by default."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    if deepspeed:
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("TORCH_EXTENSIONS_DIR", str(root / ".ds_build"))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def collect_jobs(procs: dict[str, subprocess.Popen[str]], kill_after_s: float,
                 start: float) -> dict[str, tuple[int, str, float]]:
    """Wait for jobs started together at `start` (time.monotonic()) under one deadline, killing
    any still running `kill_after_s` after it: name -> (exit code, output, seconds since `start`)."""
    results = {}
    for name, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=max(1.0, kill_after_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            output += f"\n[test] killed after {kill_after_s} s"
        results[name] = (proc.returncode, output, time.monotonic() - start)
    return results
