"""`zeroshard launch --max_restarts N --nnodes MIN:MAX`: a job that survives losing a rank or a node (issue 42).

scripts/elastic_train.py trains scripts/ckpt_auto_resume.py's tiny GPT (ZeRO 2, the node tests also
ZeRO 3) with `checkpoint.auto_resume_dir`, saving at steps 2 and 4, so every attempt torchrun starts
resumes by itself.

* restart after a crash: 2 ranks, `--max-restarts 1`; rank 1 SIGKILLs itself in step 5 of the first
  attempt. torchrun restarts both ranks, which resume from step 4 and finish; steps 5-8 equal an
  uninterrupted run's (1e-6 relative) and the launcher's summary counts 1 restart. A rank preempted
  alone (SIGUSR1: every rank saves after the same step and exits 75) is restarted the same way, and
  the summary names the preemption and its emergency checkpoint. With
  `--max-restarts 0` the same job fails and the summary says restarts are exhausted and names the
  step-4 checkpoint (read through the `--deepspeed_config` JSON in the script's arguments).
* a node lost: two `zeroshard launch` "nodes" (1 rank each) share a c10d rendezvous on 127.0.0.1 with
  `--nnodes 1:2 --max-restarts 1`. Both hold before step 6; the test kills one node's whole process
  tree (launcher, agent, worker). The survivor (it holds the rendezvous store, `is_host=true`) restarts
  its worker at world size 1, which resumes from step 4 (step 5 is lost: trained again) with gradient
  accumulation 1 -> 2 and matches an uninterrupted world-1 run from that checkpoint (1e-6 relative).
* a node joining: one node trains alone (`--nnodes 1:2 --max-restarts 0`, world size 1, accumulation 2)
  and holds before step 5; a second node's launch joins. torchrun's agent sees a node waiting and
  stops its worker with SIGTERM (a restart for a join is not counted against --max_restarts); the
  worker trains step 5, saves global_step5 (preemption handling) and exits 75. Both nodes start at world
  size 2 and resume from step 5 (nothing lost) with accumulation 2 -> 1, matching an uninterrupted
  world-2 run from that checkpoint (1e-6 relative).

The node tests check the step record (every step once, the steps lost counted) and print, for `pytest
-s`, the seconds from the kill (or the second launch) to the resumed START line and the losses per step
against the reference: docs/launch.md's table. The first tests check, without starting anything, the
torchrun command lines, the refusals and the summary's wording. tests/run.py's launch stage runs every
file here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torchrun_cmd import torchrun

from zeroshard.cli.launch import plan_launch, restart_summary
from zeroshard.cli.launch_report import membership_restart
from zeroshard.errors import LaunchError

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"
SCRIPT = SCRIPTS / "elastic_train.py"
TIMEOUT_S = 150
# Rendezvous settings for a busy 2-core machine: a lost node's heartbeat is given up after 3 x 2 s,
# and a round that has MIN nodes waits 5 s for more (both nodes join the first round well within it).
STEPS = 8  # scripts/ckpt_auto_resume.py's
RDZV_CONF = "join_timeout=60,last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=3"


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory and home (no stray env file) holding train.py."""
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return tmp_path


