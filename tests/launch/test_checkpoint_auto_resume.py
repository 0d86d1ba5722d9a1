"""A job that loses a rank after a save resumes by itself at world size 1 (issue 42, items 1-2).

A 2-rank job (scripts/ckpt_auto_resume.py) with `checkpoint.auto_resume_dir` saves at steps 2 and
4, and rank 1 is SIGKILLed in step 5. A new job at world size 1 with the same config resumes from
step 4 on its own, keeping the global batch (gradient accumulation 1 -> 2), and its per-step losses
equal an uninterrupted world-1 run from the same checkpoint (fp32, 1e-6 relative), and those of the
2-rank run that was never killed (the same samples per step; 1e-5 relative: another reduction order).
ZeRO 2 and 3. tests/run.py's launch stage runs every file here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun_cmd import torchrun

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_auto_resume.py"
ROOT = Path(__file__).resolve().parents[2]


def run_job(nproc: int, *args: str, env: dict[str, str] | None = None,
            expect_ok: bool = True, timeout: float = 300) -> str:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full.pop(key, None)
    proc = subprocess.run(torchrun(nproc, str(SCRIPT), *args), cwd=ROOT, env=full, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    if (proc.returncode == 0) != expect_ok:
        raise AssertionError(f"torchrun {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc.stdout


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_killed_job_resumes_at_world_one_with_the_same_global_batch(tmp_path: Path, stage: int) -> None:
    run_job(2, "train", str(tmp_path / "full"), str(stage), env={"ZS_NO_KILL": "1"})
    killed = run_job(2, "train", str(tmp_path), str(stage), expect_ok=False)
    assert "SIGKILL" in killed or "Signal 9" in killed, killed[-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.is_dir()) == ["global_step2", "global_step4"]
    resumed = run_job(1, "resume", str(tmp_path), str(stage))
    assert "START resume rank 0/1 step 4 gas 2" in resumed, resumed[-3000:]
    assert "gradient_accumulation_steps 1 -> 2 at data-parallel size 1 (train_batch_size 2 -> 4)" in resumed
    shutil.rmtree(tmp_path / "ckpt" / "global_step2")  # the reference must read the same tag
    run_job(1, "reference", str(tmp_path), str(stage))
    got = torch.load(tmp_path / "resume.pt", weights_only=True)
    want = torch.load(tmp_path / "reference.pt", weights_only=True)
    full = [loss for step, loss in torch.load(tmp_path / "full" / "uninterrupted.pt", weights_only=True) if step > 4]
    assert [s for s, _ in got] == [s for s, _ in want] == [5, 6, 7, 8]
    g, w, f = (torch.tensor([x[1] if isinstance(x, tuple) else x for x in v], dtype=torch.float64)
               for v in (got, want, full))
    torch.testing.assert_close(g, w, rtol=1e-6, atol=0)
    torch.testing.assert_close(g, f, rtol=1e-5, atol=0)
    print(f"zero{stage}: resumed {g.tolist()}, reference {w.tolist()}, uninterrupted world 2 {f.tolist()}",
          file=sys.stderr)
