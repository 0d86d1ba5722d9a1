"""Exact resume across processes: K steps == J steps + save + fresh processes + load + K-J steps.

Two 2-rank torchrun jobs (scripts/ckpt_resume.py): one trains the references and saves, a new
one loads and continues; losses and parameters must be bitwise equal for stages 0, 1 and 2, in
fp32, bf16 and fp16, with and without CPU optimizer offload, with gradient accumulation, a
scheduler, dropout (random generator state) and the data loader from initialize().
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from torchrun_cmd import torchrun

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_resume.py"
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(SCRIPT.parent))


def run_job(nproc: int, *args: str, timeout: float = 300) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(torchrun(nproc, *args), cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc.stdout


def test_resume_in_fresh_processes_is_bitwise_exact(tmp_path: Path) -> None:
    from ckpt_resume import CONFIGS

    run_job(2, str(SCRIPT), "save", str(tmp_path))
    out = run_job(2, str(SCRIPT), "resume", str(tmp_path))
    for name in CONFIGS:
        for rank in (0, 1):
            assert f"RESUME OK {name} rank {rank}" in out, out[-4000:]
