"""`zeroshard launch` without starting anything: hostfiles, filters, env files, dry-run
commands and the errors raised before launch."""

from __future__ import annotations

import os
import shlex
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from zeroshard.cli import launch
from zeroshard.cli.hostfile import parse_filter, parse_hostfile, parse_hostfile_text, select_hosts
from zeroshard.cli.launch import main, plan_launch
from zeroshard.cli.launch_env import (
    EXPORT_PREFIXES,
    collect_exports,
    default_env_files,
    export_prefix,
    parse_env_file,
    parse_env_text,
)
from zeroshard.errors import LaunchError

PY = sys.executable


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Run in an empty directory with an empty home, so no stray env file is read."""
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith(EXPORT_PREFIXES):
            monkeypatch.delenv(name)
    (tmp_path / "train.py").write_text("print('hi')\n")
    yield tmp_path


@pytest.fixture
def hostfile(tmp_path: Path) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("# two workers\n\nworker-0 slots=2\nworker-1 slots=4  # the big one\n")
    return path


# ---------------------------------------------------------------- hostfile


def test_hostfile_parses_comments_blank_lines_and_order(hostfile: Path) -> None:
    assert parse_hostfile(hostfile) == {"worker-0": 2, "worker-1": 4}
    assert list(parse_hostfile(hostfile)) == ["worker-0", "worker-1"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("a slots=1\nb\n", r"hosts:2: cannot parse 'b': each line must read 'HOSTNAME slots=N'"),
        ("a slots=1\nb slots 2\n", r"hosts:2: cannot parse"),
        ("a slot=4\n", r"hosts:1: cannot parse 'a slot=4'"),
        ("a slots=four\n", r"hosts:1: slots='four' is not an integer"),
        ("a slots=0\n", r"hosts:1: a has slots=0; a host needs at least one slot"),
        ("a slots=-2\n", r"hosts:1: a has slots=-2"),
        ("a slots=1\n\nb slots=1\na slots=2\n",
         r"hosts:4: host a is already listed on line 1\. List each host once"),
        ("# nothing\n\n", r"hosts: no hosts in the hostfile"),
    ],
)
def test_hostfile_errors_name_file_line_and_fix(text: str, match: str) -> None:
    with pytest.raises(LaunchError, match=match):
        parse_hostfile_text(text, source="hosts")


def test_missing_hostfile(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"nope: no such hostfile"):
        parse_hostfile(tmp_path / "nope")


# ---------------------------------------------------------------- include / exclude

POOL = {"worker-0": 2, "worker-1": 4}


def test_parse_filter() -> None:
    assert parse_filter("worker-0@worker-1:0,2") == {"worker-0": None, "worker-1": [0, 2]}


@pytest.mark.parametrize(
    ("spec", "match"),
    [("worker-0:", "empty entry 'worker-0:'"), ("worker-0@", "empty entry ''"),
     ("worker-0:a", "slot 'a' of worker-0 is not a non-negative integer"),
     ("w@w:1", "host w appears twice")],
)
def test_parse_filter_errors(spec: str, match: str) -> None:
    with pytest.raises(LaunchError, match=match):
        parse_filter(spec)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, {"worker-0": [0, 1], "worker-1": [0, 1, 2, 3]}),
        ({"include": "worker-1"}, {"worker-1": [0, 1, 2, 3]}),
        ({"include": "worker-0@worker-1:0,2"}, {"worker-0": [0, 1], "worker-1": [0, 2]}),
        ({"include": "worker-1:3,1"}, {"worker-1": [1, 3]}),
        ({"exclude": "worker-0"}, {"worker-1": [0, 1, 2, 3]}),
        ({"exclude": "worker-0:1@worker-1:0,3"}, {"worker-0": [0], "worker-1": [1, 2]}),
        ({"num_nodes": 1}, {"worker-0": [0, 1]}),
        ({"num_gpus": 1}, {"worker-0": [0], "worker-1": [0]}),
        ({"exclude": "worker-1:0", "num_gpus": 2}, {"worker-0": [0, 1], "worker-1": [1, 2]}),
    ],
)
def test_select_hosts(kwargs: dict[str, object], expected: dict[str, list[int]]) -> None:
    assert select_hosts(POOL, **kwargs) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"include": "worker-9"}, r"--include: unknown host 'worker-9'; hosts lists worker-0, "),
        ({"exclude": "worker-0:2"}, r"--exclude: worker-0 has slots 0\.\.1 in hosts; no slot 2"),
        ({"include": "worker-0", "exclude": "worker-1"}, "mutually exclusive"),
        ({"exclude": "worker-0@worker-1"}, "leaves no host to run on"),
        ({"num_nodes": 3}, r"--num_nodes 3, but hosts .* has 2 host\(s\)"),
        ({"num_gpus": 3}, r"--num_gpus 3, but these hosts have fewer usable slots: worker-0 \(2\)"),
    ],
)
def test_select_hosts_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(LaunchError, match=match):
        select_hosts(POOL, source="hosts", **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- env files


def test_env_file_parsing() -> None:
    text = "# comment\n\nA=1\nexport B = two words \nC='x=y'\nD=\"q\"\nE=\n"
    assert parse_env_text(text) == {"A": "1", "B": "two words", "C": "x=y", "D": "q", "E": ""}


@pytest.mark.parametrize(
    ("text", "match"),
    [("A=1\n\nNOEQUALS\n", r"f\.env:3: no '=' in 'NOEQUALS'; each line must read KEY=VALUE"),
     ("1A=2\n", r"f\.env:1: '1A' is not a variable name")],
)
def test_env_file_errors(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "f.env").write_text(text)
    with pytest.raises(LaunchError, match=match):
        parse_env_file(tmp_path / "f.env")


def test_env_files_found_in_home_then_cwd(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("A=cwd\n")
    (cwd / ".zeroshard_env").write_text("C=zs\n")
    files = default_env_files(cwd=cwd, home=home)
    assert files == [home / ".deepspeed_env", cwd / ".deepspeed_env", cwd / ".zeroshard_env"]
    environ = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/p", "ZEROSHARD_X": "1", "HOME": "/h",
               "B": "shell"}
    assert collect_exports(environ, files) == {
        "NCCL_DEBUG": "INFO", "PYTHONPATH": "/p", "ZEROSHARD_X": "1",
        "A": "cwd", "B": "home", "C": "zs"}


def test_export_prefix_quotes_values() -> None:
    assert export_prefix({"A": "1", "B": "a b;c"}) == "export A=1; export B='a b;c'; "


# ---------------------------------------------------------------- dry runs


def test_single_node_runs_torchrun(tmp_path: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text("FROM_FILE=1\n")
    plan = plan_launch(["--dry_run", "--nproc-per-node", "2", "--master_port", "29555",
                        "train.py", "--deepspeed", "--lr", "1"])
    (cmd,) = plan.commands
    assert plan.mode == "local"
    assert cmd.argv == [PY, "-m", "torch.distributed.run", "--nnodes", "1", "--node_rank", "0",
                        "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                        "--master_port", "29555", "--max_restarts", "0",
                        "--module", "zeroshard.cli.launch_worker", "python",  # adds --local_rank=<i>
                        "train.py", "--deepspeed", "--lr", "1"]
    assert cmd.env == {"FROM_FILE": "1"}


def test_single_node_defaults_to_a_free_port_and_passes_module_flags() -> None:
    plan = plan_launch(["--num_gpus=1", "--module", "--dry-run", "pkg.train", "-x"])
    argv = plan.commands[0].argv
    assert argv[-5:] == ["--module", "zeroshard.cli.launch_worker", "module", "pkg.train", "-x"]
    assert 0 < int(argv[argv.index("--master_port") + 1]) < 65536
    plain = plan_launch(["--num_gpus=1", "--module", "--no_local_rank", "--dry-run", "pkg.train", "-x"])
    assert plain.commands[0].argv[-3:] == ["--module", "pkg.train", "-x"]


@pytest.mark.parametrize(("flags", "mode"), [([], "python"), (["--module"], "module"), (["--no_python"], "exec")])
def test_workers_get_local_rank_as_deepspeeds_launcher_passes_it(flags: list[str], mode: str) -> None:
    """DeepSpeed's launcher runs `python -u train.py --local_rank=<i> ARGS`; DeepSpeed-Chat reads only that."""
    from zeroshard.cli.launch_worker import worker_argv

    (cmd,) = plan_launch(["--dry_run", "--nproc_per_node", "2", *flags, "train.py", "--zero_stage", "2"]).commands
    tail = cmd.argv[cmd.argv.index("--max_restarts") + 2:]
    assert tail == ["--module", "zeroshard.cli.launch_worker", mode, "train.py", "--zero_stage", "2"]
    head = {"python": [PY, "-u"], "module": [PY, "-u", "-m"], "exec": []}[mode]
    assert worker_argv(mode, "train.py", ["--zero_stage", "2"], "1") == [
        *head, "train.py", "--local_rank=1", "--zero_stage", "2"]
    (off,) = plan_launch(["--dry_run", "--nproc_per_node", "2", *flags, "--no-local-rank", "train.py"]).commands
    assert off.argv[off.argv.index("--max_restarts") + 2:] == [*flags, "train.py"]


