"""Every Comm collective against a hand-computed expectation, at any world size.

Rank r contributes ``x_r[i] = i + 10 * r`` (or similar), so each expectation is a closed form
in the world size W. Runs under torchrun at 2 and 3 ranks, and at W = 1 under plain pytest.
"""

from __future__ import annotations

import os

import pytest
import torch

from zeroshard.comm import Comm, CommLog, ProcessGroups, ReduceOpName
from zeroshard.comm.divergence import describe_states
from zeroshard.errors import CommError


def contribution(rank: int, n: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(n) + 10 * rank).to(dtype)


def test_groups_match_launcher(groups: ProcessGroups) -> None:
    assert groups.world_size == int(os.environ.get("WORLD_SIZE", "1"))
    assert groups.rank == int(os.environ.get("RANK", "0"))
    assert groups.device == torch.device("cpu")
    assert (groups.dp_group is None) == (groups.world_size == 1 and "RANK" not in os.environ)
    if groups.dp_group is not None:
        assert groups.backend == "gloo"


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_all_reduce(comm: Comm, op: ReduceOpName, async_op: bool) -> None:
    w, r = comm.world_size, comm.rank
    t = contribution(r)
    i = torch.arange(4.0)
    expected = {"sum": w * i + 10 * w * (w - 1) / 2, "avg": i + 10 * (w - 1) / 2,
                "max": i + 10 * (w - 1), "min": i}[op]
    handle = comm.all_reduce(t, op, async_op=async_op)
    handle.wait()
    handle.wait()  # idempotent
    torch.testing.assert_close(t, expected)


