"""ProcessGroups: rank, world size, device and the data-parallel group, built once per process.

``init_distributed`` reads torchrun's, OpenMPI's or SLURM's environment (``comm/env.py``), or
finds none and stays a single process without a process group (``python train.py`` binds no
port). Imports nothing of ours but ``errors`` and ``comm``.
"""

from __future__ import annotations

import atexit
import gc
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import zeroshard.comm.user_collectives as user_collectives
from zeroshard.comm.divergence import forget_tracker, tracker_for, tracker_is_idle
from zeroshard.comm.env import (
    DEFAULT_MASTER_PORT,
    DEFAULT_TIMEOUT_S,
    LaunchEnv,
    parse_launch_env,
    resolve_timeout_s,
)
from zeroshard.errors import CommError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store


@dataclass(frozen=True, kw_only=True, slots=True)
class ProcessGroups:
    """Where this process sits in the job. Built by :func:`init_distributed`; immutable.

    Ranks in every ``Comm`` call (``src``, ``dst``) are positions in ``dp_group``.
    """

    rank: int
    """Rank in the data-parallel group."""
    world_size: int
    """Size of the data-parallel group."""
    local_rank: int
    """Rank among the processes on this node; selects the accelerator."""
    local_world_size: int
    """Number of processes on this node."""
    device: torch.device
    """Where this rank's tensors and collectives live (cpu for gloo, cuda:local_rank, ...)."""
    backend: str
    """torch.distributed backend ("gloo", "nccl", ...); "none" without a process group."""
    dp_group: dist.ProcessGroup | None
    """The data-parallel group; None for a single process without a process group."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Default collective timeout, seconds (``Comm`` uses it unless given its own)."""
    launcher: str = "none"
    """Whose environment was read: "torchrun", "openmpi", "slurm", "user" (a group the
    script created itself), "init_method" (an explicit rendezvous passed to init_distributed)
    or "none"."""
    siblings: tuple[tuple[int, ...], ...] = ()
    """For a group along some axes of the world (comm/topology.py, :func:`subgroup`): the
    partition of the world's ranks it is one part of, in global ranks, each part in position
    order; empty for the world itself (positions are then global ranks)."""

    @classmethod
    def single(cls, device: torch.device | str = "cpu",
               timeout_s: float = DEFAULT_TIMEOUT_S) -> ProcessGroups:
        """World size 1 without a process group: every ``Comm`` collective is local."""
        return cls(rank=0, world_size=1, local_rank=0, local_world_size=1,
                   device=torch.device(device), backend="none", dp_group=None,
                   timeout_s=timeout_s)


_GROUPS: ProcessGroups | None = None
_OWNS_GROUP = False
_EXIT_HOOK_REGISTERED = False


def _accelerator(local_rank: int, backend: str | None) -> torch.device:
    """cpu for gloo, without an accelerator or with DS_ACCELERATOR=cpu (as get_accelerator());
    else the accelerator with index local_rank."""
    if (backend == "gloo" or not torch.accelerator.is_available()
            or os.environ.get("DS_ACCELERATOR", "").strip().lower() == "cpu"):
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    if acc is None or acc.type == "mps":  # no collective backend for mps
        return torch.device("cpu")
    count = torch.accelerator.device_count()
    if local_rank >= count:
        raise CommError(f"local rank {local_rank} has no {acc.type} device (this node has "
                        f"{count}); start at most {count} processes per node.")
    return torch.device(acc.type, local_rank)


def _default_backend(device: torch.device) -> str:
    get = getattr(dist, "get_default_backend_for_device", None)
    if get is not None:
        return str(get(device))
    return "nccl" if device.type == "cuda" else "gloo"


def default_backend_name(device_type: str) -> str:
    """torch.distributed's default backend for a device type ("nccl", "gloo", "xccl", ...); the
    accelerator's `communication_backend_name()`."""
    known = dist.Backend.default_device_backend_map.get(device_type)
    return known if known is not None else _default_backend(torch.device(device_type))


def _group_store(group: dist.ProcessGroup) -> Store | None:
    try:
        return group.get_group_store()
    except Exception:  # a backend without a store: diagnostics stay local
        return None


def _export_env(launch: LaunchEnv) -> None:
    # Scripts ported from DeepSpeed read these after init; SLURM and MPI do not set them.
    for key, value in (("RANK", launch.rank), ("WORLD_SIZE", launch.world_size),
                       ("LOCAL_RANK", launch.local_rank),
                       ("LOCAL_WORLD_SIZE", launch.local_world_size),
                       ("MASTER_ADDR", launch.master_addr), ("MASTER_PORT", launch.master_port)):
        os.environ.setdefault(key, str(value))


