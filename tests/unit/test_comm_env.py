"""comm without a process group: launcher env parsing, world-size-1 collectives, the comm log,
and the divergence report (two trackers sharing an in-memory store stand in for two ranks)."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zeroshard.comm import (
    Comm,
    CommLog,
    ProcessGroups,
    destroy_distributed,
    divergence,
    expand_hostlist,
    init_distributed,
    parse_launch_env,
)
from zeroshard.comm.divergence import CollectiveTracker, describe_states
from zeroshard.comm.env import parse_tasks_per_node, resolve_timeout_s
from zeroshard.errors import CommError

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29555"}
SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]",
         "SLURM_LAUNCH_NODE_IPADDR": "10.9.9.9"}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


# ---- launcher environments ---------------------------------------------------------------
def test_torchrun_env() -> None:
    launch = parse_launch_env(TORCHRUN)
    assert launch is not None
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank,
            launch.local_world_size, launch.master_addr, launch.master_port) == (
        "torchrun", 3, 4, 1, 2, "10.0.0.5", 29555)


def test_torchrun_env_errors_name_the_variable() -> None:
    with pytest.raises(CommError, match="WORLD_SIZE"):
        parse_launch_env({"RANK": "0"})
    with pytest.raises(CommError, match="rank 4 is outside"):
        parse_launch_env({**TORCHRUN, "RANK": "4"})
    with pytest.raises(CommError, match="RANK='x'"):
        parse_launch_env({**TORCHRUN, "RANK": "x"})


def test_rank_and_world_size_alone_mean_one_process_per_node() -> None:
    launch = parse_launch_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    assert launch is not None and (launch.local_rank, launch.local_world_size) == (0, 1)
    assert launch.master_port == 29500


def test_slurm_env_master_is_first_node_of_the_step() -> None:
    launch = parse_launch_env(SLURM)
    assert launch is not None
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank,
            launch.local_world_size, launch.master_addr, launch.master_port) == (
        "slurm", 3, 4, 1, 2, "gpu07", 29500)


def test_slurm_env_step_variables_and_overrides() -> None:
    step = {**SLURM, "SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5",
            "SLURM_STEP_NODELIST": "n[3-4],m1", "SLURM_STEP_TASKS_PER_NODE": "4,3,1"}
    launch = parse_launch_env(step)
    assert launch is not None
    assert (launch.world_size, launch.master_addr, launch.local_world_size) == (8, "n3", 3)
    custom = parse_launch_env({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "3000"})
    assert custom is not None and (custom.master_addr, custom.master_port) == ("head", 3000)
    bare = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}
    launch = parse_launch_env(bare)
    assert launch is not None and launch.master_addr == "10.9.9.9"


def test_openmpi_env() -> None:
    launch = parse_launch_env(OMPI)
    assert launch is not None
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank,
            launch.master_addr) == ("openmpi", 1, 2, 1, "127.0.0.1")
    multi = {**OMPI, "OMPI_COMM_WORLD_SIZE": "4"}
    with pytest.raises(CommError, match="MASTER_ADDR"):
        parse_launch_env(multi)
    launch = parse_launch_env({**multi, "MASTER_ADDR": "node0"})
    assert launch is not None and launch.master_addr == "node0"


def test_launcher_precedence_and_none() -> None:
    both = parse_launch_env({**SLURM, **TORCHRUN})  # srun ... torchrun ...
    assert both is not None and both.launcher == "torchrun"
    mpi = parse_launch_env({**SLURM, **OMPI})  # mpirun inside a SLURM allocation
    assert mpi is not None and mpi.launcher == "openmpi"
    assert parse_launch_env({}) is None
    assert parse_launch_env({"SLURM_JOB_ID": "7", "PATH": "/bin"}) is None


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a1,b2", ["a1", "b2"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[09-11]-ib", ["n09-ib", "n10-ib", "n11-ib"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("single", ["single"]),
])
def test_expand_hostlist(nodelist: str, hosts: list[str]) -> None:
    assert expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node01-03]", "node[a-b]", "node[5-3]"])
def test_expand_hostlist_rejects_malformed(bad: str) -> None:
    with pytest.raises(CommError, match="node list"):
        expand_hostlist(bad)


def test_tasks_per_node() -> None:
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    with pytest.raises(CommError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node("2x3")


def test_timeout_resolution() -> None:
    assert resolve_timeout_s(None, {}) == 1800.0
    assert resolve_timeout_s(None, {"ZEROSHARD_COMM_TIMEOUT_S": "12.5"}) == 12.5
    assert resolve_timeout_s(3, {"ZEROSHARD_COMM_TIMEOUT_S": "12.5"}) == 3.0
    with pytest.raises(CommError, match="ZEROSHARD_COMM_TIMEOUT_S"):
        resolve_timeout_s(None, {"ZEROSHARD_COMM_TIMEOUT_S": "soon"})
    for bad in (0, -1, float("inf")):
        with pytest.raises(CommError, match="timeout_s"):
            resolve_timeout_s(bad, {})


def test_init_without_launcher_is_one_process_without_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key in TORCHRUN or key.startswith(("SLURM_", "OMPI_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("ZEROSHARD_COMM_TIMEOUT_S", "42")
    try:
        groups = init_distributed()
        assert (groups.rank, groups.world_size, groups.dp_group, groups.backend) == (
            0, 1, None, "none")
        assert groups.timeout_s == 42.0 and groups.device == torch.device("cpu")
        assert not dist.is_initialized()
        assert init_distributed(timeout_s=5) is groups  # idempotent: the first call wins
        with pytest.raises(dataclasses.FrozenInstanceError):
            groups.rank = 1  # type: ignore[misc]
    finally:
        destroy_distributed()


# ---- world size 1: local collectives, same semantics ---------------------------------------
@pytest.fixture
def solo() -> Comm:
    return Comm(ProcessGroups.single(), log=CommLog())


def test_single_process_collectives(solo: Comm) -> None:
    x = torch.arange(4.0) + 0.001
    for op in ("sum", "avg", "max", "min"):
        t = x.clone()
        solo.all_reduce(t, op)  # type: ignore[arg-type]
        torch.testing.assert_close(t, x)
    t = x.clone()
    solo.reduce(t, 0, "avg")
    solo.broadcast(t, 0)
    torch.testing.assert_close(t, x)
    out = torch.empty(4)
    solo.all_gather(out, x)
    torch.testing.assert_close(out, x)
    solo.reduce_scatter(out.zero_(), x)
    torch.testing.assert_close(out, x)
    solo.all_to_all(out.zero_(), x)
    torch.testing.assert_close(out, x)
    solo.scatter(out.zero_(), [x], 0)
    torch.testing.assert_close(out, x)
    gathered = [torch.empty(4)]
    solo.gather(x, gathered, 0)
    torch.testing.assert_close(gathered[0], x)
    handle = solo.barrier(async_op=True)
    handle.wait()
    assert handle.is_completed()


def test_single_process_comm_dtype_rounds_like_a_real_reduction(solo: Comm) -> None:
    t = 1 + torch.arange(8) / 1000
    h = solo.all_reduce(t, "avg", async_op=True, comm_dtype=torch.bfloat16)
    h.wait()
    assert t.dtype == torch.float32
    torch.testing.assert_close(t, (1 + torch.arange(8) / 1000).bfloat16().float())
    out = torch.empty(8, dtype=torch.float64)  # bf16 travels, fp64 lands: mixed needs comm_dtype
    solo.all_gather(out, t, comm_dtype=torch.bfloat16)
    torch.testing.assert_close(out, t.double())
    with pytest.raises(ValueError, match="comm_dtype"):
        solo.all_gather(out, t)


def test_single_process_log(solo: Comm) -> None:
    log = solo.log
    assert log is not None
    solo.all_reduce(torch.ones(8))
    solo.all_gather(torch.empty(2), torch.ones(2, dtype=torch.float32), async_op=True).wait()
    solo.barrier()
    assert [(r.op, r.bytes, r.async_op) for r in log.records] == [
        ("all_reduce", 32, False), ("all_gather", 8, True), ("barrier", 0, False)]
    lines = log.summary().splitlines()
    assert lines[0].split() == ["op", "count", "total", "bytes", "total", "s", "algbw", "GB/s"]
    assert lines[2].split()[:4] == ["all_reduce", "1", "32", "B"]
    log.reset()
    assert "no collectives" in log.summary()


def test_comm_log_op_filter() -> None:
    log = CommLog(ops=["all_reduce"])
    log.record("all_reduce", 4, 0.5, False)
    log.record("barrier", 0, 0.1, False)
    assert len(log.records) == 1 and log.totals() == {"all_reduce": (1, 4, 0.5)}
    assert "0.000" in log.summary()  # 4 B / 0.5 s = 8e-9 GB/s


# ---- divergence report ---------------------------------------------------------------------
def _state(rank: int, seq: int, op: str, *, waiting: bool = False, state: str = "running",
           reason: str = "", numel: int = 1024) -> dict:
    call = {"seq": seq, "op": op, "numel": numel, "dtype": "float32", "where": f"train.py:{seq}"}
    return {"rank": rank, "seq": seq, "done": seq - 1 if waiting else seq, "last": call,
            "waiting": call if waiting else None, "wait_s": 3.0, "pending": [],
            "state": state, "reason": reason, "served": 1}


def test_describe_states_names_each_rank() -> None:
    states = {0: _state(0, 12, "all_reduce", waiting=True), 1: _state(1, 11, "all_gather"),
              2: _state(2, 11, "all_gather", state="exited", reason="ValueError: boom")}
    text = "\n".join(describe_states(states, 4))
    assert "rank 0: seq 12 all_reduce(numel=1024, float32) at train.py:12 — waiting 3.0 s" in text
    assert ("rank 1: seq 11 all_gather(numel=1024, float32) at train.py:11 — not in a "
            "collective (never reached seq 12)") in text
    assert "rank 2: exited (ValueError: boom) after seq 11 all_gather" in text
    assert "rank 3: never published" in text
    assert "Ranks [1, 2] never reached seq 12." in text


def test_describe_states_flags_mismatched_collectives() -> None:
    states = {0: _state(0, 5, "all_reduce", waiting=True),
              1: _state(1, 5, "broadcast", waiting=True, numel=8)}
    text = "\n".join(describe_states(states, 2))
    assert "Ranks disagree on seq 5" in text
    assert "all_reduce(numel=1024, float32)" in text and "broadcast(numel=8" in text


def test_two_trackers_over_a_store_report_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(divergence, "POLL_S", 0.02)
    store = dist.HashStore()
    rank0 = CollectiveTracker(object(), 0, 2, store=store)  # type: ignore[arg-type]
    rank1 = CollectiveTracker(object(), 1, 2, store=store)  # type: ignore[arg-type]
    try:
        for tracker in (rank0, rank1):
            tracker.end_wait(tracker.issue("barrier", 0, None), done=True)
        rec = rank0.issue("all_reduce", 4, torch.float32)
        line = sys._getframe().f_lineno - 1
        rank0.begin_wait(rec)
        start = time.monotonic()
        text = rank0.describe_failure(rec, RuntimeError("[x.cc:1] Timed out waiting"), 3.0)
        assert time.monotonic() - start < 1.5  # rank 1's thread answered; no full grace wait
        assert text.startswith(f"rank 0: all_reduce (seq 2) at test_comm_env.py:{line} failed after ")
        assert "Timed out waiting" in text and "x.cc" not in text
        assert (f"rank 0: seq 2 all_reduce(numel=4, float32) at test_comm_env.py:{line}"
                " — waiting") in text
        assert "rank 1: seq 1 barrier at test_comm_env.py:" in text
        assert "not in a collective (never reached seq 2)" in text
        rank1.close("exited", reason="KeyboardInterrupt: ")
        text = rank0.describe_failure(rec, RuntimeError("closed"), 3.0)
        assert "rank 1: exited (KeyboardInterrupt: ) after seq 1 barrier" in text
    finally:
        rank0.close("left")
        rank1.close("left")


def test_tracker_without_store_reports_locally_and_breaks() -> None:
    tracker = CollectiveTracker(object(), 0, 2, store=None)  # type: ignore[arg-type]
    rec = tracker.issue("barrier", 0, None)
    error = tracker.fail(rec, RuntimeError("gone"), 1.0)
    assert "rank 0: seq 1 barrier" in str(error) and "no c10d store" in str(error)
    with pytest.raises(CommError, match="broken"):
        tracker.issue("barrier", 0, None)


def test_stream_work_still_pending_past_the_timeout_is_reported_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    class PendingWork:
        def is_completed(self) -> bool:
            return False

    tracker = CollectiveTracker(object(), 1, 2, store=None)  # type: ignore[arg-type]
    rec = tracker.issue("all_reduce", 8, torch.bfloat16)
    tracker.watch_stream_work(rec, PendingWork(), 0.0)  # type: ignore[arg-type]
    tracker._check_stream_works()
    tracker._check_stream_works()
    err = capsys.readouterr().err
    assert err.count("rank 1: all_reduce (seq 1) at test_comm_env.py:") == 1, err
    assert "seq 1 all_reduce(numel=8, bfloat16)" in err


# ---- an explicit rendezvous (DeepSpeed's init_method=, rank=, world_size=) ----------------
def test_explicit_rendezvous_without_a_launcher() -> None:
    from zeroshard.comm.groups import Rendezvous, _launch_from

    assert _launch_from(Rendezvous(), None) is None
    launch = _launch_from(Rendezvous(init_method="file:///tmp/x", rank=1, world_size=3), None)
    assert launch is not None and (launch.launcher, launch.rank, launch.world_size) == ("init_method", 1, 3)
    with pytest.raises(CommError, match="needs both rank= and world_size="):
        _launch_from(Rendezvous(init_method="file:///tmp/x", rank=1), None)


def test_launcher_environment_wins_over_an_explicit_rendezvous() -> None:
    """Both given: the launcher's rank and world size are used; agreeing arguments pass,
    contradicting ones are refused with both values on the first line (where the ranks meet:
    test_explicit_init_method_wins_over_master_port)."""
    from zeroshard.comm.groups import Rendezvous, _launch_from

    env = parse_launch_env(TORCHRUN)
    assert env is not None
    assert _launch_from(Rendezvous(init_method="file:///tmp/x", rank=3, world_size=4), env) is env
    with pytest.raises(CommError, match=r"^init_distributed\(rank=0\) contradicts .*torchrun: rank 3"):
        _launch_from(Rendezvous(rank=0, world_size=4), env)
    with pytest.raises(CommError, match=r"^init_distributed\(world_size=2\) contradicts .*world_size 4"):
        _launch_from(Rendezvous(rank=3, world_size=2), env)


def _spawn_two(target: Callable[..., None], args: Callable[[int], tuple[Any, ...]]) -> list[int | None]:
    """Start ranks 0 and 1 as spawned processes running `target(*args(rank))`; their exit codes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args(r)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    return [p.exitcode for p in procs]


