"""The shared-memory collectives (Note: [shared-memory collectives] in zeroshard/comm/shm.py).

Runs under torchrun at 2, 3 and 4 ranks (one host: the arena is in use; a test says so). Each
collective is compared bitwise with an expectation reduced locally in rank order, on tensors
larger than one half of a rank's row (several pieces, both halves reused), in several dtypes;
at 2 ranks also with gloo's own result, which it equals bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from zeroshard.comm import Comm
from zeroshard.comm.shm import HALF_BYTES, Arena

pytestmark = pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) < 2, reason="needs torchrun with 2+ ranks")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def _arena(comm: Comm) -> Arena:
    arena = comm._arena(torch.empty(1))
    assert arena is not None, "one host, x86-64: the group's collectives should use the arena"
    return arena


def contribution(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def _reduced(world: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    f = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    acc = contribution(0, n, dtype)
    for j in range(1, world):
        acc = f(acc, contribution(j, n, dtype))
    return acc


def _sizes(dtype: torch.dtype) -> list[int]:
    per_half = HALF_BYTES // torch.empty((), dtype=dtype).element_size()
    return [1, 7, per_half + 3, 2 * per_half + per_half // 2 + 1]


def test_the_arena_is_used(comm: Comm) -> None:
    arena = _arena(comm)
    assert arena.world_size == comm.world_size and arena.half_bytes > 0
    before = arena._piece
    comm.all_reduce(torch.ones(10))
    assert arena._piece == before + 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "max", "min", "avg"])
@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce(comm: Comm, dtype: torch.dtype, op: str, async_op: bool) -> None:
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("avg needs a floating dtype (refused by Comm, tested in test_comm.py)")
    _arena(comm)
    w = comm.world_size
    for n in _sizes(dtype):
        t = contribution(comm.rank, n, dtype)
        comm.all_reduce(t, op, async_op=async_op).wait()  # type: ignore[arg-type]
        expected = _reduced(w, n, dtype, "sum" if op == "avg" else op)
        if op == "avg":
            expected = expected.div_(w)
        assert torch.equal(t, expected), (op, dtype, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather(comm: Comm, dtype: torch.dtype) -> None:
    w = comm.world_size
    for n in _sizes(dtype):
        out = torch.empty(w * n, dtype=dtype)
        comm.all_gather(out, contribution(comm.rank, n, dtype), async_op=True).wait()
        assert torch.equal(out, torch.cat([contribution(j, n, dtype) for j in range(w)])), (dtype, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter(comm: Comm, dtype: torch.dtype, op: str) -> None:
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("avg needs a floating dtype")
    w, r = comm.world_size, comm.rank
    for n in _sizes(dtype):
        in_ = contribution(r, w * n, dtype)
        out = torch.empty(n, dtype=dtype)
        comm.reduce_scatter(out, in_, op)  # type: ignore[arg-type]
        expected = _reduced(w, w * n, dtype, "sum")[r * n:(r + 1) * n]
        if op == "avg":
            expected = expected.div_(w)
        assert torch.equal(out, expected), (dtype, n)
        assert torch.equal(in_, contribution(r, w * n, dtype))  # left unchanged


@pytest.mark.parametrize("src", ["first", "last"])
def test_broadcast(comm: Comm, src: str) -> None:
    root = 0 if src == "first" else comm.world_size - 1
    for n in _sizes(torch.float32):
        t = contribution(comm.rank, n, torch.float32)
        comm.broadcast(t, root)
        assert torch.equal(t, contribution(root, n, torch.float32))


def test_in_place_all_gather(comm: Comm) -> None:
    """The input is this rank's chunk of the output (what ZeRO-1/2's post-step gather avoids
    with a clone, and what the arena allows)."""
    w, r, n = comm.world_size, comm.rank, 1000
    out = torch.zeros(w * n)
    out[r * n:(r + 1) * n] = contribution(r, n, torch.float32)
    comm.all_gather(out, out[r * n:(r + 1) * n])
    assert torch.equal(out, torch.cat([contribution(j, n, torch.float32) for j in range(w)]))


def test_equals_gloo_at_two_ranks(comm: Comm) -> None:
    """At 2 ranks a sum has one order: the arena's results are gloo's bits."""
    if comm.world_size != 2:
        pytest.skip("a sum of 3+ terms depends on the order; the arena's is rank order")
    n = 3 * HALF_BYTES // 4 // 2 + 5
    for dtype in (torch.float32, torch.bfloat16):
        mine = contribution(comm.rank, n, dtype)
        ref = mine.clone()
        dist.all_reduce(ref, group=comm.groups.dp_group)
        comm.all_reduce(mine)
        assert torch.equal(mine, ref), dtype


def test_interleaved_with_gloo_collectives(comm: Comm) -> None:
    """Arena collectives between gloo ones (all-to-all, gather) in flight at the same time."""
    w, r = comm.world_size, comm.rank
    a2a_in = torch.arange(4 * w, dtype=torch.float32) + 100 * r
    a2a_out = torch.empty_like(a2a_in)
    h1 = comm.all_to_all(a2a_out, a2a_in, async_op=True)
    s = contribution(r, 5000, torch.float32)
    h2 = comm.all_reduce(s, async_op=True)
    g = torch.empty(w * 3)
    h3 = comm.all_gather(g, torch.full((3,), float(r)), async_op=True)
    for h in (h3, h1, h2):
        h.wait()
    assert torch.equal(s, _reduced(w, 5000, torch.float32, "sum"))
    assert torch.equal(g, torch.arange(w, dtype=torch.float32).repeat_interleave(3))
    expected = torch.cat([torch.arange(4 * r, 4 * r + 4, dtype=torch.float32) + 100 * j for j in range(w)])
    assert torch.equal(a2a_out, expected)


def test_a_peer_that_never_comes_is_named_at_the_timeout(comm: Comm) -> None:
    """An arena of its own (the group's stays in step): rank 0 gathers alone and gives up at the
    timeout, naming the ranks that did not come."""
    from zeroshard.comm.board import Board
    from zeroshard.comm.groups import group_store

    store = dist.PrefixStore("test-shm/lonely/", group_store(comm.groups.dp_group))
    board = Board.create(store, comm.rank, comm.world_size, 30.0)
    assert board is not None and board.arena is not None
    if comm.rank == 0:
        others = ", ".join(map(str, range(1, comm.world_size)))
        with pytest.raises(TimeoutError, match=rf"shared-memory all-gather: ranks? {others} did not reach it"):
            board.arena.all_gather(torch.empty(2 * comm.world_size), torch.ones(2), timeout_s=0.3)
    board.close()
    comm.barrier()