def _from_existing(timeout_s: float) -> ProcessGroups:
    """Wrap the default group the script created with ``init_process_group`` itself."""
    launch = parse_launch_env(os.environ)
    backend = str(dist.get_backend())
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = launch.local_rank if launch is not None else 0
    device = _accelerator(local_rank, "gloo" if backend == "gloo" else None)
    return ProcessGroups(
        rank=rank, world_size=world_size, local_rank=local_rank,
        local_world_size=launch.local_world_size if launch is not None else 1,
        device=device, backend=backend, dp_group=dist.group.WORLD, timeout_s=timeout_s,
        launcher="user")


def _where(launch: LaunchEnv, init_method: str) -> str:
    if not init_method.startswith("env://"):
        return init_method
    return f"{launch.master_addr}:{launch.master_port}"


def _explicit_store(init_method: str | None) -> str | None:
    """The script's own rendezvous URL (``file://``, ``tcp://``...), or None for none or ``env://``."""
    if init_method is None or init_method.strip() == "" or init_method.startswith("env://"):
        return None
    return init_method


def _create(launch: LaunchEnv, backend: str | None, timeout_s: float,
            explicit_init: str | None = None) -> ProcessGroups:
    device = _accelerator(launch.local_rank, backend)
    backend = backend or _default_backend(device)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    explicit = _explicit_store(explicit_init)
    if launch.launcher in ("openmpi", "slurm"):
        _export_env(launch)
    if explicit is not None:
        # The script's own rendezvous wins over MASTER_ADDR/MASTER_PORT, as in DeepSpeed (torch
        # prefers init_method=); rank and world size are the launcher's, checked in _launch_from.
        init_method = explicit
    elif launch.launcher == "init_method":
        init_method = "env://"
    elif launch.launcher == "torchrun":
        # env:// picks up torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE).
        init_method = "env://"
    else:
        host = f"[{launch.master_addr}]" if ":" in launch.master_addr else launch.master_addr
        init_method = f"tcp://{host}:{launch.master_port}"
    try:
        dist.init_process_group(backend, init_method=init_method, rank=launch.rank,
                                world_size=launch.world_size,
                                timeout=timedelta(seconds=timeout_s))
    except Exception as e:
        raise CommError(
            f"rank {launch.rank}/{launch.world_size} ({launch.launcher}): could not join the "
            f"process group at {_where(launch, init_method)} with {backend} within "
            f"{timeout_s:g} s: {e}. Check that every rank started, "
            + ("and that every rank passed the same init_method." if explicit is not None else
               "that MASTER_ADDR/MASTER_PORT reach rank 0, and that the port is free.")) from e
    return ProcessGroups(
        rank=launch.rank, world_size=launch.world_size, local_rank=launch.local_rank,
        local_world_size=launch.local_world_size, device=device, backend=backend,
        dp_group=dist.group.WORLD, timeout_s=timeout_s, launcher=launch.launcher)


@dataclass(frozen=True, kw_only=True, slots=True)
class Rendezvous:
    """An explicit rendezvous a script passes itself (DeepSpeed's and torch's ``init_method``,
    ``rank``, ``world_size``), for processes no launcher started (multiprocessing, notebooks,
    test harnesses). ``None`` fields are not given."""

    init_method: str | None = None
    rank: int | None = None
    world_size: int | None = None