def _rendezvous_worker(rank: int, world: int, init_file: str, out: str) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    os.environ["OMP_NUM_THREADS"] = "1"
    _join_sum_and_write(rank, world, init_file, out)


def _join_sum_and_write(rank: int, world: int, init_file: str, out: str) -> None:
    """Join through `init_file`, all-reduce rank + 1, write "launcher rank world dist-rank sum"."""
    import zeroshard.comm as comm

    groups = comm.init_distributed(dist_backend="gloo", init_method=f"file://{init_file}",
                                   rank=rank, world_size=world)
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t)
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{groups.launcher} {groups.rank} {groups.world_size} {comm.get_rank()} {t.item():g}")
    comm.destroy_process_group()


def _join_by_file(rank: int, world: int, init_file: str) -> Any:
    """A spawned rank with no launcher variables joins through `init_file` (one thread)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    os.environ["OMP_NUM_THREADS"] = "1"
    import zeroshard.comm as comm

    return comm.init_distributed(dist_backend="gloo", init_method=f"file://{init_file}", rank=rank,
                                 world_size=world)


def _threads_after_destroy_worker(rank: int, world: int, init_file: str, out: str) -> None:
    import zeroshard.comm as comm
    from zeroshard.comm import Comm
    from zeroshard.comm.topology import Topology, build_mesh

    groups = _join_by_file(rank, world, init_file)
    build_mesh(groups, Topology(pp=1, dp=world, tp=1))  # a cache of groups (comm/topology.py)
    Comm(groups).all_reduce(torch.ones(3))
    before = _native_threads()
    comm.destroy_process_group()
    del groups
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{before} {_native_threads()}")


def _exit_hook_worker(rank: int, world: int, init_file: str, out: str) -> None:
    from zeroshard.comm import Comm
    from zeroshard.comm.groups import _leave_at_exit

    groups = _join_by_file(rank, world, init_file)
    cycle: list[Any] = [Comm(groups)]  # what a dropped engine looks like: unreachable, in a cycle
    cycle.append(cycle)
    cycle[0].all_reduce(torch.ones(3))
    before = _native_threads()
    del cycle, groups
    _leave_at_exit()  # what atexit runs
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{before} {_native_threads()}")


def _native_threads() -> int:
    """This process's gloo threads (named by gloo: gloo_tcp_loop, pt_gloo_runloop)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{tid}/comm").read().strip())
        except OSError:  # the thread ended while listing
            pass
    return sum(1 for n in names if "gloo" in n)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux /proc")
