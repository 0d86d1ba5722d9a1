"""Who am I in the job: pure parsing of launcher environments (torchrun, SLURM srun, OpenMPI).

Every function here is a function of a ``Mapping[str, str]`` so it can be tested without a
process group or a launcher. Imports nothing of ours but ``errors``; never torch.distributed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from zeroshard.errors import CommError

Launcher = Literal["torchrun", "openmpi", "slurm", "init_method"]

DEFAULT_MASTER_PORT = 29500
DEFAULT_TIMEOUT_S = 1800.0
TIMEOUT_ENV = "ZEROSHARD_COMM_TIMEOUT_S"


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchEnv:
    """Where this process sits in a multi-process job, as a launcher described it."""

    launcher: Launcher
    """Which launcher's variables were read."""
    rank: int
    """Global rank, 0 <= rank < world_size."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank among the processes on this node (selects the accelerator)."""
    local_world_size: int
    """Number of processes on this node."""
    master_addr: str
    """Host of rank 0's rendezvous store."""
    master_port: int
    """Port of rank 0's rendezvous store."""


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        if default is None:
            raise CommError(f"environment variable {key} is not set, but the launcher's other "
                            f"variables are; set {key} or launch with torchrun.")
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise CommError(f"environment variable {key}={raw!r} is not an integer.") from None


def _check(launch: LaunchEnv) -> LaunchEnv:
    if launch.world_size < 1:
        raise CommError(f"{launch.launcher}: world size {launch.world_size} must be >= 1.")
    if not 0 <= launch.rank < launch.world_size:
        raise CommError(f"{launch.launcher}: rank {launch.rank} is outside "
                        f"[0, {launch.world_size}).")
    if not 0 <= launch.local_rank < max(launch.local_world_size, 1):
        raise CommError(f"{launch.launcher}: local rank {launch.local_rank} is outside "
                        f"[0, {launch.local_world_size}).")
    if not 0 < launch.master_port < 65536:
        raise CommError(f"{launch.launcher}: MASTER_PORT {launch.master_port} is not a port.")
    return launch


def parse_launch_env(env: Mapping[str, str]) -> LaunchEnv | None:
    """Read the launcher's variables from ``env``; None when no launcher started us.

    Precedence: torchrun (``RANK``/``WORLD_SIZE``; also what ``zeroshard launch`` sets), then
    OpenMPI (``OMPI_COMM_WORLD_*``; mpirun inside a SLURM allocation also sees SLURM's
    variables, so MPI's win), then SLURM's srun (``SLURM_PROCID``).

    Raises:
        CommError: a launcher's variables are incomplete or inconsistent.
    """
    if "RANK" in env or "WORLD_SIZE" in env:
        return _parse_torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _parse_openmpi(env)
    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        return _parse_slurm(env)
    return None


def _parse_torchrun(env: Mapping[str, str]) -> LaunchEnv:
    world_size = _int(env, "WORLD_SIZE")
    rank = _int(env, "RANK")
    # Without LOCAL_RANK (Kubernetes' PyTorchJob: one process per pod), this is the node's
    # only process.
    local_rank = _int(env, "LOCAL_RANK", 0)
    return _check(LaunchEnv(
        launcher="torchrun", rank=rank, world_size=world_size, local_rank=local_rank,
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", max(local_rank + 1, 1)),
        master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT)))


def _parse_openmpi(env: Mapping[str, str]) -> LaunchEnv:
    world_size = _int(env, "OMPI_COMM_WORLD_SIZE")
    local_world_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world_size)
    master_addr = env.get("MASTER_ADDR")
    if not master_addr:
        if local_world_size < world_size:
            # Several nodes and nobody said where rank 0 lives: 127.0.0.1 would make every node
            # host its own store and wait forever for the others.
            raise CommError(
                f"OpenMPI job spans several nodes ({world_size} ranks, {local_world_size} on "
                "this node) but MASTER_ADDR is not set; export MASTER_ADDR=<host of rank 0> "
                "(mpirun -x MASTER_ADDR=...).")
        master_addr = "127.0.0.1"
    return _check(LaunchEnv(
        launcher="openmpi", rank=_int(env, "OMPI_COMM_WORLD_RANK"), world_size=world_size,
        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
        local_world_size=local_world_size, master_addr=master_addr,
        master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT)))


