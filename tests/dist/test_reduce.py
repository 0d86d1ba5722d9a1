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


@pytest.mark.parametrize("mode", list(ReduceMode))
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