def test_destroy_ends_gloo_threads_while_the_interpreter_is_whole(tmp_path) -> None:
    """Note: [groups die before finalization] in comm/groups.py: once destroyed and dropped by the
    script, no zeroshard cache or exit hook keeps the process group (and gloo's threads) alive
    into interpreter finalization, where a gloo thread can abort the process."""
    codes = _spawn_two(_threads_after_destroy_worker,
                       lambda r: (r, 2, str(tmp_path / "store"), str(tmp_path / "out")))
    assert codes == [0, 0]
    for r in range(2):
        before, after = map(int, (tmp_path / f"out.{r}").read_text().split())
        assert before > 0, "gloo's threads were not seen: the count no longer measures anything"
        assert after == 0, f"rank {r}: {after} gloo thread(s) still alive after destroy"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux /proc")
def test_exit_hook_frees_groups_held_by_a_dropped_cycle(tmp_path) -> None:
    """A script that never destroys its group and dropped its engine (in a reference cycle):
    zeroshard's exit hook destroys the group and collects the cycle, so gloo's threads end
    before finalization (Note: [groups die before finalization])."""
    codes = _spawn_two(_exit_hook_worker, lambda r: (r, 2, str(tmp_path / "store"), str(tmp_path / "out")))
    assert codes == [0, 0]
    for r in range(2):
        before, after = map(int, (tmp_path / f"out.{r}").read_text().split())
        assert before > 0 and after == 0, (r, before, after)