def test_restarts_and_ranges_use_the_c10d_rendezvous(here: Path) -> None:
    py = sys.executable
    (cmd,) = plan_launch(["--dry_run", "--nproc_per_node", "2", "--max-restarts", "2", "--master_port", "29555",
                          "--no_local_rank", "train.py", "--x"]).commands
    assert cmd.argv == [py, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                        "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:29555", "--rdzv_id", "zeroshard-29555",
                        "--max_restarts", "2", "train.py", "--x"]
    assert cmd.env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    plan = plan_launch(["--dry_run", "--nnodes", "1:4", "--nproc_per_node", "1", "--master_addr", "10.0.0.1",
                        "--rdzv_id", "job-7", "--rdzv_conf", "last_call_timeout=5,is_host=false", "train.py"])
    argv = plan.commands[0].argv
    assert argv[3:5] == ["--nnodes", "1:4"] and "--node_rank" not in argv and "--master_addr" not in argv
    assert argv[argv.index("--rdzv_endpoint") + 1] == "10.0.0.1:29500"
    assert argv[argv.index("--rdzv_conf") + 1] == "last_call_timeout=5,is_host=false"
    assert argv[argv.index("--max_restarts") + 1] == "0" and argv[argv.index("--rdzv_id") + 1] == "job-7"
    assert "--local_addr" not in argv  # torchrun then uses this host's name
    named = plan_launch(["--dry_run", "--nnodes", "1:2", "--nproc_per_node", "1", "--master_addr", "10.0.0.1",
                         "--local_addr", "10.0.0.2", "train.py"]).commands[0].argv
    at = named.index("--local_addr")
    assert named[at + 1] == "10.0.0.2" and at < named.index("train.py")
    static = plan_launch(["--dry_run", "--nnodes", "1", "--nproc_per_node", "1", "train.py"]).commands[0].argv
    assert "--master_addr" in static and static[static.index("--max_restarts") + 1] == "0"
    (hostfile := here / "hosts").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    ssh = plan_launch(["--dry_run", "--hostfile", str(hostfile), "--max_restarts", "3", "train.py"]).commands
    assert all("--max_restarts 3 --rdzv_id zeroshard-29500" in c.argv[-1] for c in ssh), ssh


@pytest.mark.parametrize(("args", "first_line"), [
    (["--nnodes", "3:2"], "--nnodes 3:2: MIN 3 is above MAX 2"),
    (["--nnodes", "0:2"], "--nnodes 0:2: MIN must be at least 1"),
    (["--nnodes", "2:x"], "--nnodes '2:x': expected N or MIN:MAX"),
    (["--max-restarts", "-1"], "--max_restarts -1: need 0 or more"),
    (["--nnodes", "2", "--num_nodes", "3"], "--nnodes 2 and --num_nodes 3 disagree"),
    (["--nnodes", "1:2"], "--nnodes 1:2: give --master_addr"),
    (["--nnodes", "1:2", "--master_addr", "h", "--node_rank", "1"], "--node_rank with --nnodes 1:2: the rendezvous"),
    (["--nnodes", "1:2", "--hostfile", "hosts"], "--nnodes 1:2 with --hostfile: a hostfile names a fixed set"),
    (["--launcher", "slurm", "--max_restarts", "1"], "--max_restarts 1 with --launcher slurm"),
    (["--rdzv_conf", "a=1"], "--rdzv_conf without --max_restarts N or --nnodes MIN:MAX"),
    (["--local_addr", "10.0.0.2"], "--local_addr without --max_restarts N or --nnodes MIN:MAX"),
    (["--max_restarts", "1", "--hostfile", "hosts", "--local_addr", "10.0.0.2"],
     "--local_addr 10.0.0.2 with --hostfile: each host is reached by its hostfile name"),
    (["--max_restarts", "1", "--rdzv_conf", "timeout"], "--rdzv_conf 'timeout': expected key=value pairs"),
])
def test_refusals_name_the_flag_first(here: Path, args: list[str], first_line: str) -> None:
    (here / "hosts").write_text("worker-0 slots=1\nworker-1 slots=1\n")
    with pytest.raises(LaunchError) as e:
        plan_launch(["--dry_run", *args, "train.py"])
    assert str(e.value).startswith(first_line), str(e.value)