def _parse_slurm(env: Mapping[str, str]) -> LaunchEnv:
    # SLURM_STEP_NUM_TASKS describes this srun step; SLURM_NTASKS the whole allocation.
    world_size = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
    node_id = _int(env, "SLURM_NODEID", 0)
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    per_node = parse_tasks_per_node(tasks) if tasks else []
    if node_id < len(per_node):
        local_world_size = per_node[node_id]
    else:
        local_world_size = _int(env, "SLURM_NTASKS_PER_NODE", world_size)
    return _check(LaunchEnv(
        launcher="slurm", rank=_int(env, "SLURM_PROCID"), world_size=world_size,
        local_rank=_int(env, "SLURM_LOCALID", 0), local_world_size=local_world_size,
        master_addr=slurm_master_addr(env),
        master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT)))


def slurm_master_addr(env: Mapping[str, str]) -> str:
    """Host of SLURM rank 0: ``MASTER_ADDR``, else the first node of the step's node list.

    srun places task 0 on the first node of the step, so that node hosts the store.
    ``SLURM_LAUNCH_NODE_IPADDR`` (where srun itself ran, possibly a login node that runs no
    task) is only the last resort.
    """
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(key):
            hosts = expand_hostlist(env[key])
            if hosts:
                return hosts[0]
    if env.get("SLURM_LAUNCH_NODE_IPADDR"):
        return env["SLURM_LAUNCH_NODE_IPADDR"]
    return "127.0.0.1"


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: ``a[1-2,4],b`` -> ``["a[1-2,4]", "b"]``."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise CommError(f"node list {text!r}: unbalanced ']'.")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise CommError(f"node list {text!r}: unbalanced '['.")
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_range(spec: str, whole: str) -> list[str]:
    """``01-03`` -> ``["01", "02", "03"]`` (zero padding kept); ``7`` -> ``["7"]``."""
    lo, sep, hi = spec.partition("-")
    if not lo.isdigit() or (sep and not hi.isdigit()):
        raise CommError(f"node list {whole!r}: cannot read range {spec!r}.")
    if not sep:
        return [lo]
    width = len(lo) if lo.startswith("0") else 0
    start, stop = int(lo), int(hi)
    if stop < start:
        raise CommError(f"node list {whole!r}: range {spec!r} runs backwards.")
    return [str(i).zfill(width) for i in range(start, stop + 1)]


_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def _expand_one(host: str, whole: str) -> list[str]:
    match = _BRACKET.search(host)
    if match is None:
        return [host]
    head, tail = host[:match.start()], host[match.end():]
    out: list[str] = []
    for spec in match.group(1).split(","):
        for value in _expand_range(spec.strip(), whole):
            # The tail may hold further bracket groups (rack[1-2]-node[01-02]).
            out.extend(_expand_one(head + value + tail, whole))
    return out


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a SLURM host list: ``"node[01-03,07],gpu5"`` -> node01, node02, node03, node07, gpu5.

    Raises:
        CommError: the list is malformed (unbalanced brackets, unreadable range).
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(part, nodelist))
    return hosts


_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE``: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        CommError: an entry is neither ``N`` nor ``N(xM)``.
    """
    counts: list[int] = []
    for item in spec.split(","):
        match = _TASKS.match(item.strip())
        if match is None:
            raise CommError(f"SLURM_TASKS_PER_NODE={spec!r}: cannot read {item!r}.")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def resolve_timeout_s(timeout_s: float | None, env: Mapping[str, str]) -> float:
    """The collective timeout: the argument, else ``ZEROSHARD_COMM_TIMEOUT_S``, else 30 min.

    Raises:
        CommError: the value is not a positive number.
    """
    source = "timeout_s"
    value: float | str | None = timeout_s
    if value is None and env.get(TIMEOUT_ENV):
        source, value = TIMEOUT_ENV, env[TIMEOUT_ENV]
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise CommError(f"{source}={value!r} is not a number of seconds.") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise CommError(f"{source}={value!r} must be a finite number of seconds > 0.")
    return seconds


PEER_SILENCE_ENV = "ZEROSHARD_PEER_SILENCE_S"
DEFAULT_PEER_SILENCE_S = 60.0


def resolve_peer_silence_s(env: Mapping[str, str]) -> float | None:
    """How long a peer may go unheard while this rank waits in a collective with it before this
    rank names it and ends (Note: [peer silence] in comm/silence.py): ``ZEROSHARD_PEER_SILENCE_S``,
    else 60 s; 0 turns the check off (None).

    Raises:
        CommError: the value is not a number of seconds >= 0.
    """
    raw = env.get(PEER_SILENCE_ENV, "")
    if not raw:
        return DEFAULT_PEER_SILENCE_S
    try:
        seconds = float(raw)
    except ValueError:
        raise CommError(f"{PEER_SILENCE_ENV}={raw!r} is not a number of seconds (0 turns the check off).") from None
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise CommError(f"{PEER_SILENCE_ENV}={raw!r} must be a finite number of seconds >= 0 (0 turns the check off).")
    return seconds or None
