"""A preempted job saves an emergency checkpoint, exits 75, and resumes exactly (issue 42 item 4).

`zeroshard launch` starts 2 ranks of scripts/preempt_train.py (tiny GPT, `checkpoint.auto_resume_dir`,
so `checkpoint.preemption_save` acts by default). Mid-run the test sends
- ZeRO 2: SIGTERM to the launcher, as a scheduler does (forwarded through torchrun to every rank);
- ZeRO 3: SIGUSR1 to rank 1 only, as SLURM's `--signal=USR1@T` may (rank 0 learns it from the
  per-step agreement).
The job must exit 75 with the launcher's summary, rank 0 must log the save's seconds (under the
25 s grace), and the checkpoint `latest` names must verify. A relaunch auto-resumes from it and its
per-step losses equal an uninterrupted run's from the same seed (fp32, 1e-6 relative). A third
case slows the save past a 2 s grace: the rank exits 75 without a checkpoint, says so, and `latest`
still names the last periodic save. tests/run.py's launch stage runs every file here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from zeroshard.checkpoint.verify import verify
from zeroshard.errors import PREEMPTED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "preempt_train.py"
SIGNAL_AFTER_STEP = 3
STEPS = 14  # scripts/preempt_train.py's
TIMEOUT_S = 120
SAVED = re.compile(r"preemption: rank 0: (SIG\w+): emergency checkpoint (\S+) saved after step (\d+) in "
                   r"([\d.]+) s \(([\d.]+) s after the signal, grace 25 s\)")


def launch(*args: str, nproc: int = 2) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "zeroshard.cli.launch", "--nproc_per_node", str(nproc),
                             str(SCRIPT), *args], cwd=ROOT, env=env, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen[str], on_line: object = None) -> str:
    """The job's output, read to the end; `on_line(line)` sees each line as it comes. A job
    still running after TIMEOUT_S is killed (its whole session) and fails the test."""
    timer = threading.Timer(TIMEOUT_S, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    lines = []
    try:
        if proc.stdout is None:
            raise AssertionError("expected a stdout pipe")
        for line in proc.stdout:
            lines.append(line)
            if callable(on_line):
                on_line(line)
        proc.wait()
    finally:
        timer.cancel()
    return "".join(lines)


def signal_mid_run(proc: subprocess.Popen[str], target: str, signum: int) -> str:
    """Run the job; after rank 1 reports step SIGNAL_AFTER_STEP, send `signum` to the launcher
    or to rank 1's worker."""
    pattern = re.compile(rf"STEP {SIGNAL_AFTER_STEP} rank 1 pid (\d+)")
    sent: list[int] = []

    def on_line(line: str) -> None:
        m = pattern.search(line)
        if m and not sent:
            pid = proc.pid if target == "launcher" else int(m.group(1))
            os.kill(pid, signum)
            sent.append(pid)

    out = finish(proc, on_line)
    assert sent, f"the job never reported step {SIGNAL_AFTER_STEP} on rank 1:\n{out[-4000:]}"
    return out


@pytest.mark.parametrize("stage, target, signum", [(2, "launcher", signal.SIGTERM), (3, "worker", signal.SIGUSR1)],
                         ids=["zero2-sigterm-launcher", "zero3-sigusr1-rank1"])
def test_preempted_job_saves_exits_75_and_resumes_exactly(tmp_path: Path, stage: int, target: str,
                                                          signum: signal.Signals) -> None:
    job = launch("train", str(tmp_path), str(stage))
    out = signal_mid_run(job, target, signum)
    assert "DONE train" not in out, f"the job finished: the signal came too late to test anything\n{out[-3000:]}"
    # torchrun exits 1 whatever its workers' statuses were; the launcher's status says "restart".
    assert job.returncode == PREEMPTED_EXIT_CODE, f"exit {job.returncode}:\n{out[-4000:]}"
    got = SAVED.search(out)
    assert got is not None, f"no preemption line from rank 0:\n{out[-4000:]}"
    name, path, step = got.group(1), Path(got.group(2)), int(got.group(3))
    save_s, since_s = float(got.group(4)), float(got.group(5))
    # The launcher passes SIGUSR1 and SIGTERM on to torchrun as SIGTERM; a worker names its own signal.
    assert name == ("SIGTERM" if target == "launcher" else signum.name), name
    assert SIGNAL_AFTER_STEP <= step < STEPS, step
    assert save_s <= since_s < 25.0, (save_s, since_s)
    assert f"zeroshard launch: preempted ({name}); emergency checkpoint {path} after step {step}" in out, out[-3000:]
    assert f"Exit status {PREEMPTED_EXIT_CODE}: restart the job to resume" in out
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == path.name == f"global_step{step}"
    assert path.parent == tmp_path / "ckpt" and verify(path) == []

    job = launch("resume", str(tmp_path), str(stage))
    out = finish(job)
    assert job.returncode == 0, f"exit {job.returncode}:\n{out[-4000:]}"
    assert f"START rank 0/2 step {step}" in out, out[-3000:]
    losses = torch.load(tmp_path / "resume.pt", weights_only=True)
    reference, resumed = dict(losses["reference"]), losses["resumed"]
    assert [s for s, _ in resumed] == list(range(step + 1, STEPS + 1))
    got_t = torch.tensor([v for _, v in resumed], dtype=torch.float64)
    want_t = torch.tensor([reference[s] for s, _ in resumed], dtype=torch.float64)
    torch.testing.assert_close(got_t, want_t, rtol=1e-6, atol=0)
    print(f"zero{stage} ({signum.name} to the {target}): saved after step {step} in {save_s:.2f} s, "
          f"{since_s:.2f} s after the signal; resumed losses {got_t.tolist()}", file=sys.stderr)


def test_a_save_past_the_grace_exits_75_without_a_checkpoint_and_keeps_latest(tmp_path: Path) -> None:
    job = launch("slow", str(tmp_path), "2", nproc=1)
    out = finish(job)
    assert job.returncode == PREEMPTED_EXIT_CODE, f"exit {job.returncode}:\n{out[-4000:]}"
    assert "no emergency checkpoint within the grace of 2 s" in out, out[-3000:]
    assert "zeroshard launch: preempted (SIGTERM); rank(s) 0 exited without an emergency checkpoint" in out
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "global_step4"
    assert verify(ckpt / "global_step4") == []
    assert not (ckpt / "global_step5").exists()