def test_summary_wording() -> None:
    assert restart_summary(0, 2, 3, preempted={1: " on SIGUSR1, emergency checkpoint c/global_step6 after step 6"}) == (
        "zeroshard launch: 2 restarts (--max_restarts 3): attempt 0 failed, attempt 1 was preempted (exit 75 on "
        "SIGUSR1, emergency checkpoint c/global_step6 after step 6), attempt 2 finished. Exit status 0.")
    left = restart_summary(1, 0, 2, resume_dir="ckpt")
    assert "with 2 restart(s) left: the agent stopped for another reason" in left
    assert left.endswith("auto_resume_dir ckpt holds no checkpoint (no `latest`): a new launch starts fresh.")
    assert "received SIGTERM and stopped the job (not a failure to restart)" in restart_summary(
        143, 0, 1, stopped_by="SIGTERM")
    assert restart_summary(1, None, 1).startswith("zeroshard launch: no attempt started")
    joined = membership_restart([(5.0, {"signal": "SIGTERM", "checkpoint": "c/global_step5", "step": 5})], {0: 9.0})
    assert restart_summary(0, 0, 0, membership=joined) == (
        "zeroshard launch: 0 restarts (--max_restarts 0): attempt 0 finished. Exit status 0 (a membership change "
        "(a node joined or left) restarted the workers, not counted as a restart: on SIGTERM, emergency checkpoint "
        "c/global_step5 after step 5).")
    assert membership_restart([(9.5, {"signal": "SIGTERM"})], {0: 9.0}) is None  # written in attempt 0: preemption


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", **extra)
    return env


def _launch(args: list[str], **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "zeroshard.cli.main", "launch", *args], cwd=ROOT,
                            env=_env(**extra), text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _tree(pid: int) -> list[int]:
    """`pid` and all its descendants (torchrun starts each worker in a session of its own)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, grew = {pid}, True
    while grew:
        kids = {p for p, pp in parent.items() if pp in found} - found
        found |= kids
        grew = bool(kids)
    return sorted(found)


def _kill_tree(pid: int) -> list[int]:
    """Freeze, then SIGKILL, `pid` and its descendants at once: a node lost, nothing cleans up."""
    pids = _tree(pid)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
    return pids


class _Job:
    """A launcher whose output is read as it comes (`lines`); killed with its tree after TIMEOUT_S."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        if self.proc.stdout is None:
            raise AssertionError("expected a stdout pipe")
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = TIMEOUT_S) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.out, re.M)
            if m:
                return m
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the output (exit {self.proc.poll()}):\n{self.out[-6000:]}")

    def finish(self, timeout: float = TIMEOUT_S) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(self.proc.pid)
            self.proc.wait()
            self._reader.join(5)
            pytest.fail(f"launcher still running after {timeout} s:\n{self.out[-6000:]}")
        self._reader.join(10)
        return self.proc.returncode, self.out

    def kill(self) -> None:
        if self.proc.poll() is None:
            _kill_tree(self.proc.pid)
            self.proc.wait()


def _losses(path: Path) -> dict[int, float]:
    return dict(torch.load(path, weights_only=True))


def _close(got: dict[int, float], want: dict[int, float], steps: list[int]) -> float:
    """The largest relative deviation over `steps`, after asserting 1e-6."""
    assert sorted(got) == steps, got
    g = torch.tensor([got[s] for s in steps], dtype=torch.float64)
    w = torch.tensor([want[s] for s in steps], dtype=torch.float64)
    torch.testing.assert_close(g, w, rtol=1e-6, atol=0)
    return float(((g - w).abs() / w.abs()).max())


def _stamp(out: str, pattern: str) -> float:
    m = re.search(pattern + r".* t=([\d.]+)", out)
    if m is None:
        raise AssertionError(f"no {pattern!r} in:\n{out[-4000:]}")
    return float(m.group(1))


