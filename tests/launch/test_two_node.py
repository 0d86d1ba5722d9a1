"""`zeroshard launch` end to end on this machine: two nodes, a failing worker, env files.

Each test starts real processes (torchrun, and torch in the all-reduce workers); the other
workers skip `import torch` to keep the run short.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _launch(args: list[str], cwd: Path = REPO, stdin: int = subprocess.DEVNULL
            ) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "zeroshard.cli.launch", *args], cwd=cwd, env=env,
        stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _finish(proc: subprocess.Popen[str], stdin: str | None = None) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(input=stdin, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"launcher still running after {TIMEOUT_S} s:\n{out}")
    return proc.returncode, out


def test_two_nodes_all_reduce_with_env_file(tmp_path: Path) -> None:
    env_file = tmp_path / "job.env"
    env_file.write_text("# forwarded to every worker\nZS_LAUNCH_TEST=from-env-file\n")
    port = _free_port()
    nodes = [
        _launch(["--num_nodes", "2", "--node_rank", str(r), "--nproc_per_node", "1",
                 "--master_addr", "127.0.0.1", "--master_port", str(port),
                 "--env_file", str(env_file), str(SCRIPTS / "allreduce.py")])
        for r in (0, 1)
    ]
    results = [_finish(p) for p in nodes]
    for rank, (code, out) in enumerate(results):
        assert code == 0, out
        assert (f"ALLREDUCE rank={rank} world=2 local_rank=0 value=3 env=from-env-file"
                in out), out


def test_failing_worker_stops_the_job(tmp_path: Path) -> None:
    start = time.monotonic()
    code, out = _finish(_launch(["--nproc_per_node", "2", str(SCRIPTS / "fail_rank1.py")]))
    elapsed = time.monotonic() - start
    assert code != 0, out
    assert "rank 1 failing on purpose" in out
    assert elapsed < 60, f"the job took {elapsed:.0f} s to stop after rank 1 failed:\n{out}"


def test_deepspeed_env_in_cwd_reaches_workers(tmp_path: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text('ZS_LAUNCH_TEST=ds-env\nZS_QUOTED="a b"\n')
    code, out = _finish(_launch(["--nproc-per-node", "2", str(SCRIPTS / "print_env.py")],
                                cwd=tmp_path))
    assert code == 0, out
    for rank in (0, 1):
        assert f"ENV RANK={rank} WORLD_SIZE=2 ZS_LAUNCH_TEST=ds-env ZS_QUOTED=a b" in out, out


def test_closed_stdin_stops_a_watching_node() -> None:
    """What a remote node does when its ssh connection goes (Note: [lost connection])."""
    proc = _launch(["--watch_stdin", "--nproc_per_node", "1", str(SCRIPTS / "fail_rank1.py")],
                   stdin=subprocess.PIPE)
    time.sleep(1.0)
    start = time.monotonic()
    code, out = _finish(proc, stdin="")  # writes nothing, then closes the pipe
    assert code == 143, out
    assert "stdin closed" in out
    assert time.monotonic() - start < 30, out