def _launch_from(rendezvous: Rendezvous, launch: LaunchEnv | None) -> LaunchEnv | None:
    """Reconcile an explicit rendezvous with the launcher's environment.

    The launcher's environment decides who this process is: a ``rank=`` / ``world_size=`` that
    contradicts the launcher's is an error (a silent choice would hang the job or double a rank).
    Where the ranks meet is the script's ``init_method`` when it names one other than ``env://``
    (``_create``; as in DeepSpeed, which hands it to torch), else the launcher's rendezvous.
    Without a launcher, ``rank`` and ``world_size`` are required alongside ``init_method``.
    """
    if launch is not None:
        for name, given, env_value in (("rank", rendezvous.rank, launch.rank),
                                       ("world_size", rendezvous.world_size, launch.world_size)):
            if given is not None and given != env_value:
                raise CommError(
                    f"init_distributed({name}={given}) contradicts the launcher's environment "
                    f"({launch.launcher}: {name} {env_value}); the launcher's environment wins in zeroshard, "
                    f"so drop {name}= or make it agree (or unset the launcher's RANK/WORLD_SIZE).")
        return launch
    if rendezvous.init_method is None and rendezvous.rank is None and rendezvous.world_size is None:
        return None
    if rendezvous.rank is None or rendezvous.world_size is None:
        raise CommError(
            f"init_distributed(init_method={rendezvous.init_method!r}, rank={rendezvous.rank}, "
            f"world_size={rendezvous.world_size}): without a launcher's environment an explicit "
            "rendezvous needs both rank= and world_size= (or start the script with torchrun).")
    local_rank = int(os.environ.get("LOCAL_RANK", rendezvous.rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", rendezvous.world_size))
    return LaunchEnv(launcher="init_method", rank=rendezvous.rank, world_size=rendezvous.world_size,
                     local_rank=local_rank, local_world_size=max(local_world, local_rank + 1),
                     master_addr=os.environ.get("MASTER_ADDR") or "127.0.0.1",
                     master_port=int(os.environ.get("MASTER_PORT") or DEFAULT_MASTER_PORT))


def init_distributed(*, backend: str | None = None, timeout_s: float | None = None,
                     rendezvous: Rendezvous | None = None) -> ProcessGroups:
    """Join the job's process group once, from the launcher's environment.

    torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
    OpenMPI (``OMPI_COMM_WORLD_*``; ``MASTER_ADDR`` needed across nodes) and SLURM's srun
    (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; rank 0's host is the first node of
    ``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST``; port ``MASTER_PORT`` or 29500) are read in
    that order. Without any, the process runs alone: world size 1 and no process group. A group
    the script already created with ``torch.distributed.init_process_group`` is reused. The
    accelerator ``local_rank`` becomes the current device. Later calls return the same object.

    Args:
        backend: torch.distributed backend; default: nccl for CUDA, gloo on CPU.
        timeout_s: collective timeout in seconds; default ``ZEROSHARD_COMM_TIMEOUT_S`` or
            1800. A collective that does not complete in time raises ``CommError``.
        rendezvous: an explicit ``init_method`` / ``rank`` / ``world_size`` (DeepSpeed's and
            torch's arguments), used when no launcher's variables are set; ``rank`` and
            ``world_size`` are then required and ``init_method`` defaults to ``env://``
            (``MASTER_ADDR``/``MASTER_PORT``). When a launcher's variables are set too, they
            give the rank and world size (a contradicting ``rank``/``world_size`` is a
            CommError) and an ``init_method`` other than ``env://`` is still where the ranks
            meet (a ``file://`` store binds no port).
            ``LOCAL_RANK`` (else ``rank``) selects the accelerator.

    Returns:
        The process's :class:`ProcessGroups`.

    Raises:
        CommError: the launcher's variables are inconsistent, or the group cannot be joined.

    Example::

        groups = init_distributed()          # torchrun --nproc-per-node=2 train.py
        comm = Comm(groups)
    """
    global _GROUPS, _OWNS_GROUP
    cached = _GROUPS
    if cached is not None and (cached.dp_group is None) != dist.is_initialized():
        return cached
    seconds = resolve_timeout_s(timeout_s, os.environ)
    if dist.is_initialized():
        groups, owns = _from_existing(seconds), False
    else:
        launch = _launch_from(rendezvous or Rendezvous(), parse_launch_env(os.environ))
        if launch is None:
            device = _accelerator(0, backend)
            groups, owns = ProcessGroups.single(device, seconds), False
            if device.type != "cpu":
                torch.accelerator.set_device_index(device.index)
        else:
            init_method = rendezvous.init_method if rendezvous is not None else None
            groups, owns = _create(launch, backend, seconds, init_method), True
    if groups.dp_group is not None:
        # Start the divergence watcher now, on every rank, so that a peer's report can name
        # this rank's state even before it issues its first collective.
        tracker_for(groups.dp_group, groups.rank, groups.world_size, _group_store)
        # The script's own torch.distributed collectives join the sequence (Note: [script collectives]).
        user_collectives.install(groups.timeout_s)
    _GROUPS, _OWNS_GROUP = groups, owns
    global _EXIT_HOOK_REGISTERED
    if groups.dp_group is not None and not _EXIT_HOOK_REGISTERED:
        atexit.register(_leave_at_exit)
        _EXIT_HOOK_REGISTERED = True
    return groups


def _leave_at_exit() -> None:
    """Destroy the process groups while the interpreter is still whole.

    Left to finalization, gloo's worker threads can drop the last reference to a tensor that
    Python still tracks and need the GIL to free it, which a finalizing interpreter answers
    with pthread_exit (SIGABRT, "terminate called without an active exception"). That holds for
    a group the script made too (Accelerate on the CPU calls init_process_group itself, before
    Trainer reaches zeroshard), so that one is destroyed here as well: the script has ended,
    and only atexit handlers registered before zeroshard's run after this. A group with a
    collective in flight or a broken group is left alone: its teardown could wait for peers.
    """
    groups = _GROUPS
    if groups is None or groups.dp_group is None or not dist.is_initialized():
        return
    if not tracker_is_idle(groups.dp_group):
        return
    owned = _OWNS_GROUP
    try:
        destroy_distributed()
        if not owned and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # exiting anyway: nothing left to tell the user
        return
    del groups
    # An engine the script dropped may still sit in a reference cycle that holds its groups: free
    # it now, while gloo's threads can still end cleanly (Note: [groups die before finalization]).
    gc.collect()


NODE_SIZE_ENV = "ZEROSHARD_NODE_SIZE"
"""Overrides the ranks per node (the launcher's LOCAL_WORLD_SIZE) for the node-aware features
(ZeRO++ hpZ, hierarchical qgZ): lets tests and benchmarks lay out several "nodes" on one
machine. Ranks are node-major, as every launcher numbers them: node n holds ranks
[n * size, (n + 1) * size)."""


def node_size(groups: ProcessGroups) -> int:
    """Ranks per node: ``ZEROSHARD_NODE_SIZE`` if set, else the launcher's local world size
    (capped by the world size).

    Raises:
        CommError: ``ZEROSHARD_NODE_SIZE`` is not a positive integer.
    """
    raw = os.environ.get(NODE_SIZE_ENV, "").strip()
    if not raw:
        return max(1, min(groups.local_world_size, groups.world_size))
    try:
        size = int(raw)
    except ValueError:
        size = 0
    if size < 1:
        raise CommError(f"{NODE_SIZE_ENV}={raw!r}: expected a positive integer (ranks per node).")
    return size


def node_leader(groups: ProcessGroups) -> int:
    """The first rank of this rank's node: from ``ZEROSHARD_NODE_SIZE`` when set (node-major
    numbering), else from the launcher's local rank (nodes may hold different numbers of ranks)."""
    if os.environ.get(NODE_SIZE_ENV, "").strip():
        return groups.rank - groups.rank % node_size(groups)
    return max(0, groups.rank - groups.local_rank)


def node_rank_lists(world_size: int, size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(node groups, cross groups) for `size` ranks per node: node n = ranks
    [n * size, (n + 1) * size); cross group l = the ranks of local rank l on every node.

    >>> node_rank_lists(4, 2)
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    """
    if size < 1 or world_size % size:
        raise AssertionError(f"expected a node size dividing {world_size}, got {size}")
    nodes = [list(range(n * size, (n + 1) * size)) for n in range(world_size // size)]
    cross = [list(range(local, world_size, size)) for local in range(size)]
    return nodes, cross


_SUBGROUPS: dict[tuple[tuple[int, ...], ...], list[dist.ProcessGroup | None]] = {}
"""Partition of the world's ranks -> one process group per part (None for a one-rank part)."""
_ADOPTED: list[dist.ProcessGroup] = []
"""Groups made elsewhere (``DeviceMesh``) whose trackers :func:`destroy_distributed` closes."""


def _global_parts(groups: ProcessGroups,
                  rank_lists: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """`rank_lists` (positions in `groups`) applied to every sibling of `groups`: a partition of
    the world in global ranks, the same on every rank."""
    if not groups.siblings:
        return rank_lists
    return tuple(tuple(sib[p] for p in part) for sib in groups.siblings for part in rank_lists)


def subgroup(groups: ProcessGroups, rank_lists: Sequence[Sequence[int]]) -> ProcessGroups:
    """ProcessGroups for the part of ``rank_lists`` holding ``groups.rank``.

    ``rank_lists`` partitions the positions of ``groups``. When ``groups`` is itself one part of
    the world (an axis of comm/topology.py's mesh), the same split is made in every sibling
    group, so that every rank of the world creates the same groups in the same order. Collective
    over the world: every rank passes the same lists; each partition's groups are created once
    and reused (also those ``register_subgroup`` recorded).
    """
    key = tuple(tuple(int(r) for r in part) for part in rank_lists)
    mine = [i for i, part in enumerate(key) if groups.rank in part]
    if len(mine) != 1 or sorted(r for part in key for r in part) != list(range(groups.world_size)):
        raise AssertionError(f"expected a partition of range({groups.world_size}), got {key}")
    part = key[mine[0]]
    world_parts = _global_parts(groups, key)
    if groups.dp_group is None:
        pg = None
    else:
        me = dist.get_rank()
        index = next(i for i, p in enumerate(world_parts) if me in p)
        pgs = _SUBGROUPS.get(world_parts)
        if pgs is None:
            # new_group is collective over the default group: every rank creates every part.
            pgs = [dist.new_group(list(p), timeout=timedelta(seconds=groups.timeout_s))
                   if len(p) > 1 else None for p in world_parts]
            _SUBGROUPS[world_parts] = pgs
        pg = pgs[index]
        if pg is not None:
            tracker_for(pg, part.index(groups.rank), len(part), _no_store)
    return replace(groups, rank=part.index(groups.rank), world_size=len(part),
                   local_rank=part.index(groups.rank), local_world_size=len(part), dp_group=pg,
                   siblings=world_parts)


def _no_store(_group: dist.ProcessGroup) -> None:
    """Sub-groups' divergence diagnostics stay local: they share the default group's store."""
    return None


def adopt_subgroup(group: dist.ProcessGroup, rank: int, world_size: int) -> None:
    """Give a group made elsewhere (``DeviceMesh``'s, comm/topology.py) a divergence tracker as
    :func:`subgroup`'s have, closed by :func:`destroy_distributed`.

    It does not enter :func:`subgroup`'s cache: a split always gets groups of its own, so that
    collectives issued on a split and on its parent never share one group's ordering.
    """
    tracker_for(group, rank, world_size, _no_store)
    if all(g is not group for g in _ADOPTED):
        _ADOPTED.append(group)


def current_groups() -> ProcessGroups | None:
    """The ProcessGroups :func:`init_distributed` built for this process, if any."""
    return _GROUPS


def wrap_process_group(groups: ProcessGroups, group: dist.ProcessGroup | None, rank: int | None = None,
                       world_size: int | None = None) -> ProcessGroups:
    """ProcessGroups over a group the script built itself (a Megatron mpu's data- or
    model-parallel group); `rank` / `world_size` are this rank's position in it and its size, as
    its owner reports them (None: the group's own).

    Raises:
        CommError: the group's own rank or size disagrees with the given ones.
    """
    if rank is None or world_size is None:
        if group is None or not dist.is_initialized():
            raise CommError("wrap_process_group: without rank and world_size, pass a process group of an "
                            "initialized job")
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if world_size > 1 and group is not None and dist.is_initialized():
        real = (dist.get_rank(group), dist.get_world_size(group))
        if real != (rank, world_size):
            raise CommError(f"a process group says rank {real[0]} of {real[1]}, its owner says {rank} of "
                            f"{world_size}; pass the group that matches the reported rank and size.")
        tracker_for(group, rank, world_size, lambda _g: None)
    return replace(groups, rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                   dp_group=group if world_size > 1 else None)


_ON_DESTROY: list[Callable[[], None]] = []


def on_destroy(forget: Callable[[], None]) -> None:
    """Have :func:`destroy_distributed` call `forget`: a module that caches process groups
    (comm/topology.py's mesh, moe/ep_groups.py's expert groups) empties its cache there.

    Note: [groups die before finalization]
    gloo's threads end only when the C++ process group is freed, which needs every Python
    reference to it gone. A reference left in a zeroshard cache (or in an exit hook's bound
    method) keeps the group until the interpreter finalizes, and a gloo thread that then drops
    a Python-tracked tensor aborts the process ("terminate called without an active
    exception", measured 1 exit in 40 of a plain init / all_reduce / destroy on a busy 2-core
    machine). So destroying empties every cache, and exit hooks hold weak references."""
    _ON_DESTROY.append(forget)


def destroy_distributed() -> None:
    """Leave the process group created by :func:`init_distributed` (not one the script made),
    and empty every cache of its groups (Note: [groups die before finalization])."""
    global _GROUPS, _OWNS_GROUP
    for forget in _ON_DESTROY:
        forget()
    user_collectives.uninstall()
    groups = _GROUPS
    if groups is None:
        return
    for pgs in _SUBGROUPS.values():
        for pg in pgs:
            if pg is not None:
                forget_tracker(pg)
    _SUBGROUPS.clear()
    for pg in _ADOPTED:
        forget_tracker(pg)
    _ADOPTED.clear()
    if groups.dp_group is not None:
        forget_tracker(groups.dp_group)
        if _OWNS_GROUP and dist.is_initialized():
            dist.destroy_process_group()
    _GROUPS, _OWNS_GROUP = None, False


def group_store(group: dist.ProcessGroup) -> Store | None:
    """The c10d store of ``group`` (for the divergence tracker), or None."""
    return _group_store(group)