def _run(cmd: list[str], **extra: str) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(**extra), text=True, timeout=TIMEOUT_S,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Per-step losses of the 2-rank job that nobody kills."""
    out = tmp_path_factory.mktemp("uninterrupted")
    _run(torchrun(2, str(SCRIPT), str(out), "2"))
    return _losses(out / "attempt0.pt")


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"checkpoint": {"auto_resume_dir": str(tmp_path / "ckpt")}}))
    return path


def test_crashed_rank_restarts_and_resumes(tmp_path: Path, uninterrupted: dict[int, float]) -> None:
    job = _Job(_launch(["--nproc_per_node", "2", "--max-restarts", "1", str(SCRIPT), str(tmp_path), "2",
                        "--deepspeed_config", str(_config(tmp_path))], ZS_DIE="1"))
    code, out = job.finish()
    assert code == 0, out[-6000:]
    assert "DIE rank 1 step 5" in out
    assert re.search(r"^START rank 0/2 attempt 1 step 4 gas 1 ", out, re.M), out[-4000:]
    assert ("zeroshard launch: 1 restart (--max_restarts 1): attempt 0 failed, attempt 1 finished. "
            "Exit status 0.") in out, out[-3000:]
    dev = _close(_losses(tmp_path / "attempt1.pt"), uninterrupted, [5, 6, 7, 8])
    back = _stamp(out, r"START rank 0/2 attempt 1") - _stamp(out, r"DIE rank 1")
    print(f"crash restart: training again {back:.1f} s after rank 1 died; resumed at step 4 (step 5 redone); "
          f"max relative loss deviation vs uninterrupted {dev:.2e}", file=sys.stderr)


def test_preempted_rank_is_restarted_and_named(tmp_path: Path, uninterrupted: dict[int, float]) -> None:
    """SIGUSR1 to rank 1 only: every rank saves after step 5 and exits 75, which torchrun restarts."""
    job = _Job(_launch(["--nproc_per_node", "2", "--max-restarts", "1", str(SCRIPT), str(tmp_path), "2",
                        "--deepspeed_config", str(_config(tmp_path))], ZS_HOLD="5"))
    try:
        pid = int(job.wait_for(r"^HOLD rank 1 world 2 pid (\d+) ").group(1))
        os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)
        (tmp_path / "go").touch()
        code, out = job.finish()
    finally:
        job.kill()
    assert code == 0, out[-6000:]
    assert re.search(r"^START rank 0/2 attempt 1 step 5 gas 1 ", out, re.M), out[-4000:]
    assert (f"zeroshard launch: 1 restart (--max_restarts 1): attempt 0 was preempted (exit 75 on SIGUSR1, emergency "
            f"checkpoint {tmp_path / 'ckpt' / 'global_step5'} after step 5), attempt 1 finished. Exit status 0."
            ) in out, out[-3000:]
    dev = _close(_losses(tmp_path / "attempt1.pt"), uninterrupted, [6, 7, 8])
    print(f"preempted rank: resumed from the emergency checkpoint after step 5 (no step lost); max relative loss "
          f"deviation vs uninterrupted {dev:.2e}", file=sys.stderr)


def test_no_restart_left_fails_and_names_the_checkpoint(tmp_path: Path) -> None:
    code, out = _Job(_launch(["--nproc_per_node", "2", "--max-restarts", "0", str(SCRIPT), str(tmp_path), "2",
                              "--deepspeed_config", str(_config(tmp_path))], ZS_DIE="1")).finish()
    assert code == 1, out[-6000:]
    assert "DIE rank 1 step 5" in out and "attempt 1" not in out
    assert ("zeroshard launch: 0 restarts (--max_restarts 0): attempt 0 failed. Exit status 1: restarts exhausted "
            "(--max_restarts 0: a failed worker ends the job)") in out, out[-3000:]
    assert f"The last complete checkpoint is {tmp_path / 'ckpt' / 'global_step4'} (`latest`" in out


def test_restarts_run_out_through_the_rendezvous() -> None:
    """Rank 1 fails in every attempt (no torch in this worker: seconds)."""
    code, out = _Job(_launch(["--nproc_per_node", "2", "--max-restarts", "1", "--no_local_rank",
                              str(SCRIPTS / "fail_rank1.py")])).finish()
    assert code == 1, out[-6000:]
    assert out.count("rank 1 failing on purpose") == 2, out[-6000:]
    assert ("zeroshard launch: 1 restart (--max_restarts 1): attempt 0 failed, attempt 1 failed. Exit status 1: "
            "restarts exhausted; torchrun's error report above names the failed ranks. The launcher does not "
            "know the checkpoint directory") in out, out[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node_flags(port: int, rdzv_id: str, max_restarts: int) -> list[str]:
    return ["--nnodes", "1:2", "--nproc_per_node", "1", "--max-restarts", str(max_restarts), "--master_addr",
            "127.0.0.1", "--master_port", str(port), "--rdzv_id", rdzv_id]


def _steps(out: str) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Rank 0's STEP lines, world size -> steps in order; and PREEMPTED lines, world size -> the step
    its emergency checkpoint holds (trained, so part of the record, though no loss was printed)."""
    ran: dict[int, list[int]] = {}
    for world, step in re.findall(r"^STEP world (\d+) step (\d+) ", out, re.M):
        ran.setdefault(int(world), []).append(int(step))
    saved = {int(w): int(s) for w, s in re.findall(r"^PREEMPTED world (\d+) after step (\d+) ", out, re.M)}
    return ran, saved