def test_init_distributed_file_rendezvous_in_processes_started_by_multiprocessing(tmp_path) -> None:
    """Processes a script starts itself (no launcher variables) join through init_method="file://"."""
    codes = _spawn_two(_rendezvous_worker, lambda r: (r, 2, str(tmp_path / "store"), str(tmp_path / "out")))
    assert codes == [0, 0]
    assert [(tmp_path / f"out.{r}").read_text() for r in range(2)] == [
        "init_method 0 2 0 3", "init_method 1 2 1 3"]


def _harness_worker(rank: int, world: int, init_file: str, port: int, out: str) -> None:
    """What DeepSpeed's test harness does in each rank: export the launcher's variables (with a
    MASTER_PORT it picked) and also pass its own file store."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    _join_sum_and_write(rank, world, init_file, out)


def test_explicit_init_method_wins_over_master_port(tmp_path) -> None:
    """Launcher variables and an agreeing explicit `init_method="file://..."` (DeepSpeed's test
    harness): the ranks meet in the file store and bind no port, so two such jobs that picked the
    same MASTER_PORT do not collide. The port here is held by another listener: joining through
    MASTER_PORT would fail with EADDRINUSE."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        codes = _spawn_two(_harness_worker, lambda r: (r, 2, str(tmp_path / "store"), port, str(tmp_path / "out")))
    assert codes == [0, 0]
    assert [(tmp_path / f"out.{r}").read_text() for r in range(2)] == ["torchrun 0 2 0 3", "torchrun 1 2 1 3"]
