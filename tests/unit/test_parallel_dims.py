"""comm/parallel_dims.py: every dimension decided once from integers, as torchtitan tests its
`ParallelDims` (no process group): sizes, who asked for them, and the errors for layouts that do
not fit, each naming both sources."""

from __future__ import annotations

import doctest

import pytest

import zeroshard.comm.parallel_dims as parallel_dims
from zeroshard.comm.parallel_dims import MpuShape, ParallelDims, PipeShape, resolve_dims
from zeroshard.comm.topology import Topology
from zeroshard.errors import ConfigError, NotSupportedError


def _sizes(d: ParallelDims) -> tuple[int, ...]:
    return d.pp, d.dp, d.tp, d.ep, d.sp


@pytest.mark.parametrize(("world", "kwargs", "want", "split"), [
    (1, {}, (1, 1, 1, 1, 1), None),
    (8, {}, (1, 8, 1, 1, 1), None),
    (8, {"config_tp": 2}, (1, 4, 2, 1, 1), "autotp"),
    (8, {"recorded_tp": 4}, (1, 2, 4, 1, 1), "autotp"),
    (8, {"config_tp": 2, "recorded_tp": 2}, (1, 4, 2, 1, 1), "autotp"),
    (8, {"pipe": PipeShape(pp=2)}, (2, 4, 1, 1, 1), None),
    (8, {"pipe": PipeShape(pp=2), "config_tp": 2}, (2, 2, 2, 1, 1), "autotp"),
    (8, {"pipe": PipeShape(pp=2, model_axis=2)}, (2, 2, 2, 1, 1), "script"),
    (8, {"pipe": PipeShape(pp=2, model_axis=2), "config_tp": 2}, (2, 2, 2, 1, 1), "autotp"),
    (6, {"mpu": MpuShape(model_parallel=3, data_parallel=2)}, (1, 2, 3, 1, 1), "script"),
    (4, {"mpu": MpuShape(model_parallel=1, data_parallel=4)}, (1, 4, 1, 1, 1), None),
    (8, {"ep": 4}, (1, 8, 1, 4, 1), None),
    (8, {"config_tp": 2, "ep": 2}, (1, 4, 2, 2, 1), "autotp"),
    (8, {"sp": 2}, (1, 4, 1, 1, 2), None),
    (16, {"pipe": PipeShape(pp=2), "config_tp": 2, "sp": 2}, (2, 2, 2, 1, 2), "autotp"),
])
def test_sizes(world: int, kwargs: dict, want: tuple[int, ...], split: str | None) -> None:
    d = resolve_dims(world, **kwargs)
    assert _sizes(d) == want and d.tp_split == split
    assert d.pp * d.dp * d.tp * d.sp == world and d.topology.world_size == world
    assert d.expert_dp * d.ep == d.dp
    assert d.from_mpu == ("mpu" in kwargs)


def test_topology_puts_sequence_ranks_in_the_data_axis() -> None:
    assert resolve_dims(8, pipe=PipeShape(pp=2), sp=2).topology == Topology(pp=2, dp=4, tp=1)
    assert resolve_dims(8, config_tp=4).topology == Topology.for_world(8, tp=4)


def test_batch_counts_every_rank_only_as_an_alternative_under_autotp() -> None:
    assert resolve_dims(8, config_tp=2).batch_world_sizes == (4, 8)
    assert resolve_dims(8, pipe=PipeShape(pp=2, model_axis=2)).batch_world_sizes == (2,)
    assert resolve_dims(4, mpu=MpuShape(2, 2)).batch_world_sizes == (2,)
    assert resolve_dims(2, config_tp=2).batch_world_sizes == (1, 2)
    assert resolve_dims(4).batch_world_sizes == (4,)


def test_sources_name_who_asked() -> None:
    d = resolve_dims(8, pipe=PipeShape(pp=2), recorded_tp=2, ep=2)
    assert dict(d.sources) == {"pp": "the PipelineModule's topology", "tp": "tp_model_init",
                               "ep": "the expert-parallel size"}
    assert "pp 2 x dp 2 x tp 2 x ep 2 x sp 1 = 8 rank(s)" in d.describe()
    assert resolve_dims(1).describe() == "pp 1 x dp 1 x tp 1 x ep 1 x sp 1 = 1 rank(s)"