def _step_losses(out: str, world: int) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(rf"^STEP world {world} step (\d+) loss (\S+) ", out, re.M)}


def _record(out: str, before: int, after: int, resumed_at: int) -> list[int]:
    """The steps lost: trained at world `before` after the checkpoint the world-`after` group resumed
    from, so trained again. Asserts that the final record (steps up to the resume point from the first
    group, the rest from the second) holds every step once, in order."""
    ran, saved = _steps(out)
    first = ran.get(before, []) + ([saved[before]] if before in saved else [])
    assert first == list(range(1, len(first) + 1)) and ran.get(after), (ran, saved)
    lost = [s for s in first if s > resumed_at]
    record = [s for s in first if s <= resumed_at] + ran[after]
    assert record == list(range(1, STEPS + 1)), (record, ran, saved)
    return lost


def _reference(tmp_path: Path, stage: int, world: int, tag: str, gas: int) -> dict[int, float]:
    """Per-step losses of an uninterrupted world-`world` run from DIR/ckpt/`tag` (load_checkpoint with
    the random generators, `gas` micro-batches per step): what the resumed group must reproduce."""
    _run(torchrun(world, str(SCRIPTS / "ckpt_auto_resume.py"), "reference", str(tmp_path), str(stage), tag, str(gas)))
    return dict(torch.load(tmp_path / "reference.pt", weights_only=True))


def _report(case: str, stage: int, sizes: str, resumed_at: int, lost: list[int], back_s: str,
            got: dict[int, float], want: dict[int, float]) -> None:
    """The measurements issue 42's closing note quotes (docs/launch.md's table), on stderr (pytest -s)."""
    steps = list(range(resumed_at + 1, STEPS + 1))
    dev = _close(got, want, steps)
    per_step = ", ".join(f"{s}: {got[s]:.7f}/{want[s]:.7f}" for s in steps)
    print(f"\nELASTIC {case} ZeRO-{stage}: world {sizes}; resumed from global_step{resumed_at}; steps lost "
          f"{len(lost)} {lost}; {back_s}; loss resumed/reference {per_step}; max relative deviation {dev:.1e}",
          file=sys.stderr)


