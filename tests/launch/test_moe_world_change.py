"""An MoE checkpoint resumes at another world size and expert-parallel size (issue 40 item 5):
saved by 2 ranks at ep_size 2 and ZeRO 2, loaded by 1 rank at ep_size 1 and ZeRO 1 with optimizer
state; the continued step's loss and the weights after it equal the uninterrupted 2-rank run
(scripts/moe_world_change.py, the model, data and oracle of tests/dist/test_moe.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from torchrun_cmd import job_env, python_or_torchrun

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "moe_world_change.py"


def _run(nproc: int, *args: str) -> str:
    proc = subprocess.run(python_or_torchrun(nproc, str(SCRIPT), *args, rank0_output=True), cwd=ROOT, env=job_env(ROOT),
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600, check=False)
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-5000:]}"
    return proc.stdout


def test_moe_checkpoint_resumes_at_one_rank_and_ep_1(tmp_path: Path) -> None:
    assert "MOE WORLD SAVED" in _run(2, "save", str(tmp_path))
    out = _run(1, "load", str(tmp_path))
    assert "MOE WORLD OK 2 ranks ep 2 ZeRO-2 -> 1 rank ep 1 ZeRO-1" in out, out[-3000:]