def test_launch_worker_execs_the_script_with_its_local_rank(tmp_path: Path) -> None:
    """The module torchrun starts replaces itself with the script (same process, the one torchrun
    watches), which sees --local_rank first."""
    import json
    import subprocess

    script = tmp_path / "show.py"
    script.write_text("import json, os, sys; print(json.dumps([sys.argv[1:], os.getpid()]))\n")
    argv = [PY, "-m", "zeroshard.cli.launch_worker", "python", str(script), "--x"]
    proc = subprocess.Popen(argv, env={**os.environ, "LOCAL_RANK": "3"}, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert json.loads(out) == [["--local_rank=3", "--x"], proc.pid]
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    bare = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2 and "LOCAL_RANK is not set" in bare.stderr


def test_per_node_launches_keep_no_local_rank(hostfile: Path) -> None:
    plan = plan_launch(["--dry_run", "--hostfile", str(hostfile), "--no_local_rank", "train.py", "--a"])
    assert all(c.argv[4].endswith("--no_env_file --watch_stdin --no_local_rank train.py --a") for c in plan.commands)


def test_local_include_sets_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_default_nproc", lambda: 4)
    (cmd,) = plan_launch(["--dry_run", "--include", "localhost:1,3", "train.py"]).commands
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "1,3"}
    assert cmd.argv[cmd.argv.index("--nproc_per_node") + 1] == "2"