def test_hpz_splits_the_data_parallel_ranks() -> None:
    d = resolve_dims(8, hpz=4)
    assert (d.dp_shard, d.dp_replicate) == (4, 2)
    assert resolve_dims(8, hpz=0).dp_shard == 1 and resolve_dims(8).with_hpz(2).dp_replicate == 4
    with pytest.raises(ConfigError, match=r"zero_hpz_partition_size: got 3, but it must divide the data-parallel "
                                          r"world size \(8\)"):
        resolve_dims(8, hpz=3)
    with pytest.raises(ConfigError, match=r"got 4, but it must divide the data-parallel world size \(2\)"):
        resolve_dims(8, config_tp=4).with_hpz(4)


@pytest.mark.parametrize(("world", "kwargs", "error", "match"), [
    (4, {"config_tp": 2, "recorded_tp": 4}, ConfigError,
     r"tp_model_init\(tp_size=4\) and tensor_parallel.autotp_size \(2\) disagree"),
    (6, {"config_tp": 4}, ConfigError, r"cannot hold tensor-parallel size 4: their product \(4\) must divide"),
    (8, {"pipe": PipeShape(pp=3)}, ConfigError, r"cannot hold pipeline size 3"),
    (8, {"pipe": PipeShape(pp=2, model_axis=2), "config_tp": 4}, ConfigError,
     r"model \(tensor-parallel\) axis of 2, but the tensor-parallel size is 4; make tensor_parallel.autotp_size "
     r"equal num_mp"),
    (4, {"mpu": MpuShape(2, 2), "config_tp": 2}, NotSupportedError, r"mpu=\.\.\.\) together with tensor_parallel"),
    (4, {"mpu": MpuShape(1, 4), "pipe": PipeShape(pp=2)}, NotSupportedError, "PipelineModule together with mpu="),
    (4, {"mpu": MpuShape(2, 1)}, ConfigError, r"model-parallel size 2 x data-parallel size 1 != world size 4"),
    (8, {"ep": 3}, ConfigError, r"expert-parallel size 3 must divide the data-parallel size 8"),
    (8, {"config_tp": 2, "ep": 8}, ConfigError, r"expert-parallel size 8 must divide the data-parallel size 4"),
    (8, {"sp": 3}, ConfigError, r"cannot hold sequence-parallel size 3"),
    (8, {"ep": 0}, ConfigError, r"expert-parallel size: got 0"),
    (8, {"sp": 2, "ep": 2}, NotSupportedError, r"sequence parallelism \(size 2\) together with MoE expert parallelism"),
    (8, {"sp": 2, "hpz": 2}, NotSupportedError, r"zero_hpz_partition_size 2 together with sequence parallelism"),
    (0, {}, ConfigError, r"world size: got 0"),
])
def test_layouts_that_do_not_fit(world: int, kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        resolve_dims(world, **kwargs)


@pytest.mark.parametrize("dp, sp", [(1, 2), (2, 2), (1, 4), (3, 2)])
def test_sequence_groups_tile_the_data_axis(dp: int, sp: int) -> None:
    """Every position of the mesh's data axis (dp x sp) is in exactly one sequence group and one
    data-parallel group; a sequence group is consecutive, and it meets each data group once."""
    seq, data = ParallelDims(world_size=dp * sp, dp=dp, sp=sp).sequence_rank_lists()
    assert sorted(r for g in seq for r in g) == sorted(r for g in data for r in g) == list(range(dp * sp))
    assert [len(g) for g in seq] == [sp] * dp and [len(g) for g in data] == [dp] * sp
    assert all(g == list(range(g[0], g[0] + sp)) for g in seq)
    assert all(len(set(s) & set(d)) == 1 for s in seq for d in data)


def test_the_frozen_description_checks_itself() -> None:
    with pytest.raises(ValueError, match="pp x dp x tp x sp must be the world size"):
        ParallelDims(world_size=8, pp=2, dp=2)
    with pytest.raises(ValueError, match="expected a positive integer"):
        ParallelDims(world_size=1, tp=True)
    with pytest.raises(ValueError, match="ep and dp_shard must divide dp"):
        ParallelDims(world_size=4, dp=4, ep=3)
    d = resolve_dims(4, config_tp=2)
    with pytest.raises(AttributeError):
        d.tp = 4  # type: ignore[misc]


@pytest.mark.parametrize("module", [parallel_dims, Topology.__module__, "zeroshard.estimate.parallel"])
def test_doctests(module: object) -> None:
    import importlib

    mod = importlib.import_module(module) if isinstance(module, str) else module
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
