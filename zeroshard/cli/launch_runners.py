"""Command lines `zeroshard launch` runs (torchrun, ssh, pdsh, srun) and running them.

Imports nothing of ours but `zeroshard.errors` and `zeroshard.cli.launch_env` (no torch). The
builders are pure (the tests compare their output); `run_commands` starts the commands, forwards
signals, and stops the rest as soon as one fails, so a dead node never leaves the others hanging.
A `Rendezvous` turns torchrun's static master_addr/port start into its c10d rendezvous, which
restarts failed workers (``--max_restarts``) and lets the node count change (``--nnodes MIN:MAX``).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Literal

from zeroshard.cli.launch_env import export_prefix
from zeroshard.errors import LaunchError

__all__ = [
    "NodeCommand",
    "Rendezvous",
    "WorkerSpec",
    "check_port_free",
    "free_port",
    "node_launch_argv",
    "pdsh_command",
    "run_commands",
    "slurm_command",
    "ssh_commands",
    "torchrun_command",
    "with_log_dir",
]

_GRACE_S = 10.0
"""After a failure, survivors get SIGTERM and this long to exit before SIGKILL."""


@dataclass(frozen=True)
class NodeCommand:
    """One process to start on this host: its argv and the variables set on top of os.environ.

    ``stdin="pipe"`` gives the process a pipe the launcher never writes to: ssh forwards its
    end-of-file when the launcher exits (even when killed), and the remote per-node launch,
    started with ``--watch_stdin``, then stops its workers (Note: [lost connection]).
    """

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    stdin: Literal["inherit", "pipe", "devnull"] = "inherit"

    def shell(self) -> str:
        """The command as one shell line (``K=V ... argv``), as ``--dry_run`` prints it."""
        assigns = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join([*assigns, shlex.join(self.argv)])


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker runs: ``python -u script args``, ``python -u -m module args`` or
    ``script args`` (``no_python``); with ``local_rank``, ``--local_rank=<i>`` right after the
    script, as DeepSpeed's launcher passes it (cli/launch_worker.py)."""

    script: str
    script_args: list[str]
    module: bool = False
    no_python: bool = False
    local_rank: bool = True

    def _how(self) -> list[str]:
        return (["--module"] if self.module else []) + (["--no_python"] if self.no_python else [])

    def launcher_flags(self) -> list[str]:
        """The ``--module``/``--no_python``/``--no_local_rank`` flags, then the script and its arguments."""
        return [*self._how(), *([] if self.local_rank else ["--no_local_rank"]), self.script, *self.script_args]

    def torchrun_args(self) -> list[str]:
        """What torchrun runs per worker: the script itself, or (``local_rank``) the module that
        execs it with ``--local_rank=$LOCAL_RANK``."""
        if not self.local_rank:
            return [*self._how(), self.script, *self.script_args]
        mode = "exec" if self.no_python else "module" if self.module else "python"
        return ["--module", "zeroshard.cli.launch_worker", mode, self.script, *self.script_args]

    def direct_argv(self, python: str) -> list[str]:
        """The worker's argv when nothing wraps it (srun starts each worker itself)."""
        if self.no_python:
            return [self.script, *self.script_args]
        return [python, "-u", *(["-m"] if self.module else []), self.script, *self.script_args]


@dataclass(frozen=True)
class Rendezvous:
    """torchrun's c10d rendezvous for a job that restarts or changes size.

    Every node's agent meets at ``endpoint`` (``host:port``; the agent on that host holds the
    store, so that node must outlive the others) under ``run_id``; a round starts workers once
    ``min_nodes`` agents have joined and, for a range, ``last_call_timeout`` more seconds have
    passed or ``max_nodes`` joined. A failed worker makes its agent stop the node's workers and
    join a new round, up to ``max_restarts`` times; the other agents see it waiting and join too.
    ``conf`` is torchrun's ``--rdzv_conf`` text (``key=value,...``), passed as given;
    ``local_addr`` this node's address as the others reach it (torchrun's ``--local-addr``; empty:
    torchrun uses the host name, so in containers or namespaces whose names do not resolve across
    nodes the workers would look for the store at the wrong address).
    """

    min_nodes: int
    max_nodes: int
    endpoint: str
    run_id: str
    max_restarts: int
    conf: str = ""
    local_addr: str = ""

    @property
    def nnodes(self) -> str:
        """torchrun's ``--nnodes``: ``N`` for a fixed count, else ``MIN:MAX``."""
        return str(self.min_nodes) if self.min_nodes == self.max_nodes else f"{self.min_nodes}:{self.max_nodes}"