def test_ssh_commands(hostfile: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("PYTHONPATH", "/src")
    (tmp_path / "my.env").write_text("WANDB_MODE=offline\n")
    plan = plan_launch(["--dry_run", "--hostfile", str(hostfile), "--exclude", "worker-1:1",
                        "--master_port", "29600", "--env_file", "my.env", "train.py", "--a"])
    assert plan.mode == "ssh"
    assert [c.stdin for c in plan.commands] == ["pipe", "pipe"]  # Note: [lost connection]
    assert [c.argv[:4] for c in plan.commands] == [
        ["ssh", "-o", "BatchMode=yes", "worker-0"], ["ssh", "-o", "BatchMode=yes", "worker-1"]]
    remote = [c.argv[4] for c in plan.commands]
    for line in remote:
        assert line.startswith("export NCCL_DEBUG=INFO; export PYTHONPATH=/src; "
                               f"export WANDB_MODE=offline; cd {shlex.quote(str(tmp_path))}; ")
    common = "--master_addr worker-0 --master_port 29600 --no_env_file --watch_stdin train.py --a"
    assert remote[0].endswith(f"{PY} -u -m zeroshard.cli.launch --num_nodes 2 --node_rank 0 "
                              f"--nproc_per_node 2 {common}")
    assert remote[1].endswith(f"{PY} -u -m zeroshard.cli.launch --num_nodes 2 --node_rank 1 "
                              f"--nproc_per_node 3 --device_ids 0,2,3 {common}")


def test_pdsh_command(hostfile: Path) -> None:
    plan = plan_launch(["--dry_run", "--launcher", "pdsh", "--hostfile", str(hostfile),
                        "--include", "worker-0@worker-1:1,2", "train.py"])
    (cmd,) = plan.commands
    assert cmd.env == {"PDSH_RCMD_TYPE": "ssh"}
    assert cmd.argv[:6] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1"]
    assert ("--num_nodes 2 --node_rank %n --node_devices '0,1;1,2' --master_addr worker-0 "
            "--master_port 29500 --no_env_file train.py") in cmd.argv[6]


def test_per_node_launch_picks_its_devices() -> None:
    (cmd,) = plan_launch(["--dry_run", "--node_rank", "1", "--node_devices", "0,1;1,2,3",
                          "--master_addr", "h0", "--master_port", "29500", "--no_env_file",
                          "train.py"]).commands
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "1,2,3"}
    assert " --nnodes 2 --node_rank 1 --nproc_per_node 3 --master_addr h0 " in cmd.shell()


