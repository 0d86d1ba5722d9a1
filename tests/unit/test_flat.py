"""Partition and bucket arithmetic (pure: world sizes are ints)."""

from __future__ import annotations

import pytest
import torch

from zeroshard.zero.flat import FlatLayout, param_views, plan_buckets


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("align", [1, 4, 16])
def test_partitions_cover_buffer_evenly(world: int, align: int) -> None:
    layout = FlatLayout((10, 3, 17, 1), world_size=world, align=align)
    assert layout.numel == 31
    assert layout.padded_numel % (world * align) == 0 and layout.padded_numel >= 31
    assert layout.padded_numel - 31 < world * align  # padding only at the end, less than one row
    ranges = [layout.partition(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all((end - start) % align == 0 for start, end in ranges)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_fragments_reassemble_every_parameter(world: int) -> None:
    numels = (10, 3, 17, 1, 0, 6)
    layout = FlatLayout(numels, world_size=world)
    covered = [0] * len(numels)
    for rank in range(world):
        for f in layout.rank_fragments(rank):
            assert layout.offsets[f.param_index] + f.param_offset == f.flat_offset
            covered[f.param_index] += f.numel
    assert covered == list(numels)


def test_a_partition_cuts_a_parameter() -> None:
    layout = FlatLayout((5, 5), world_size=3)  # 12 padded -> ranges of 4
    frags = layout.rank_fragments(1)  # [4, 8): last 1 of p0, first 3 of p1
    assert [(f.param_index, f.param_offset, f.numel) for f in frags] == [(0, 4, 1), (1, 0, 3)]


def test_bad_layouts_are_rejected() -> None:
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout((1,), world_size=0)
    with pytest.raises(ValueError, match="rank 2 outside"):
        FlatLayout((4,), world_size=2).partition(2)


def test_buckets_hold_whole_params_in_order() -> None:
    assert plan_buckets([4, 4, 4, 10, 1], 8) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert plan_buckets([4, 4], 100) == [(0, 2)]
    assert plan_buckets([], 8) == []
    with pytest.raises(ValueError, match="bucket size"):
        plan_buckets([1], 0)


def test_param_views_share_storage() -> None:
    layout = FlatLayout((6, 2))
    flat = torch.arange(8.0)
    a, b = param_views(flat, layout, [torch.Size([2, 3]), torch.Size([2])])
    assert a.shape == (2, 3) and b.tolist() == [6.0, 7.0]
    flat[7] = -1
    assert b[1] == -1


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bucketed_partition_shards_reassemble(world: int) -> None:
    from zeroshard.zero.flat import BucketedPartition

    numels = [7, 5, 12, 3, 9]
    plan = BucketedPartition(numels, bucket_numel=13, world_size=world, align=2)
    values = [torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate(numels)]
    flat = torch.zeros(plan.padded_numel)
    for i, v in enumerate(values):
        flat[plan.param_flat_offsets[i] : plan.param_flat_offsets[i] + v.numel()] = v
    rebuilt = [torch.full_like(v, -1.0) for v in values]
    for rank in range(world):
        shard = torch.cat([flat[slice(*plan.chunk_range(b, rank))] for b in range(len(plan.buckets))])
        assert shard.numel() == plan.shard_numel
        for f in plan.rank_fragments(rank):
            rebuilt[f.param_index][f.param_offset : f.param_offset + f.numel] = shard[
                f.shard_offset : f.shard_offset + f.numel]
            assert plan.shard_range(f.bucket)[0] <= f.shard_offset < plan.shard_range(f.bucket)[1]
    for got, want in zip(rebuilt, values):
        assert torch.equal(got, want)
    assert plan.padded_numel == world * plan.shard_numel