@pytest.mark.parametrize("stage", [2, 3])
def test_lost_node_shrinks_the_job_to_one(tmp_path: Path, stage: int) -> None:
    """Killed while both hold before step 6: step 5 (after the step-4 save) is lost and trained again."""
    common = _node_flags(_free_port(), "shrink", 1)
    # The survivor holds the rendezvous store: the node at the endpoint must outlive the others.
    nodes = {name: _Job(_launch([*common, "--rdzv_conf", f"{RDZV_CONF},is_host={host}",
                                 str(SCRIPT), str(tmp_path), str(stage)], ZS_HOLD="6"))
             for name, host in (("survivor", "true"), ("lost", "false"))}
    survivor, lost = nodes["survivor"], nodes["lost"]
    try:
        for job in nodes.values():
            job.wait_for(r"^HOLD rank \d world 2 ")
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.is_dir()) == ["global_step2", "global_step4"]
        _kill_tree(lost.proc.pid)
        killed = time.time()
        (tmp_path / "go").touch()
        code, out = survivor.finish()
    finally:
        for job in nodes.values():
            job.kill()
    assert code == 0, out[-6000:]
    resumed = r"^START rank 0/1 attempt 1 step 4 gas 2 "
    assert re.search(resumed, out, re.M), out[-4000:]
    assert "gradient_accumulation_steps 1 -> 2 at data-parallel size 1 (train_batch_size 2 -> 4)" in out
    assert ("zeroshard launch: 1 restart (--max_restarts 1): attempt 0 failed, attempt 1 finished. "
            "Exit status 0.") in out, out[-3000:]
    lost_steps = _record(lost.out + out, 2, 1, 4)
    assert lost_steps == [5], lost_steps
    back = _stamp(out, resumed[1:].rstrip()) - killed
    _report("node lost", stage, "2 -> 1", 4, lost_steps, f"training again {back:.1f} s after the kill",
            _step_losses(out, 1), _reference(tmp_path, stage, 1, "global_step4", 2))


@pytest.mark.parametrize("stage", [2, 3])
def test_joining_node_grows_the_job_to_two(tmp_path: Path, stage: int) -> None:
    """One node trains alone (world 1, 2 micro-batches per step) and holds before step 5; a second
    node's launch joins the rendezvous. The first agent sees it waiting and stops its worker with
    SIGTERM, which trains step 5 and saves global_step5 (preemption); both nodes start at world 2,
    resume from it with 1 micro-batch per step and finish. With `--max_restarts 0`: a join is no restart."""
    common = _node_flags(_free_port(), "grow", 0)
    first = _Job(_launch([*common, "--rdzv_conf", f"{RDZV_CONF},is_host=true", str(SCRIPT), str(tmp_path),
                          str(stage), "--gas", "2"], ZS_JOIN="5"))
    second: _Job | None = None
    try:
        first.wait_for(r"^HOLD rank 0 world 1 ")
        joined = time.time()
        second = _Job(_launch([*common, "--rdzv_conf", f"{RDZV_CONF},is_host=false", str(SCRIPT), str(tmp_path),
                               str(stage), "--gas", "2"], ZS_JOIN="5"))
        code, out = first.finish()
        code2, out2 = second.finish()
    finally:
        for job in (first, second):
            if job is not None:
                job.kill()
    assert code == 0 and code2 == 0, (out + out2)[-8000:]
    both = out + out2
    assert "SIGTERM rank 0 world 1 before step 5 " in out, out[-4000:]
    resumed = r"^START rank 0/2 attempt 0 step 5 gas 1 "
    assert re.search(resumed, both, re.M) and re.search(r"^START rank 1/2 attempt 0 step 5 gas 1 ", both, re.M), (
        both[-6000:])
    assert "gradient_accumulation_steps 2 -> 1 at data-parallel size 2 (train_batch_size 8 -> 4)" in both
    # The first node's summary names the join's restart, which torchrun does not count.
    assert ("zeroshard launch: 0 restarts (--max_restarts 0): attempt 0 finished. Exit status 0 (a membership "
            "change (a node joined or left) restarted the workers, not counted as a restart: on SIGTERM, emergency "
            "checkpoint ") in out, out[-3000:]
    assert "zeroshard launch: 0 restarts (--max_restarts 0): attempt 0 finished. Exit status 0." in out2, out2[-3000:]
    lost_steps = _record(both, 1, 2, 5)
    assert lost_steps == [], lost_steps
    stopped = _stamp(out, r"SIGTERM rank 0 world 1") - joined
    saved = _stamp(out, r"PREEMPTED world 1") - joined
    back = _stamp(both, resumed[1:].rstrip()) - joined
    _report("node joined", stage, "1 -> 2", 5, lost_steps,
            f"training again {back:.1f} s after the second launch (SIGTERM {stopped:.1f} s, global_step5 saved "
            f"{saved:.1f} s)", _step_losses(both, 2), _reference(tmp_path, stage, 2, "global_step5", 1))