def torchrun_command(
    worker: WorkerSpec,
    *,
    nnodes: int,
    node_rank: int,
    nproc_per_node: int,
    master_addr: str,
    master_port: int,
    env: Mapping[str, str],
    python: str = sys.executable,
    rendezvous: Rendezvous | None = None,
) -> NodeCommand:
    """``python -m torch.distributed.run ...`` for this node's workers.

    torchrun's elastic agent sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* for each worker and
    stops all of them when one fails (``--max_restarts 0``), so a crash never becomes a hang.
    With a `Rendezvous` the nodes meet through c10d instead of the static ``master_addr``/port
    (``nnodes``, ``node_rank`` and ``master_*`` are then unused: the rendezvous numbers the nodes),
    and the agent restarts the workers up to ``rendezvous.max_restarts`` times.
    """
    if rendezvous is not None:
        conf = ["--rdzv_conf", rendezvous.conf] if rendezvous.conf else []
        if rendezvous.local_addr:
            conf += ["--local_addr", rendezvous.local_addr]
        argv = [
            python, "-m", "torch.distributed.run",
            "--nnodes", rendezvous.nnodes,
            "--nproc_per_node", str(nproc_per_node),
            "--rdzv_backend", "c10d",
            "--rdzv_endpoint", rendezvous.endpoint,
            "--rdzv_id", rendezvous.run_id,
            *conf,
            "--max_restarts", str(rendezvous.max_restarts),
            *worker.torchrun_args(),
        ]
        return NodeCommand(argv, dict(env))
    argv = [
        python, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes),
        "--node_rank", str(node_rank),
        "--nproc_per_node", str(nproc_per_node),
        "--master_addr", master_addr,
        "--master_port", str(master_port),
        "--max_restarts", "0",
        *worker.torchrun_args(),
    ]
    return NodeCommand(argv, dict(env))


def with_log_dir(cmd: NodeCommand, log_dir: str) -> NodeCommand:
    """``cmd`` (a `torchrun_command`) with torchrun's ``--log_dir``: torchrun makes one
    ``attempt_<k>`` directory there per attempt (k = the restart count), which `zeroshard launch`
    counts for its summary. The workers' output still goes to the console."""
    if cmd.argv[1:3] != ["-m", "torch.distributed.run"]:
        raise ValueError(f"not a torchrun command: {cmd.shell()}")
    return NodeCommand([*cmd.argv[:3], "--log_dir", log_dir, *cmd.argv[3:]], dict(cmd.env), cmd.stdin)