def test_slurm_command(hostfile: Path) -> None:
    (cmd,) = plan_launch(["--dry_run", "--launcher", "slurm", "--hostfile", str(hostfile),
                          "--num_gpus", "2", "train.py", "--b"]).commands
    assert cmd.argv == ["srun", "-N", "2", "--ntasks-per-node", "2", "--nodelist",
                        "worker-0,worker-1", PY, "-u", "train.py", "--b"]
    assert cmd.env == {"MASTER_PORT": "29500"}
    (cmd,) = plan_launch(["--dry_run", "--launcher", "slurm", "--num_nodes", "4",
                          "--nproc_per_node", "8", "--master_addr", "n0", "train.py"]).commands
    assert cmd.shell() == (f"MASTER_PORT=29500 MASTER_ADDR=n0 srun -N 4 --ntasks-per-node 8 "
                           f"{PY} -u train.py")


def test_slurm_rejects_uneven_hosts(hostfile: Path) -> None:
    with pytest.raises(LaunchError, match="same number of tasks on every node"):
        plan_launch(["--launcher", "slurm", "--hostfile", str(hostfile), "train.py"])


def test_main_dry_run_prints_commands(hostfile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dry_run", "--hostfile", str(hostfile), "train.py"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert all(line.startswith("ssh -o BatchMode=yes worker-") for line in lines)


# ---------------------------------------------------------------- errors before launch


def test_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        argv = ["--nproc_per_node", "1", "--master_port", str(port), "train.py"]
        with pytest.raises(LaunchError, match=rf"--master_port {port}: the port is already in "
                                              r"use on this host .* Pick another port"):
            plan_launch(argv)
        assert main(argv) == 2
    assert f"zeroshard launch: error: --master_port {port}: the port is already in use" in (
        capsys.readouterr().err)


def test_missing_script() -> None:
    with pytest.raises(LaunchError, match=r"^script\.py: no such file"):
        plan_launch(["--nproc_per_node", "1", "script.py"])


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--nproc_per_node", "0"], r"--nproc_per_node 0: need at least 1"),
        (["--num_nodes", "0"], r"--num_nodes 0: need at least 1"),
        (["--num_nodes", "2", "--node_rank", "2"],
         r"--node_rank 2 >= --num_nodes 2: node ranks run from 0 to 1"),
        (["--num_nodes", "2"], r"--num_nodes 2 without a --hostfile"),
        (["--master_port", "70000"], r"--master_port 70000: expected a port in 1\.\.65535"),
        (["--device_ids", "0,x"], r"--device_ids '0,x': expected comma-separated"),
        (["--env_file", "missing.env"], r"missing\.env: no such env file"),
        (["--hostfile", "missing"], r"missing: no such hostfile"),
    ],
)
def test_argument_errors(argv: list[str], match: str) -> None:
    with pytest.raises(LaunchError, match=match):
        plan_launch(["--dry_run", "--nproc_per_node", "1", *argv, "train.py"]
                    if "--nproc_per_node" not in argv else ["--dry_run", *argv, "train.py"])