def test_all_reduce_integer_sum(comm: Comm) -> None:
    t = torch.full((3,), comm.rank + 1, dtype=torch.int64)
    comm.all_reduce(t)
    w = comm.world_size
    assert t.tolist() == [w * (w + 1) // 2] * 3


@pytest.mark.parametrize("which", ["first", "last"])
def test_broadcast(comm: Comm, which: str) -> None:
    src = 0 if which == "first" else comm.world_size - 1
    t = contribution(comm.rank)
    comm.broadcast(t, src)
    torch.testing.assert_close(t, contribution(src))


def test_scatter_and_gather(comm: Comm) -> None:
    w, r = comm.world_size, comm.rank
    src = w - 1
    out = torch.empty(3)
    chunks = [torch.full((3,), 100.0 + d) for d in range(w)] if r == src else None
    comm.scatter(out, chunks, src)
    torch.testing.assert_close(out, torch.full((3,), 100.0 + r))

    gathered = [torch.empty(4) for _ in range(w)] if r == 0 else None
    comm.gather(contribution(r), gathered, 0)
    if gathered is not None:
        for s in range(w):
            torch.testing.assert_close(gathered[s], contribution(s))


@pytest.mark.parametrize("async_op", [False, True])
def test_all_gather(comm: Comm, async_op: bool) -> None:
    w = comm.world_size
    out = torch.full((3 * w,), -1.0)
    comm.all_gather(out, contribution(comm.rank, 3), async_op=async_op).wait()
    torch.testing.assert_close(out, torch.cat([contribution(s, 3) for s in range(w)]))


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_reduce(comm: Comm, op: ReduceOpName) -> None:
    w, dst = comm.world_size, comm.world_size - 1
    t = contribution(comm.rank)
    comm.reduce(t, dst, op)
    if comm.rank == dst:
        i = torch.arange(4.0)
        expected = {"sum": w * i + 10 * w * (w - 1) / 2, "avg": i + 10 * (w - 1) / 2,
                    "max": i + 10 * (w - 1)}[op]
        torch.testing.assert_close(t, expected)


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter(comm: Comm, op: ReduceOpName) -> None:
    w, r = comm.world_size, comm.rank
    full = contribution(r, 2 * w)
    before = full.clone()
    out = torch.empty(2)
    comm.reduce_scatter(out, full, op)
    i = torch.arange(2 * r, 2 * r + 2, dtype=torch.float32)
    expected = w * i + 10 * w * (w - 1) / 2
    torch.testing.assert_close(out, expected / w if op == "avg" else expected)
    torch.testing.assert_close(full, before)  # the input is left alone


def test_all_to_all(comm: Comm) -> None:
    w, r = comm.world_size, comm.rank
    # Chunk d of rank s's input holds 100 * s + d: rank r receives [100 * s + r for s].
    in_ = torch.tensor([100.0 * r + d for d in range(w) for _ in range(2)])
    out = torch.empty(2 * w)
    comm.all_to_all(out, in_)
    torch.testing.assert_close(out, torch.tensor([100.0 * s + r for s in range(w)
                                                  for _ in range(2)]))


def test_async_handles_waited_out_of_order(comm: Comm) -> None:
    w = comm.world_size
    a, b = torch.ones(5), torch.full((2,), float(comm.rank))
    out = torch.empty(3 * w)
    handles = [comm.all_reduce(a, async_op=True), comm.all_reduce(b, "max", async_op=True),
               comm.all_gather(out, torch.full((3,), 7.0), async_op=True),
               comm.barrier(async_op=True)]
    for h in reversed(handles):
        h.wait()
    assert all(h.is_completed() for h in handles)
    torch.testing.assert_close(a, torch.full((5,), float(w)))
    torch.testing.assert_close(b, torch.full((2,), float(w - 1)))
    torch.testing.assert_close(out, torch.full((3 * w,), 7.0))


def test_comm_dtype_bf16_close_to_fp32(comm: Comm) -> None:
    # 1 + k / 1000 is not representable in bf16: the reduction really ran in bf16.
    t = (1 + torch.arange(64) / 1000) * (comm.rank + 1)
    ref = t.clone()
    comm.all_reduce(ref, "avg")
    h = comm.all_reduce(t, "avg", async_op=True, comm_dtype=torch.bfloat16)
    h.wait()
    assert t.dtype == torch.float32
    torch.testing.assert_close(t, ref, rtol=3 * 2**-7, atol=0)  # a few bf16 roundings
    assert not torch.equal(t, ref)
    assert torch.equal(t, t.to(torch.bfloat16).float())  # bf16 values, in the fp32 tensor


def test_comm_dtype_other_collectives(comm: Comm) -> None:
    w, r = comm.world_size, comm.rank
    out = torch.empty(2)
    comm.reduce_scatter(out, contribution(r, 2 * w, torch.float64), comm_dtype=torch.float32)
    i = torch.arange(2 * r, 2 * r + 2, dtype=torch.float64)
    torch.testing.assert_close(out, (w * i + 10 * w * (w - 1) / 2).float())
    gathered = torch.empty(3 * w, dtype=torch.float64)
    comm.all_gather(gathered, contribution(r, 3, torch.float64), comm_dtype=torch.bfloat16)
    assert gathered.dtype == torch.float64
    torch.testing.assert_close(gathered, torch.cat([contribution(s, 3, torch.float64)
                                                    for s in range(w)]))
    t = contribution(r) + 0.001
    comm.broadcast(t, 0, comm_dtype=torch.bfloat16)
    if r == 0:
        torch.testing.assert_close(t, contribution(0) + 0.001)  # the source keeps full precision
    else:
        torch.testing.assert_close(t, (contribution(0) + 0.001).bfloat16().float())


def test_fallbacks_match_native(groups: ProcessGroups) -> None:
    comm = Comm(groups, timeout_s=60)
    comm._caps.update(avg=False, all_gather_single=False, reduce_scatter_single=False,
                      all_to_all_single=False)
    w, r = comm.world_size, comm.rank
    t = contribution(r)
    comm.all_reduce(t, "avg")
    torch.testing.assert_close(t, torch.arange(4.0) + 10 * (w - 1) / 2)
    out = torch.empty(3 * w)
    comm.all_gather(out, contribution(r, 3))
    torch.testing.assert_close(out, torch.cat([contribution(s, 3) for s in range(w)]))
    rs = torch.empty(2)
    comm.reduce_scatter(rs, contribution(r, 2 * w), "avg")
    i = torch.arange(2 * r, 2 * r + 2, dtype=torch.float32)
    torch.testing.assert_close(rs, i + 10 * (w - 1) / 2)
    in_ = torch.tensor([100.0 * r + d for d in range(w) for _ in range(2)])
    a2a = torch.empty(2 * w)
    comm.all_to_all(a2a, in_)
    torch.testing.assert_close(a2a, torch.tensor([100.0 * s + r for s in range(w)
                                                  for _ in range(2)]))


def test_comm_log_counts_bytes(groups: ProcessGroups) -> None:
    log = CommLog()
    comm = Comm(groups, log=log)
    w = comm.world_size
    comm.all_reduce(torch.ones(4))                                  # 16 B
    comm.all_reduce(torch.ones(4), comm_dtype=torch.bfloat16)       # 8 B
    comm.all_gather(torch.empty(3 * w), torch.ones(3), async_op=True).wait()  # 12 W B
    comm.reduce_scatter(torch.empty(2, dtype=torch.float64), torch.ones(2 * w, dtype=torch.float64))
    comm.barrier()
    assert [(r.op, r.bytes, r.async_op) for r in log.records] == [
        ("all_reduce", 16, False), ("all_reduce", 8, False), ("all_gather", 12 * w, True),
        ("reduce_scatter", 16 * w, False), ("barrier", 0, False)]
    assert all(r.seconds >= 0 for r in log.records)
    assert log.totals()["all_reduce"][:2] == (2, 24)
    summary = log.summary()
    assert "all_reduce" in summary and "reduce_scatter" in summary and "algbw" in summary


def test_bad_arguments_raise_before_communicating(comm: Comm) -> None:
    w = comm.world_size
    with pytest.raises(ValueError, match="world_size"):
        comm.all_gather(torch.empty(3 * w + 1), torch.ones(3))
    with pytest.raises(ValueError, match="floating"):
        comm.all_reduce(torch.ones(2, dtype=torch.int32), "avg")
    with pytest.raises(ValueError, match="not a rank"):
        comm.broadcast(torch.ones(2), w)
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="op="):
        comm.all_reduce(torch.ones(2), "prod")  # type: ignore[arg-type]
    comm.barrier()  # still in step


