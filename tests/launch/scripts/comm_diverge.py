"""A 2-rank job whose ranks diverge; run by tests/launch/test_comm_divergence.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 comm_diverge.py MODE

MODE "skip": rank 1 never reaches rank 0's all_reduce (it sleeps outside any collective).
MODE "exit": rank 1 returns after the first barrier, leaving rank 0 in the all_reduce.
MODE "mismatch": rank 1 issues a broadcast where rank 0 issues the all_reduce.
Rank 0 must fail within the 3 s timeout with a CommError naming both ranks' last collectives.
MODE "size": both issue an all_reduce, of different sizes (gloo alone aborts the process).
MODE "extra": rank 0 issues an extra all_gather before the all_reduce both issue.
MODE "dscomm": rank 0 issues an extra all_reduce through deepspeed.comm (zeroshard.comm.functional),
as a script averaging its loss on one rank does, before the all_reduce both issue.
MODE "async": the same as "size" and "extra" with asynchronous collectives: rank 0 issues an
extra all_gather, then both issue two all_reduces of different sizes, and only then wait.
MODE "together": a burst checked as one (Comm.issued_together) holds one all_gather more on
rank 0 than on rank 1.
In "size", "extra", "dscomm", "async" and "together" every rank must raise zeroshard's report at once,
without SIGABRT, and no data of the mismatched collective (or a later one) moves.
MODE "kill": rank 1 is killed (SIGKILL: no exit hook, nothing published) after the first barrier,
under a 60 s timeout; rank 0 must fail within seconds, naming the dead rank.
MODE "stop": rank 1 stops itself (SIGSTOP: a frozen node; its sockets and pid stay) after the first
barrier, under a 60 s timeout with ZEROSHARD_PEER_SILENCE_S=3; rank 0 must end within seconds,
naming rank 1's host and pid (Note: [peer silence] in comm/silence.py).
MODE "storestop": the host of the c10d store goes silent: rank 1 stops torchrun's agent (SIGSTOP;
the agent hosts the store its workers use) and then waits in an all_reduce rank 0 does not reach
for 40 s, under a 60 s timeout with ZEROSHARD_PEER_SILENCE_S=3; rank 1 must end within seconds,
naming the store's address (Note: [store silence]). A helper process continues the agent 15 s
later, so torchrun sees rank 1's exit and ends the job.

Each rank prints the route of its signature checks after the first barrier ("board": shared
memory, the default on one host; "side group": ZEROSHARD_COMM_CHECK_BOARD=0; Note: [signature
board] in comm/board.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch

from zeroshard.comm import Comm, init_distributed
from zeroshard.comm.divergence import tracker_of


def main(mode: str) -> None:
    if mode in ("stop", "storestop"):
        os.environ["ZEROSHARD_PEER_SILENCE_S"] = "3"
    groups = init_distributed(timeout_s=60)
    comm = Comm(groups, timeout_s=60 if mode in ("kill", "stop", "storestop") else 3)
    comm.barrier()  # seq 1 on both ranks
    tracker = tracker_of(groups.dp_group)
    route = "board" if tracker.checks_on_board else "side group" if tracker._check_pg is not None else "none"
    print(f"rank {groups.rank}: check route {route}", flush=True)
    print(f"rank {groups.rank}: data arena {'on' if comm.shares_memory() else 'off'}", flush=True)
    if mode == "kill" and groups.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "stop" and groups.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # torchrun's SIGKILL ends it after rank 0 left
    if mode == "storestop":
        print(f"rank {groups.rank}: agent store {os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}", flush=True)
        if groups.rank == 0:
            time.sleep(40)  # in Python, waiting in no collective: this rank has nothing to report
        else:
            agent = os.getppid()
            subprocess.Popen([sys.executable, "-c", "import os, signal, sys, time; time.sleep(15); "
                              "os.kill(int(sys.argv[1]), signal.SIGCONT)", str(agent)], start_new_session=True)
            os.kill(agent, signal.SIGSTOP)
            comm.all_reduce(torch.ones(4))  # seq 2: rank 0 is asleep, the store silent
            raise SystemExit("rank 1: the all_reduce completed without rank 0")
    if mode == "size":
        comm.all_reduce(torch.ones(4 if groups.rank == 0 else 1000))  # seq 2: sizes differ
    if mode == "extra":
        if groups.rank == 0:
            comm.all_gather(torch.empty(2 * 3), torch.ones(3))  # seq 2: rank 0 only
        comm.all_reduce(torch.ones(100))  # seq 2 on rank 1, seq 3 on rank 0
    if mode == "dscomm":
        from zeroshard.comm import functional as dscomm

        if groups.rank == 0:
            dscomm.all_reduce(torch.ones(1))  # seq 2: rank 0 only, through deepspeed.comm
        comm.all_reduce(torch.ones(100))  # seq 2 on rank 1 (dscomm), seq 3 on rank 0
    if mode == "async":
        handles = []
        if groups.rank == 0:
            handles.append(comm.all_gather(torch.empty(2 * 3), torch.ones(3), async_op=True))  # seq 2: async extra
        # seq 2 on rank 1, seq 3 on rank 0; then a later one of a size the peer does not match
        handles.append(comm.all_reduce(torch.ones(100), async_op=True))
        handles.append(comm.all_reduce(torch.ones(7 if groups.rank == 0 else 70000), async_op=True))
        for handle in handles:
            handle.wait()
        raise SystemExit(f"rank {groups.rank}: mismatched asynchronous collectives completed")
    if mode == "together":
        handles = []
        with comm.issued_together():
            for _ in range(2 if groups.rank == 0 else 1):  # seq 2 (both), seq 3 (rank 0 only)
                handles.append(comm.all_gather(torch.empty(2 * 5), torch.ones(5), async_op=True))
        for handle in handles:
            handle.wait()
        raise SystemExit(f"rank {groups.rank}: a mismatched burst completed")
    if mode == "mismatch" and groups.rank == 1:
        comm.broadcast(torch.ones(8), 0)  # seq 2 on rank 1: not what rank 0 issued
    if groups.rank == 0:
        comm.all_reduce(torch.ones(4))  # seq 2: rank 1 never joins
        raise SystemExit("rank 0: the all_reduce completed without rank 1")
    if mode == "skip":
        time.sleep(100)  # in Python, so its watcher thread answers; torchrun kills it later


if __name__ == "__main__":
    main(sys.argv[1])
