"""`zeroshard launch`: start a training script on one node (torchrun) or many (ssh, pdsh, srun).

Imports nothing of ours but `zeroshard.errors` and the `zeroshard.cli.launch_*` / `hostfile`
helpers; torch is imported only to count CUDA devices when ``--nproc_per_node`` is not given.

Every check (script, hostfile, filters, env files, ranks, master port) runs before anything
starts; a problem raises `LaunchError`, which `main` prints as one line and turns into exit
status 2. A preempted job (its workers saved an emergency checkpoint on SIGTERM / SIGUSR1,
runtime/preemption.py) ends with `PREEMPTED_EXIT_CODE` (75) and a summary, not as a failure.
See docs/launch.md for the user guide.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Literal

from zeroshard.cli.hostfile import HostSlots, parse_hostfile, select_hosts
from zeroshard.cli.launch_env import collect_exports, default_env_files, parse_env_file
from zeroshard.cli.launch_runners import (
    NodeCommand,
    WorkerSpec,
    check_port_free,
    free_port,
    pdsh_command,
    run_commands,
    slurm_command,
    ssh_commands,
    torchrun_command,
)
from zeroshard.errors import PREEMPTED_EXIT_CODE, PREEMPTION_NOTES_ENV, LaunchError

__all__ = ["DEFAULT_MASTER_PORT", "LaunchPlan", "build_parser", "main", "plan_launch", "preemption_summary"]

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


def _plan_node(args: argparse.Namespace, worker: WorkerSpec, hosts: HostSlots | None,
               file_env: dict[str, str]) -> LaunchPlan:
    """This node's workers through torchrun: one-node runs and each node of a multi-node run."""
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
    if num_nodes > 1 and args.node_rank is None:
        raise LaunchError(f"--num_nodes {num_nodes} without a --hostfile: give a hostfile, or "
                          f"run 'zeroshard launch --node_rank R' on each node.")
    nproc = args.nproc_per_node
    if devices is not None:
        if nproc is not None and nproc != len(devices) and args.device_ids:
            raise LaunchError(f"--nproc_per_node {nproc} but --device_ids lists "
                              f"{len(devices)} devices; give one of them.")
        nproc = len(devices)
    nproc = nproc or _default_nproc()
    port = args.master_port or (free_port() if num_nodes == 1 else DEFAULT_MASTER_PORT)
    env = dict(file_env)
    if set_visible and devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    if node_rank == 0 and not args.dry_run:
        check_port_free(port)
    cmd = torchrun_command(worker, nnodes=num_nodes, node_rank=node_rank, nproc_per_node=nproc,
                           master_addr=master_addr or "127.0.0.1", master_port=port, env=env)
    if args.watch_stdin:  # stdin is the launcher's to watch; the workers get none
        cmd = dataclasses.replace(cmd, stdin="devnull")
    return LaunchPlan("local", [cmd], port, watch_stdin=args.watch_stdin)


def _plan_remote(args: argparse.Namespace, worker: WorkerSpec, hosts: HostSlots,
                 env_files: list[Path]) -> LaunchPlan:
    first = next(iter(hosts))
    port = args.master_port or DEFAULT_MASTER_PORT
    if _is_this_host(first) and not args.dry_run:
        check_port_free(port)
    kwargs = dict(master_addr=args.master_addr or first, master_port=port,
                  exports=collect_exports(os.environ, env_files), cwd=os.getcwd(),
                  ssh_port=args.ssh_port)
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
            plan = _plan_node(args, worker, hosts, file_env)
    return dataclasses.replace(plan, dry_run=args.dry_run)


def preemption_summary(notes: list[dict[str, object]]) -> str:
    """One paragraph from the preempted ranks' notes (runtime/preemption.py writes them): the
    emergency checkpoint and its slowest rank's seconds, or the ranks that exited without one."""
    signals = sorted({str(n.get("signal")) for n in notes})
    failed = sorted(int(str(n["rank"])) for n in notes if not n.get("checkpoint"))
    saved = [n for n in notes if n.get("checkpoint")]
    head = f"zeroshard launch: preempted ({', '.join(signals)}); "
    if failed:
        return (head + f"rank(s) {', '.join(map(str, failed))} exited without an emergency checkpoint (see their "
                "log lines); `latest` names the last complete checkpoint, which a restart resumes from. "
                f"Exit status {PREEMPTED_EXIT_CODE}: restart the job.")
    where = sorted({str(n["checkpoint"]) for n in saved})
    save_s = max(float(str(n["save_s"])) for n in saved)
    since_s = max(float(str(n["since_signal_s"])) for n in saved)
    return (head + f"emergency checkpoint {', '.join(where)} after step {saved[0]['step']}, saved in {save_s:.2f} s "
            f"({since_s:.2f} s after the signal, grace {float(str(saved[0]['grace_s'])):g} s; notes from "
            f"{len(saved)} rank(s)). Exit status {PREEMPTED_EXIT_CODE}: restart the job to resume (with "
            "checkpoint.auto_resume_dir it resumes by itself).")


def _read_notes(notes_dir: Path) -> list[dict[str, object]]:
    notes = []
    for path in sorted(notes_dir.glob("rank*.json")):
        try:
            notes.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # a note cut short: the others (and the exit status) still tell
    return notes


def _run(plan: LaunchPlan) -> int:
    """Run the plan's commands; a preempted job exits with PREEMPTED_EXIT_CODE and a summary.

    Local workers leave notes in a directory named by PREEMPTION_NOTES_ENV: torchrun exits 1
    whatever its workers' statuses were. A remote node's own launch exits 75 through ssh, and srun
    passes on its tasks' highest status."""
    notes_dir = Path(tempfile.mkdtemp(prefix="zeroshard-launch-")) if plan.mode == "local" else None
    commands = plan.commands if notes_dir is None else [
        dataclasses.replace(c, env={**c.env, PREEMPTION_NOTES_ENV: str(notes_dir)}) for c in plan.commands]
    try:
        code = run_commands(commands, watch_stdin=plan.watch_stdin)
        notes = _read_notes(notes_dir) if notes_dir is not None else []
    finally:
        if notes_dir is not None:
            shutil.rmtree(notes_dir, ignore_errors=True)
    if notes:
        print(preemption_summary(notes), file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    if code == PREEMPTED_EXIT_CODE:
        print(f"zeroshard launch: preempted: a node's workers exited with {PREEMPTED_EXIT_CODE} (see their log "
              f"lines). Exit status {PREEMPTED_EXIT_CODE}: restart the job to resume.", file=sys.stderr, flush=True)
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
