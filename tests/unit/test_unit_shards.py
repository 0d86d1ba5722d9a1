"""Stage 3's shard home and gather routes (zero/unit_shards.py, zero/gather.py) at world size 1,
without a process group: which route each gather takes, what a gather and a write do to the
shard, and a unit buffer's gather / release life. The multi-rank behaviour is tests/dist's."""

from __future__ import annotations

import torch

from zeroshard.comm import Comm
from zeroshard.comm.groups import ProcessGroups
from zeroshard.zero.flat import BucketedPartition
from zeroshard.zero.gather import QuantizedGather, UnitGather
from zeroshard.zero.offload.policy import OffloadPolicy
from zeroshard.zero.strategy import BytesByHome
from zeroshard.zero.unit_shards import InMemoryShard, UnitBuffer, UnitShards, open_shard_home

CPU = torch.device("cpu")


def _shards(quantized: bool) -> tuple[BucketedPartition, UnitShards]:
    plan = BucketedPartition([6, 10, 3], world_size=1, align=4, buckets=[(0, 2), (2, 3)])
    home = open_shard_home(OffloadPolicy(), plan.shard_numel, torch.float32, CPU, rank=0)
    return plan, UnitShards(plan, Comm(ProcessGroups.single()), rank=0, home=home, device=CPU, persistent=1,
                            quantized=quantized, secondary=None)


def test_routes_exact_for_persistent_and_user_gathers_quantized_otherwise() -> None:
    _, plain = _shards(quantized=False)
    assert type(plain.gather_for(0, exact=False)) is UnitGather and plain.gather_for(0, exact=False).exact
    _, qwz = _shards(quantized=True)
    assert isinstance(qwz.gather_for(0, exact=False), QuantizedGather) and not qwz.gather_for(0, exact=False).exact
    assert qwz.gather_for(0, exact=True).exact, "a user gather is exact (Note: [exact gathers])"
    assert qwz.gather_for(1, exact=False).exact, "the persistent unit is exact"
    assert isinstance(qwz.home, InMemoryShard) and qwz.shard is qwz.home.tensor


def test_fill_gather_write_round_trip() -> None:
    plan, shards = _shards(quantized=False)
    full = torch.arange(plan.layouts[0].padded_numel, dtype=torch.float32)
    shards.fill(0, full)
    assert torch.equal(shards.chunk(0), full), "world 1: the chunk is the whole unit"
    unit = UnitBuffer(torch.zeros_like(full))
    unit.free()
    assert unit.released and unit.full.untyped_storage().nbytes() == 0
    unit.start(shards.gather_for(0, exact=False), 0)
    assert unit.finish() and not unit.released and torch.equal(unit.full, full)
    assert not unit.finish(), "nothing left to wait for"
    unit.full.mul_(2)
    chunk = shards.write(0, unit.full)
    assert torch.equal(chunk, 2 * full) and torch.equal(shards.chunk(0), 2 * full)
    unit.invalidate()
    assert unit.released and unit.full.untyped_storage().nbytes() > 0, "invalidate keeps the storage"
    acc = BytesByHome()
    shards.count_bytes(acc, "cpu", CPU)
    assert acc.result()[0].params == plan.shard_numel * 4


def test_quantized_route_is_close_not_equal() -> None:
    plan, shards = _shards(quantized=True)
    full = torch.linspace(-1, 1, plan.layouts[0].padded_numel)
    shards.fill(0, full)
    unit = UnitBuffer(torch.zeros_like(full))
    unit.start(shards.gather_for(0, exact=False), 0)
    unit.finish()
    assert not unit.exact and torch.allclose(unit.full, full, atol=1 / 254 + 1e-6)
    assert not torch.equal(unit.full, full), "int8 codes on the wire round the values"
