"""`zeroshard launch`: start a training script on one node (torchrun) or many (ssh, pdsh, srun).

Imports nothing of ours but `zeroshard.errors` and the `zeroshard.cli.launch_*` / `hostfile`
helpers; torch is imported only to count CUDA devices when ``--nproc_per_node`` is not given.

Every check (script, hostfile, filters, env files, ranks, master port, restarts and node range)
runs before anything starts; a problem raises `LaunchError`, which `main` prints as one line and
turns into exit status 2. A preempted job (its workers saved an emergency checkpoint on SIGTERM /
SIGUSR1, runtime/preemption.py) ends with `PREEMPTED_EXIT_CODE` (75) and a summary, not as a failure.

``--max_restarts N`` and ``--nnodes MIN:MAX`` switch torchrun from its static start to its c10d
rendezvous (`Rendezvous`): its agent restarts failed workers (exit 75 included) and the node count
may change between attempts. After a local job the launcher prints `restart_summary`
(cli/launch_report.py): the restarts it counted in torchrun's ``--log_dir`` (one ``attempt_<k>``
directory per attempt), what ended each attempt, the exit status, and, when restarts ran out, the
last checkpoint. The launcher reads
``checkpoint.auto_resume_dir`` only from a ds_config JSON file named in the script's arguments
(``--deepspeed_config``, ``--zeroshard_config``, HF's ``--deepspeed FILE.json``); a config built in
Python is unknown to it, and the summary says so. See docs/launch.md for the user guide.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Literal

from zeroshard.cli.hostfile import HostSlots, parse_hostfile, select_hosts
from zeroshard.cli.launch_env import collect_exports, default_env_files, parse_env_file
from zeroshard.cli.launch_report import (
    attempt_starts,
    last_checkpoint,
    membership_restart,
    preempted_attempts,
    preemption_summary,
    read_notes,
    restart_summary,
    resume_dir_of,
)
from zeroshard.cli.launch_runners import (
    NodeCommand,
    Rendezvous,
    WorkerSpec,
    check_port_free,
    free_port,
    pdsh_command,
    run_commands,
    slurm_command,
    ssh_commands,
    torchrun_command,
    with_log_dir,
)
from zeroshard.errors import PREEMPTED_EXIT_CODE, PREEMPTION_NOTES_ENV, LaunchError

__all__ = ["DEFAULT_MASTER_PORT", "LaunchPlan", "build_parser", "main", "parse_nnodes", "plan_launch",
           "preemption_summary", "restart_summary"]

DEFAULT_MASTER_PORT = 29500
"""torchrun's and DeepSpeed's default; used whenever more than one node must agree on it."""


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What `main` will run: the commands, how they reach the nodes, and what it checked."""

    mode: Literal["local", "ssh", "pdsh", "slurm"]
    commands: list[NodeCommand]
    master_port: int
    dry_run: bool = False
    watch_stdin: bool = False
    rendezvous: Rendezvous | None = None
    """This node's c10d rendezvous (local mode with ``--max_restarts`` or ``--nnodes MIN:MAX``)."""
    max_restarts: int = 0
    resume_dir: str | None = None
    """``checkpoint.auto_resume_dir`` of the ds_config JSON named in the script's arguments, if any."""