def node_launch_argv(
    worker: WorkerSpec,
    *,
    num_nodes: int,
    node_rank: str,
    master_addr: str,
    master_port: int,
    nproc_per_node: int | None = None,
    device_ids: Sequence[int] | None = None,
    node_devices: Sequence[Sequence[int]] | None = None,
    watch_stdin: bool = False,
    restarts: tuple[int, str, str] | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The per-node ``zeroshard launch`` that ssh/pdsh start on each host.

    It runs with ``--node_rank`` (so it takes the one-node torchrun path there) and
    ``--no_env_file`` (the launching host already exported the env files' variables).
    ``node_rank`` is a string so pdsh can pass ``%n``, which it replaces with the host's rank.
    ``restarts`` (max_restarts, rdzv_id, rdzv_conf) makes every node's agent restart its workers
    through a c10d rendezvous at ``master_addr:master_port``.
    """
    argv = [python, "-u", "-m", "zeroshard.cli.launch",
            "--num_nodes", str(num_nodes), "--node_rank", node_rank]
    if nproc_per_node is not None:
        argv += ["--nproc_per_node", str(nproc_per_node)]
    if device_ids is not None:
        argv += ["--device_ids", ",".join(map(str, device_ids))]
    if node_devices is not None:
        argv += ["--node_devices", ";".join(",".join(map(str, d)) for d in node_devices)]
    argv += ["--master_addr", master_addr, "--master_port", str(master_port), "--no_env_file"]
    if restarts is not None:
        max_restarts, run_id, conf = restarts
        argv += ["--max_restarts", str(max_restarts), "--rdzv_id", run_id, *(["--rdzv_conf", conf] if conf else [])]
    if watch_stdin:
        argv.append("--watch_stdin")
    return argv + worker.launcher_flags()


def _is_full(slots: Sequence[int]) -> bool:
    return list(slots) == list(range(len(slots)))


def ssh_commands(
    worker: WorkerSpec,
    hosts: Mapping[str, Sequence[int]],
    *,
    master_addr: str,
    master_port: int,
    exports: Mapping[str, str],
    cwd: str,
    ssh_port: int | None = None,
    restarts: tuple[int, str, str] | None = None,
    python: str = sys.executable,
) -> list[NodeCommand]:
    """One ``ssh HOST 'export ...; cd CWD; python -m zeroshard.cli.launch ...'`` per host.

    ``BatchMode=yes`` makes a host that would ask for a password fail at once instead of
    waiting at a prompt nobody sees.
    """
    commands: list[NodeCommand] = []
    for rank, (host, slots) in enumerate(hosts.items()):
        remote = node_launch_argv(
            worker, num_nodes=len(hosts), node_rank=str(rank), nproc_per_node=len(slots),
            device_ids=None if _is_full(slots) else slots, watch_stdin=True,
            master_addr=master_addr, master_port=master_port, restarts=restarts, python=python,
        )
        line = f"{export_prefix(exports)}cd {shlex.quote(cwd)}; {shlex.join(remote)}"
        port = ["-p", str(ssh_port)] if ssh_port is not None else []
        argv = ["ssh", "-o", "BatchMode=yes", *port, host, line]
        commands.append(NodeCommand(argv, stdin="pipe"))
    return commands


def pdsh_command(
    worker: WorkerSpec,
    hosts: Mapping[str, Sequence[int]],
    *,
    master_addr: str,
    master_port: int,
    exports: Mapping[str, str],
    cwd: str,
    ssh_port: int | None = None,
    restarts: tuple[int, str, str] | None = None,
    python: str = sys.executable,
) -> NodeCommand:
    """One ``pdsh -S -w h0,h1,... '<per-node launch>'`` for all hosts.

    pdsh runs the same line everywhere and replaces ``%n`` with each host's rank in the
    ``-w`` list; ``--node_devices`` gives every rank its device list, so hosts may differ.
    ``-S`` makes pdsh exit with the largest remote exit status.
    """
    node_rank = "%n" if len(hosts) > 1 else "0"  # pdsh leaves %n alone for a single host
    remote = node_launch_argv(
        worker, num_nodes=len(hosts), node_rank=node_rank,
        node_devices=[list(s) for s in hosts.values()],
        master_addr=master_addr, master_port=master_port, restarts=restarts, python=python,
    )
    line = f"{export_prefix(exports)}cd {shlex.quote(cwd)}; {shlex.join(remote)}"
    env = {"PDSH_RCMD_TYPE": "ssh"}
    if ssh_port is not None:
        env["PDSH_SSH_ARGS_APPEND"] = f"-p {ssh_port}"
    return NodeCommand(["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts), line], env)


def slurm_command(
    worker: WorkerSpec,
    *,
    num_nodes: int,
    tasks_per_node: int,
    nodelist: Sequence[str] | None,
    master_addr: str | None,
    master_port: int,
    exports: Mapping[str, str],
    python: str = sys.executable,
) -> NodeCommand:
    """``srun -N nodes --ntasks-per-node slots [--nodelist ...] python -u script args``.

    srun starts every worker itself; the script's process group is built from SLURM_PROCID,
    SLURM_NTASKS and SLURM_LOCALID (`zeroshard.comm.init_distributed`). srun forwards the
    caller's environment, so the exports ride along as plain variables.
    """
    argv = ["srun", "-N", str(num_nodes), "--ntasks-per-node", str(tasks_per_node)]
    if nodelist:
        argv += ["--nodelist", ",".join(nodelist)]
    env = dict(exports)
    env["MASTER_PORT"] = str(master_port)
    if master_addr is not None:
        env["MASTER_ADDR"] = master_addr
    return NodeCommand(argv + worker.direct_argv(python), env)


def check_port_free(port: int) -> None:
    """Raise LaunchError if ``port`` cannot be bound on this host (another job holds it).

    SO_REUSEADDR is set, as torch's TCPStore does, so a port in TIME_WAIT from a finished
    run is not mistaken for one in use.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            s.listen(1)
        except OSError as e:
            raise LaunchError(
                f"--master_port {port}: the port is already in use on this host ({e.strerror}); "
                f"node 0 must listen on it. Pick another port with --master_port "
                f"(or omit it on a single node to get a free one)."
            ) from None


def free_port() -> int:
    """A TCP port that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


_STDIN = {"inherit": None, "pipe": subprocess.PIPE, "devnull": subprocess.DEVNULL}


def _stdin_closed() -> threading.Event:
    """An event set once this process's stdin reaches end-of-file."""
    closed = threading.Event()

    def read() -> None:
        try:
            fd = sys.stdin.fileno()
            while os.read(fd, 65536):
                pass
        except (AttributeError, OSError, ValueError):  # no stdin at all counts as closed
            pass
        closed.set()

    threading.Thread(target=read, name="zeroshard-watch-stdin", daemon=True).start()
    return closed


def run_commands(commands: Sequence[NodeCommand], *, watch_stdin: bool = False,
                 poll_s: float = 0.1, received: list[int] | None = None) -> int:
    """Start every command, wait, and return the first non-zero exit code (else 0).

    ``received``, when given, collects the signals the launcher passed on (SIGTERM for a closed stdin).

    When one command fails the others are terminated at once; SIGTERM / SIGHUP received by the
    launcher are passed on to the children, so killing the launcher kills the job. SIGUSR1 (SLURM's
    `--signal=USR1@T` before a time limit) is passed on as SIGTERM: torchrun has no handler for it
    and would die leaving its workers running, and the workers save an emergency checkpoint on
    either (`checkpoint.preemption_save`, runtime/preemption.py).

    Note: [lost connection]. Without a terminal, a remote process does not notice that its ssh
    connection is gone. So the launching host holds a pipe on each ssh's stdin, and the remote
    per-node launch runs with ``watch_stdin``: end-of-file on stdin (the launcher finished, died,
    or the connection dropped) stops its workers, as if SIGTERM had arrived.
    """
    procs: list[subprocess.Popen[bytes]] = []
    stdin_closed = _stdin_closed() if watch_stdin else None

    def forward(signum: int, frame: FrameType | None) -> None:
        if received is not None:
            received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if signum == signal.SIGUSR1 else signum)

    # Handlers can only be installed from the main thread (an embedding caller may differ).
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)} if in_main else {}
    try:
        for s in previous:
            signal.signal(s, forward)
        for cmd in commands:
            procs.append(subprocess.Popen(cmd.argv, env={**os.environ, **cmd.env},
                                          stdin=_STDIN[cmd.stdin]))
        while True:
            if stdin_closed is not None and stdin_closed.is_set():
                print("zeroshard launch: stdin closed (launcher or connection gone); "
                      "stopping the workers", file=sys.stderr, flush=True)
                if received is not None:
                    received.append(signal.SIGTERM)
                _stop(procs)
                return 128 + signal.SIGTERM
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs)
                code = int(failed[0])
                return 128 - code if code < 0 else code  # killed by signal N -> 128 + N
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    except KeyboardInterrupt:
        if received is not None:
            received.append(signal.SIGINT)
        _stop(procs)
        return 130
    except FileNotFoundError as e:
        _stop(procs)
        raise LaunchError(f"{e.filename}: command not found; install it or pick another "
                          f"--launcher.") from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