def test_sequence_numbers_agree_and_peers_answer(comm: Comm) -> None:
    tracker = comm._tracker
    if tracker is None:  # world size 1: nothing to track (not rank-dependent)
        assert comm.world_size == 1
        return
    seqs = torch.empty(comm.world_size, dtype=torch.int64)
    comm.all_gather(seqs, torch.tensor([tracker._seq + 1]))  # this call is seq + 1
    assert len(set(seqs.tolist())) == 1, seqs
    my_seq = tracker._seq
    states, note = tracker._gather_peer_states()  # every peer's thread answers within ~0.2 s
    assert note == ""
    assert sorted(states) == list(range(comm.world_size))
    # A peer may already be in the barrier below (seq + 1), never behind.
    assert all(s["state"] == "running" and not s.get("stale") for s in states.values())
    assert all(my_seq <= s["seq"] <= my_seq + 1 for s in states.values()), states
    lines = describe_states(states, comm.world_size)
    assert all(any(line.startswith(f"  rank {r}: seq ") for line in lines)
               for r in range(comm.world_size)), lines
    comm.barrier()


def test_broken_group_refuses_further_collectives(groups: ProcessGroups) -> None:
    comm = Comm(groups)
    if comm._tracker is None:
        assert comm.world_size == 1
        return
    comm._tracker.broken = "injected"
    try:
        with pytest.raises(CommError, match="broken"):
            comm.barrier()
    finally:
        comm._tracker.broken = None
    comm.barrier()