def build_parser() -> argparse.ArgumentParser:
    """The ``zeroshard launch`` argument parser (underscore and dash spellings both work)."""
    p = argparse.ArgumentParser(
        prog="zeroshard launch", allow_abbrev=False,
        description="Run a training script on one or more nodes. One node: through torchrun. "
        "Several nodes from a hostfile: one per-node launch over ssh or pdsh, or srun.",
    )
    a = p.add_argument
    a("--num_gpus", "--num-gpus", "--nproc_per_node", "--nproc-per-node", dest="nproc_per_node",
      type=int, default=None, metavar="N",
      help="processes per node (default: the CUDA device count, or 1 on CPU; "
      "with a hostfile: the first N slots of each host)")
    a("--num_nodes", "--num-nodes", type=int, default=None, metavar="N",
      help="number of nodes (with a hostfile: use its first N hosts)")
    a("--nnodes", default=None, metavar="N|MIN:MAX",
      help="N: the same as --num_nodes. MIN:MAX: an elastic job, one 'zeroshard launch' per node "
      "meeting at --master_addr:--master_port; it starts with up to MAX nodes and goes on (after a "
      "restart) with as few as MIN. Not with a hostfile")
    a("--max_restarts", "--max-restarts", type=int, default=0, metavar="N",
      help="restart the workers up to N times after a failure, through torchrun's c10d rendezvous "
      "(default 0: a failed worker ends the job)")
    a("--rdzv_id", "--rdzv-id", default=None, metavar="ID",
      help="with --max_restarts or --nnodes MIN:MAX: the job's rendezvous id, the same on every node "
      "(default: zeroshard-<master port>)")
    a("--rdzv_conf", "--rdzv-conf", default=None, metavar="K=V,...",
      help="with --max_restarts or --nnodes MIN:MAX: torchrun's rendezvous settings, e.g. "
      "'last_call_timeout=10,join_timeout=300'")
    a("--local_addr", "--local-addr", default=None, metavar="ADDR",
      help="with --max_restarts or --nnodes MIN:MAX: this node's address as the other nodes reach it "
      "(torchrun's --local-addr; default: this host's name, which must then resolve on every node)")
    a("--node_rank", "--node-rank", type=int, default=None, metavar="R",
      help="this node's rank: run only this node's workers, torchrun style")
    a("-H", "--hostfile", default=None, metavar="FILE", help="'HOST slots=N' lines")
    a("-i", "--include", default=None, metavar="SPEC",
      help="hosts/slots to use, e.g. 'worker-0@worker-1:0,2'")
    a("-e", "--exclude", default=None, metavar="SPEC",
      help="hosts/slots to leave out, same syntax as --include")
    a("--master_addr", "--master-addr", default=None, metavar="ADDR",
      help="address of node 0 (default: the first host, or 127.0.0.1)")
    a("--master_port", "--master-port", type=int, default=None, metavar="PORT",
      help=f"rendezvous port on node 0 (default: a free port on one node, "
      f"{DEFAULT_MASTER_PORT} across nodes)")
    a("--launcher", choices=("ssh", "pdsh", "slurm"), default="ssh",
      help="how to reach the hosts of a multi-node run (default: ssh)")
    a("--ssh_port", "--ssh-port", type=int, default=None, metavar="PORT", help="ssh port")
    a("--force_multi", "--force-multi", action="store_true",
      help="use the multi-node launcher even for a hostfile with one host")
    a("--env_file", "--env-file", default=None, metavar="FILE",
      help="KEY=VALUE file exported to all workers (default: ~/.deepspeed_env, "
      "~/.zeroshard_env, ./.deepspeed_env, ./.zeroshard_env)")
    a("--no_env_file", "--no-env-file", action="store_true",
      help="read no env file (the per-node launches use this)")
    a("--device_ids", "--device-ids", default=None, metavar="LIST",
      help="device indices for this node, e.g. '0,2' (sets CUDA_VISIBLE_DEVICES)")
    a("--node_devices", "--node-devices", default=None, help=argparse.SUPPRESS)
    a("--watch_stdin", "--watch-stdin", action="store_true",
      help="stop the workers when stdin closes (the ssh launcher's per-node launches use "
      "this, so a lost connection stops the node)")
    a("--no_python", "--no-python", action="store_true",
      help="run the script as an executable, without 'python'")
    a("-m", "--module", action="store_true", help="the script is a module name (python -m)")
    a("--no_local_rank", "--no-local-rank", action="store_true",
      help="do not pass --local_rank=<i> to the script (passed by default, right after the script, "
      "as DeepSpeed's launcher does; LOCAL_RANK is set either way)")
    a("--as_deepspeed", "--as-deepspeed", action="store_true",
      help="serve `import deepspeed` from zeroshard in every worker (sets "
      "ZEROSHARD_AS_DEEPSPEED=1 for them; see docs/huggingface.md)")
    a("--dry_run", "--dry-run", action="store_true",
      help="print the commands instead of running them")
    a("script", help="the training script (or module, or executable)")
    a("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _device_list(text: str, flag: str) -> list[int]:
    try:
        devices = [int(d) for d in text.split(",")]
    except ValueError:
        raise LaunchError(f"{flag} {text!r}: expected comma-separated device indices, "
                          f"e.g. '0,2'.") from None
    if not devices or min(devices) < 0 or len(set(devices)) != len(devices):
        raise LaunchError(f"{flag} {text!r}: expected distinct non-negative device indices.")
    return devices


def _default_nproc() -> int:
    """One process per CUDA device; on a machine without CUDA, one process."""
    import torch  # here only: the launcher itself does not need torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def parse_nnodes(text: str) -> tuple[int, int]:
    """``--nnodes`` as (MIN, MAX): ``"4"`` -> (4, 4), ``"1:4"`` -> (1, 4).

    Raises:
        LaunchError: not ``N`` or ``MIN:MAX`` with 1 <= MIN <= MAX.
    """
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    if m is None:
        raise LaunchError(f"--nnodes {text!r}: expected N or MIN:MAX, e.g. 2 or 1:4.")
    low = int(m.group(1))
    high = low if m.group(2) is None else int(m.group(2))
    if low < 1:
        what = "MIN must be" if m.group(2) is not None else "need"
        raise LaunchError(f"--nnodes {text}: {what} at least 1 (a job needs a node to run on).")
    if low > high:
        raise LaunchError(f"--nnodes {text}: MIN {low} is above MAX {high}; write MIN:MAX, e.g. {high}:{low}.")
    return low, high


_RDZV_CONF = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=[^,=]*(,[A-Za-z_][A-Za-z0-9_]*=[^,=]*)*")


def _check_restarts(args: argparse.Namespace) -> tuple[int, int] | None:
    """Check ``--nnodes``, ``--max_restarts`` and the ``--rdzv_*`` flags; return the node range
    when ``--nnodes`` is ``MIN:MAX`` (a plain ``--nnodes N`` becomes ``--num_nodes N``)."""
    if args.max_restarts < 0:
        raise LaunchError(f"--max_restarts {args.max_restarts}: need 0 or more (0: a failed worker ends the job).")
    span: tuple[int, int] | None = None
    if args.nnodes is not None:
        low, high = parse_nnodes(args.nnodes)
        if ":" in args.nnodes:
            span = (low, high)
            if args.num_nodes is not None:
                raise LaunchError(f"--nnodes {args.nnodes} with --num_nodes {args.num_nodes}: give one of them.")
        elif args.num_nodes is not None and args.num_nodes != low:
            raise LaunchError(f"--nnodes {low} and --num_nodes {args.num_nodes} disagree; give one of them.")
        else:
            args.num_nodes = low
    if span is not None and args.hostfile:
        raise LaunchError(
            f"--nnodes {args.nnodes} with --hostfile: a hostfile names a fixed set of hosts, and the launcher "
            f"stops them all when one fails. For an elastic job run 'zeroshard launch --nnodes {args.nnodes} "
            "--master_addr ADDR ...' on each node; with a hostfile, --max_restarts N restarts failed workers.")
    if args.launcher == "slurm" and (span is not None or args.max_restarts > 0):
        flag = f"--nnodes {args.nnodes}" if span is not None else f"--max_restarts {args.max_restarts}"
        raise LaunchError(f"{flag} with --launcher slurm: srun starts the workers itself, with no agent to restart "
                          "them; requeue the job instead (sbatch --requeue, or on exit status 75).")
    if span is None and args.max_restarts == 0:
        for flag, value in (("--rdzv_id", args.rdzv_id), ("--rdzv_conf", args.rdzv_conf),
                            ("--local_addr", args.local_addr)):
            if value is not None:
                raise LaunchError(f"{flag} without --max_restarts N or --nnodes MIN:MAX: only the c10d "
                                  "rendezvous uses it.")
    if args.local_addr is not None and args.hostfile is not None:
        raise LaunchError(f"--local_addr {args.local_addr} with --hostfile: each host is reached by its hostfile "
                          "name; drop --local_addr, or write the addresses into the hostfile.")
    if args.rdzv_conf is not None and not _RDZV_CONF.fullmatch(args.rdzv_conf):
        raise LaunchError(f"--rdzv_conf {args.rdzv_conf!r}: expected key=value pairs joined by commas, e.g. "
                          "'last_call_timeout=10,join_timeout=300'.")
    if args.rdzv_id is not None and not re.fullmatch(r"[\w.-]+", args.rdzv_id):
        raise LaunchError(f"--rdzv_id {args.rdzv_id!r}: use letters, digits, '_', '-' and '.' only.")
    return span


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value in (("--nproc_per_node", args.nproc_per_node),
                        ("--num_nodes", args.num_nodes)):
        if value is not None and value < 1:
            raise LaunchError(f"{flag} {value}: need at least 1.")
    if args.node_rank is not None and args.node_rank < 0:
        raise LaunchError(f"--node_rank {args.node_rank}: node ranks start at 0.")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise LaunchError(f"--master_port {args.master_port}: expected a port in 1..65535.")
    if args.launcher == "slurm" and args.node_rank is not None:
        raise LaunchError("--node_rank with --launcher slurm: srun numbers the nodes; drop it.")


def _check_script(worker: WorkerSpec) -> None:
    if worker.module:
        return
    found = Path(worker.script).is_file() or (
        worker.no_python and shutil.which(worker.script) is not None)
    if not found:
        raise LaunchError(f"{worker.script}: no such file (looked from {os.getcwd()}). "
                          f"Pass the path of the training script after the launcher options.")


def _env_files(args: argparse.Namespace) -> list[Path]:
    if args.no_env_file:
        return []
    return [Path(args.env_file)] if args.env_file else default_env_files()


def _select(args: argparse.Namespace) -> HostSlots | None:
    """The hosts and slots of the run, or None for a plain local run."""
    if args.hostfile:
        pool = parse_hostfile(args.hostfile)
        source = str(args.hostfile)
    elif args.include or args.exclude:
        pool = {"localhost": _default_nproc()}
        source = "this machine (localhost)"
    else:
        return None
    return select_hosts(pool, include=args.include, exclude=args.exclude,
                        num_nodes=args.num_nodes if args.hostfile else None,
                        num_gpus=args.nproc_per_node, source=source)


def _is_this_host(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set to 1 for rendezvous jobs (unless the user set it): with torch's default, the rank-0 agent's
store is shared with the workers, and an agent that joins a later round never gets its address
(it waits for MASTER_ADDR, the others for it, until the 60 s store timeout), so a node could not
join a running elastic job."""


def _rendezvous(args: argparse.Namespace, span: tuple[int, int] | None, num_nodes: int,
                master_addr: str | None, port: int) -> Rendezvous:
    low, high = span or (num_nodes, num_nodes)
    if high > 1 and master_addr is None:
        what = f"--nnodes {args.nnodes}" if span is not None else f"--num_nodes {num_nodes} with --max_restarts"
        raise LaunchError(f"{what}: give --master_addr, the address every node's agent meets at (that node "
                          "holds the rendezvous, so it must outlive the others), and the same --master_port.")
    host = master_addr or "127.0.0.1"
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return Rendezvous(low, high, endpoint, args.rdzv_id or f"zeroshard-{port}", args.max_restarts,
                      args.rdzv_conf or "", args.local_addr or "")


def _plan_node(args: argparse.Namespace, worker: WorkerSpec, hosts: HostSlots | None,
               file_env: dict[str, str], span: tuple[int, int] | None = None) -> LaunchPlan:
    """This node's workers through torchrun: one-node runs and each node of a multi-node run."""
    elastic = span is not None or args.max_restarts > 0
    if span is not None and args.node_rank is not None:
        raise LaunchError(f"--node_rank with --nnodes {args.nnodes}: the rendezvous numbers the nodes of an "
                          "elastic job; drop --node_rank.")
    num_nodes = args.num_nodes or 1
    node_rank = args.node_rank or 0
    devices: list[int] | None = None
    set_visible = False
    master_addr = args.master_addr
    if args.node_devices:  # pdsh: every node's device list, indexed by the rank pdsh gave us
        per_node = [_device_list(d, "--node_devices") for d in args.node_devices.split(";")]
        if args.num_nodes is not None and args.num_nodes != len(per_node):
            raise LaunchError(f"--num_nodes {args.num_nodes} but --node_devices lists "
                              f"{len(per_node)} nodes.")
        num_nodes = len(per_node)
        if node_rank < num_nodes:
            devices = per_node[node_rank]
    elif hosts is not None:
        if args.node_rank is not None:
            num_nodes = len(hosts)
        master_addr = master_addr or (next(iter(hosts)) if args.node_rank is not None else None)
        if node_rank < len(hosts):
            devices = list(hosts.values())[node_rank]
    if args.device_ids:
        devices, set_visible = _device_list(args.device_ids, "--device_ids"), True
    if devices is not None and devices != list(range(len(devices))):
        set_visible = True
    if node_rank >= num_nodes:
        raise LaunchError(f"--node_rank {node_rank} >= --num_nodes {num_nodes}: node ranks run "
                          f"from 0 to {num_nodes - 1}.")
    if num_nodes > 1 and args.node_rank is None and not elastic:
        raise LaunchError(f"--num_nodes {num_nodes} without a --hostfile: give a hostfile, or "
                          f"run 'zeroshard launch --node_rank R' on each node.")
    nproc = args.nproc_per_node
    if devices is not None:
        if nproc is not None and nproc != len(devices) and args.device_ids:
            raise LaunchError(f"--nproc_per_node {nproc} but --device_ids lists "
                              f"{len(devices)} devices; give one of them.")
        nproc = len(devices)
    nproc = nproc or _default_nproc()
    alone = (span or (num_nodes, num_nodes))[1] == 1
    port = args.master_port or (free_port() if alone else DEFAULT_MASTER_PORT)
    env = dict(file_env)
    if set_visible and devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    rdzv = _rendezvous(args, span, num_nodes, master_addr, port) if elastic else None
    if rdzv is not None and SHARE_STORE_ENV not in os.environ and SHARE_STORE_ENV not in env:
        env[SHARE_STORE_ENV] = "1"
    # Static: node 0 listens on the port. Rendezvous: whichever agent binds it first holds the
    # store and the others connect, so only a job alone on this machine can check it.
    if (alone if elastic else node_rank == 0) and not args.dry_run:
        check_port_free(port)
    cmd = torchrun_command(worker, nnodes=num_nodes, node_rank=node_rank, nproc_per_node=nproc,
                           master_addr=master_addr or "127.0.0.1", master_port=port, env=env, rendezvous=rdzv)
    if args.watch_stdin:  # stdin is the launcher's to watch; the workers get none
        cmd = dataclasses.replace(cmd, stdin="devnull")
    return LaunchPlan("local", [cmd], port, watch_stdin=args.watch_stdin, rendezvous=rdzv,
                      max_restarts=args.max_restarts)


def _plan_remote(args: argparse.Namespace, worker: WorkerSpec, hosts: HostSlots,
                 env_files: list[Path]) -> LaunchPlan:
    first = next(iter(hosts))
    port = args.master_port or DEFAULT_MASTER_PORT
    if _is_this_host(first) and not args.dry_run:
        check_port_free(port)
    restarts = (args.max_restarts, args.rdzv_id or f"zeroshard-{port}", args.rdzv_conf or "")
    kwargs = dict(master_addr=args.master_addr or first, master_port=port,
                  exports=collect_exports(os.environ, env_files), cwd=os.getcwd(),
                  ssh_port=args.ssh_port, restarts=restarts if args.max_restarts > 0 else None)
    if args.launcher == "pdsh":
        if not args.dry_run and shutil.which("pdsh") is None:
            raise LaunchError("--launcher pdsh: pdsh is not installed here; install it "
                              "or use --launcher ssh.")
        return LaunchPlan("pdsh", [pdsh_command(worker, hosts, **kwargs)], port)
    return LaunchPlan("ssh", ssh_commands(worker, hosts, **kwargs), port)


def _plan_slurm(args: argparse.Namespace, worker: WorkerSpec, file_env: dict[str, str]
                ) -> LaunchPlan:
    port = args.master_port or DEFAULT_MASTER_PORT
    nodelist: list[str] | None = None
    if args.hostfile:
        hosts = _select(args)
        if hosts is None:
            raise AssertionError("expected hosts from the hostfile, got None")
        sizes = {len(s) for s in hosts.values()}
        if len(sizes) != 1 or any(s != list(range(len(s))) for s in hosts.values()):
            raise LaunchError(
                "--launcher slurm runs the same number of tasks on every node, on devices "
                f"0..N-1; the selection gives {dict(hosts)}. Use whole hosts with equal slots, "
                "or --num_gpus N.")
        nodelist, num_nodes, tasks = list(hosts), len(hosts), sizes.pop()
    else:
        if args.include or args.exclude:
            raise LaunchError("--include/--exclude with --launcher slurm need a --hostfile; "
                              "or let the allocation choose (sbatch --nodelist).")
        num_nodes, tasks = args.num_nodes or 1, args.nproc_per_node or _default_nproc()
    # No MASTER_ADDR from the hostfile: srun orders the step's nodes its own way, and the
    # workers find task 0's node in SLURM_STEP_NODELIST (zeroshard.comm.env.slurm_master_addr).
    cmd = slurm_command(worker, num_nodes=num_nodes, tasks_per_node=tasks, nodelist=nodelist,
                        master_addr=args.master_addr, master_port=port, exports=file_env)
    return LaunchPlan("slurm", [cmd], port)


def plan_launch(argv: list[str]) -> LaunchPlan:
    """Parse and check a ``zeroshard launch`` command line; return what it would run.

    Args:
        argv: the arguments after ``zeroshard launch``.

    Returns:
        A `LaunchPlan`; with ``--dry_run`` the master port is not probed.

    Raises:
        LaunchError: missing script, bad hostfile / filter / env file, inconsistent ranks,
            or (node 0 on this host) a master port already in use.
        SystemExit: argparse's usage errors (unknown option, missing script).

    Example::

        >>> plan = plan_launch(["--dry_run", "--nproc_per_node", "2", "train.py"])  # doctest: +SKIP
        >>> plan.commands[0].shell()  # doctest: +SKIP
        '/usr/bin/python -m torch.distributed.run --nnodes 1 --node_rank 0 ... train.py'
    """
    args = build_parser().parse_args(argv)
    span = _check_restarts(args)
    _check_numbers(args)
    worker = WorkerSpec(args.script, list(args.script_args), args.module, args.no_python,
                        local_rank=not args.no_local_rank)
    _check_script(worker)
    env_files = _env_files(args)
    file_env: dict[str, str] = {}
    for path in env_files:
        file_env.update(parse_env_file(path))
    if args.as_deepspeed:
        # Local workers inherit it from file_env; remote nodes and their per-node launches get
        # it with the other ZEROSHARD_* variables of this process (collect_exports).
        os.environ["ZEROSHARD_AS_DEEPSPEED"] = "1"
        file_env["ZEROSHARD_AS_DEEPSPEED"] = "1"
    if args.launcher == "slurm":
        plan = _plan_slurm(args, worker, file_env)
    else:
        hosts = None if args.node_devices else _select(args)
        multi = args.hostfile and hosts is not None and (len(hosts) > 1 or args.force_multi)
        if multi and hosts is not None and args.node_rank is None:
            plan = _plan_remote(args, worker, hosts, env_files)
        else:
            plan = _plan_node(args, worker, hosts, file_env, span)
    return dataclasses.replace(plan, dry_run=args.dry_run, resume_dir=resume_dir_of(worker.script_args))


def _run(plan: LaunchPlan) -> int:
    """Run the plan's commands; a preempted job exits with PREEMPTED_EXIT_CODE and a summary.

    Local workers leave notes in a directory named by PREEMPTION_NOTES_ENV: torchrun exits 1
    whatever its workers' statuses were. A remote node's own launch exits 75 through ssh, and srun
    passes on its tasks' highest status. A rendezvous job (restarts, node range) also gets torchrun's
    ``--log_dir`` there, whose ``attempt_<k>`` directories count the restarts for `restart_summary`;
    only the notes of its last attempt make the job's status 75 (an earlier preemption was restarted)."""
    notes_dir = Path(tempfile.mkdtemp(prefix="zeroshard-launch-")) if plan.mode == "local" else None
    commands = plan.commands if notes_dir is None else [
        dataclasses.replace(c, env={**c.env, PREEMPTION_NOTES_ENV: str(notes_dir)}) for c in plan.commands]
    log_dir = notes_dir / "torchrun" if notes_dir is not None and plan.rendezvous is not None else None
    if log_dir is not None:
        commands = [with_log_dir(c, str(log_dir)) for c in commands]
    starts: dict[int, float] = {}
    received: list[int] = []
    try:
        code = run_commands(commands, watch_stdin=plan.watch_stdin, received=received)
        notes = read_notes(notes_dir) if notes_dir is not None else []
        if log_dir is not None:
            starts = attempt_starts(log_dir)
    finally:
        if notes_dir is not None:
            shutil.rmtree(notes_dir, ignore_errors=True)
    stopped_by = signal.Signals(received[0]).name if received else None
    if log_dir is not None:  # a rendezvous job: count the attempts
        preempted = preempted_attempts(notes, starts)
        last = max(starts) if starts else None
        if code != 0 and last in preempted:
            code = PREEMPTED_EXIT_CODE
        print(restart_summary(code, last, plan.max_restarts, preempted=preempted, resume_dir=plan.resume_dir,
                              checkpoint=last_checkpoint(plan.resume_dir), stopped_by=stopped_by,
                              membership=membership_restart(notes, starts)),
              file=sys.stderr, flush=True)
        if code == PREEMPTED_EXIT_CODE and last is not None:
            final = [note for written, note in notes if written >= starts[last]]
            if final:
                print(preemption_summary(final), file=sys.stderr, flush=True)
        return code
    if notes:
        print(preemption_summary([note for _, note in notes]), file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    if code == PREEMPTED_EXIT_CODE:
        print(f"zeroshard launch: preempted: a node's workers exited with {PREEMPTED_EXIT_CODE} (see their log "
              f"lines). Exit status {PREEMPTED_EXIT_CODE}: restart the job to resume.", file=sys.stderr, flush=True)
    elif code != 0 and plan.mode == "local":
        print(restart_summary(code, 0, 0, resume_dir=plan.resume_dir, checkpoint=last_checkpoint(plan.resume_dir),
                              stopped_by=stopped_by), file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run ``zeroshard launch``; return the job's exit status (2 for a launch error, 75 when the
    workers were preempted: restart the job).

    Example::

        $ zeroshard launch --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json
        $ zeroshard launch --hostfile hosts --include worker-0@worker-1:0,2 train.py
    """
    argv = sys.argv[1:] if argv is None else argv
    try:
        plan = plan_launch(argv)
        if plan.dry_run:
            for cmd in plan.commands:
                print(cmd.shell(), flush=True)
            return 0
        return _run(plan)
    except LaunchError as e:
        print(f"zeroshard launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
