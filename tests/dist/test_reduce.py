"""The one gradient reducer (zero/reduce.py) on its own, in every mode.

The stages choose all-reduce-and-keep-a-chunk on gloo (zero/build.py), so the reduce-scatter
mode is checked here directly against hand-computed sums: two micro-batches fold (copy, then
add) into the target, staging blocks come back to the pool and are reused, prescale divides.
"""

from __future__ import annotations

import pytest
import torch

from zeroshard.zero.reduce import GradReducer, LaunchOrder, ReduceMode, ReduceOptions


def _grad(rank: int, micro: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + micro)
    return torch.randn(numel, generator=g)


EXACT_MODES = [m for m in ReduceMode if m is not ReduceMode.QUANTIZED_REDUCE_SCATTER]


@pytest.mark.parametrize("mode", EXACT_MODES)
@pytest.mark.parametrize("overlap", [True, False])
def test_reducer_folds_sums(comm, groups, mode: ReduceMode, overlap: bool) -> None:
    world, rank = groups.world_size, groups.rank
    sizes = [4 * world, 8 * world, 4 * world, 4 * world]  # four buckets, two sizes
    reducer = GradReducer(comm, ReduceOptions(mode=mode, grad_dtype=torch.float32, prescale_factor=2.0,
                                              overlap_comm=overlap), device=torch.device("cpu"))
    chunks = [n // world for n in sizes]
    shard = torch.zeros(sum(chunks))
    targets = list(shard.split(chunks))
    whole = [torch.zeros(n) for n in sizes]  # ALL_REDUCE: reduced in place
    for micro in range(2):
        for b, n in enumerate(sizes):
            g = _grad(rank, micro * 10 + b, n)
            if mode is ReduceMode.ALL_REDUCE:
                whole[b].copy_(g)
                reducer.launch(b, whole[b])
            else:
                reducer.accumulate(b, n, 0, g, first=True)
                reducer.launch(b, reducer.staging(b, n), targets[b])
        reducer.drain()
        reducer.end_micro_batch()
        if mode is ReduceMode.ALL_REDUCE:
            for b, n in enumerate(sizes):
                want = sum(_grad(r, micro * 10 + b, n) for r in range(world)) / 2.0
                torch.testing.assert_close(whole[b], want)
    if mode is not ReduceMode.ALL_REDUCE:
        for b, n in enumerate(sizes):
            want = sum(_grad(r, m * 10 + b, n) for r in range(world) for m in range(2)) / 2.0
            torch.testing.assert_close(targets[b], want[rank * chunks[b] : (rank + 1) * chunks[b]])
        # Pooled by size: at most three blocks of the common size and one of the other.
        assert reducer.pool_bytes() <= 4 * (3 * sizes[0] + sizes[1])
    reducer.end_step()


@pytest.mark.parametrize("bits,qmax", [(4, 7), (8, 127)])
@pytest.mark.parametrize("overlap", [True, False])
def test_quantized_reduce_scatter_within_bound(comm, groups, bits: int, qmax: int,
                                               overlap: bool) -> None:
    """qgZ: every element of the folded chunk is within the summed per-rank block bounds of
    the exact sum, over two micro-batches; the error is real (not exact) but small."""
    world, rank = groups.world_size, groups.rank
    block = 16
    sizes = [40 * world, 7 * world]  # chunks of 40 (blocks 16+16+8) and 7 (one short block)
    reducer = GradReducer(comm, ReduceOptions(
        mode=ReduceMode.QUANTIZED_REDUCE_SCATTER, grad_dtype=torch.float32, prescale_factor=2.0,
        overlap_comm=overlap, quant_bits=bits, quant_block_numel=block), device=torch.device("cpu"))
    chunks = [n // world for n in sizes]
    targets = list(torch.zeros(sum(chunks)).split(chunks))
    for micro in range(2):
        for b, n in enumerate(sizes):
            reducer.accumulate(b, n, 0, _grad(rank, micro * 10 + b, n), first=True)
            reducer.launch(b, reducer.staging(b, n), targets[b])
        reducer.drain()
        reducer.end_micro_batch()
    for b, n in enumerate(sizes):
        k = chunks[b]
        mine = slice(rank * k, (rank + 1) * k)
        want = torch.zeros(k)
        bound = torch.full((k,), 1e-6)
        for r in range(world):
            for m in range(2):
                g = _grad(r, m * 10 + b, n)[mine] / 2.0
                want += g
                amax = torch.stack([blk.abs().max() for blk in g.split(block)])
                sizes_ = [len(blk) for blk in g.split(block)]
                bound += torch.repeat_interleave(amax, torch.tensor(sizes_)) / (2 * qmax)
        err = (targets[b] - want).abs()
        assert bool((err <= bound).all()), f"bucket {b}: max excess {float((err - bound).max())}"
        if world > 1:
            assert float(err.max()) > 0  # it really was quantised
    reducer.end_step()


@pytest.mark.parametrize("bits,ratio", [(4, 1 / 8), (8, 1 / 4)])
def test_quantized_reduce_scatter_bytes_on_the_wire(groups, bits: int, ratio: float) -> None:
    """The comm log's bytes for one bucket: int4 ~ 1/8 of an fp32 reduce-scatter's input
    (1/4 of bf16), int8 ~ 1/4 (1/2 of bf16), scales included (one per 2048 elements)."""
    from zeroshard.comm import Comm, CommLog

    world = groups.world_size
    n = 2048 * 8 * world
    logged: dict[ReduceMode, int] = {}
    for mode in (ReduceMode.REDUCE_SCATTER, ReduceMode.QUANTIZED_REDUCE_SCATTER):
        log = CommLog()
        reducer = GradReducer(Comm(groups, log=log), ReduceOptions(
            mode=mode, grad_dtype=torch.float32, quant_bits=bits), device=torch.device("cpu"))
        reducer.accumulate(0, n, 0, torch.randn(n), first=True)
        reducer.launch(0, reducer.staging(0, n), torch.zeros(n // world))
        reducer.drain()
        logged[mode] = sum(nbytes for _, nbytes, _ in log.totals().values())
    assert logged[ReduceMode.REDUCE_SCATTER] == 4 * n
    quantized = logged[ReduceMode.QUANTIZED_REDUCE_SCATTER]
    assert ratio < quantized / (4 * n) < ratio * 1.01, (quantized, 4 * n)


def test_launch_order_in_order_and_by_unit() -> None:
    bucket_of = [0, 0, 1, 2, 2]
    ordered = LaunchOrder(bucket_of, [2, 1, 2], in_order=True)
    assert ordered.arrive(2) == []          # bucket 1 is complete but bucket 0 is not
    assert ordered.arrive(0) == []
    assert ordered.arrive(1) == [0, 1]      # both launch, in index order
    assert ordered.arrive(1) == []          # a second gradient of the same parameter
    for b in (0, 1):
        ordered.mark_launched(b)
    assert ordered.remaining() == [2]
    units = LaunchOrder(bucket_of, [2, 1, 2], in_order=False)
    assert units.arrive(2) == [1]           # a unit launches as soon as it completes
    assert units.seen(2) and not units.seen(0)


def _hierarchy_node_size(world: int) -> int:
    """2 ranks per node at 4 ranks (two nodes: both levels move data); at 1, 2 and 3 ranks one
    level degenerates (one node of 2, or nodes of 1), which still runs every step."""
    return 2 if world % 2 == 0 else 1


@pytest.mark.parametrize("overlap", [True, False])
def test_hierarchical_quantized_reduce_scatter_within_bound(comm, groups, overlap: bool) -> None:
    """qgZ within the node (int8), then across (int4): Note: [hierarchical qgZ]'s bound,
    sum_j A_j * (1/254 + 255/254/14) per micro-batch, A_j = max |g| of rank j's bucket."""
    from zeroshard.comm.groups import node_rank_lists

    world, rank = groups.world_size, groups.rank
    s = _hierarchy_node_size(world)
    nodes, cross = node_rank_lists(world, s)
    hierarchy = (comm.split(nodes, "node"), comm.split(cross, "cross"))
    block = 16
    sizes = [40 * world, 7 * world]
    reducer = GradReducer(comm, ReduceOptions(
        mode=ReduceMode.QUANTIZED_REDUCE_SCATTER, grad_dtype=torch.float32, overlap_comm=overlap,
        quant_bits=4, quant_block_numel=block), device=torch.device("cpu"), hierarchy=hierarchy)
    chunks = [n // world for n in sizes]
    targets = list(torch.zeros(sum(chunks)).split(chunks))
    for micro in range(2):
        for b, n in enumerate(sizes):
            reducer.accumulate(b, n, 0, _grad(rank, micro * 10 + b, n), first=True)
            reducer.launch(b, reducer.staging(b, n), targets[b])
        reducer.drain()
        reducer.end_micro_batch()
    per_amax = 1 / 254 + 255 / 254 / 14
    for b, n in enumerate(sizes):
        k = chunks[b]
        mine = slice(rank * k, (rank + 1) * k)
        want = torch.zeros(k)
        bound = 1e-6
        for r in range(world):
            for m in range(2):
                g = _grad(r, m * 10 + b, n)
                want += g[mine]
                bound += float(g.abs().max()) * per_amax
        err = (targets[b] - want).abs()
        assert float(err.max()) <= bound, f"bucket {b}: max error {float(err.max())} > {bound}"
        if world > 1:
            assert float(err.max()) > 0  # it really was quantised
    reducer.end_step()


def test_hierarchical_qgz_bytes_by_group(groups) -> None:
    """Bytes per rank for one bucket of P fp32 elements: P int8 codes inside the node (+ scales),
    P / (2 s) int4 bytes across nodes (+ scales): 1/(8 s) of the fp32 input crosses."""
    from zeroshard.comm import Comm, CommLog
    from zeroshard.comm.groups import node_rank_lists

    world = groups.world_size
    s = _hierarchy_node_size(world)
    log = CommLog()
    comm = Comm(groups, log=log)
    nodes, cross = node_rank_lists(world, s)
    reducer = GradReducer(comm, ReduceOptions(mode=ReduceMode.QUANTIZED_REDUCE_SCATTER,
                                              grad_dtype=torch.float32, quant_bits=4),
                          device=torch.device("cpu"), hierarchy=(comm.split(nodes, "node"), comm.split(cross, "cross")))
    n = 2048 * 4 * world * s  # chunks of whole blocks
    target = torch.zeros(n // world)
    reducer.accumulate(0, n, 0, _grad(groups.rank, 0, n), first=True)
    reducer.launch(0, reducer.staging(0, n), target)
    reducer.drain()
    by_group: dict[str, int] = {}
    for r in log.records:
        by_group[r.group] = by_group.get(r.group, 0) + r.bytes
    assert set(by_group) == {"node", "cross"}
    assert by_group["node"] == n + 4 * n // 2048  # int8 codes + one fp32 scale per 2048
    assert by_group["cross"] == n // s // 2 + 4 * (n // s) // 2048  # int4 codes + scales
