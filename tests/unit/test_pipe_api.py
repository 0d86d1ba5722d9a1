"""zeroshard.pipe without a process group: DeepSpeed's names and signatures, its exact stage
boundaries (against the installed DeepSpeed's partition functions), the topology grid queries,
the balanced partition, and the names DeepSpeed has that zeroshard refuses."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import os
import random
from typing import Any

import pytest
import torch
from signatures import parameters
from torch import nn

from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.pipe import (
    DualPipeVModule,
    LayerSpec,
    PipeDataParallelTopology,
    PipelineModule,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
    TiedLayerSpec,
)
from zeroshard.pipe.grid import default_topology
from zeroshard.pipe.module import count_layer_params, partition_layers
from zeroshard.pipe.partition import partition_min_max, partition_spread, partition_uniform

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def ds() -> Any:
    if not HAVE_DEEPSPEED:
        pytest.skip("DeepSpeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import utils
    from deepspeed.runtime.pipe import module, topology

    return type("DS", (), {"utils": utils, "module": module, "topology": topology})


SIGNATURES = [
    ("zeroshard.pipe:PipelineModule.__init__", "deepspeed.pipe:PipelineModule.__init__"),
    ("zeroshard.pipe:LayerSpec.__init__", "deepspeed.pipe:LayerSpec.__init__"),
    ("zeroshard.pipe:TiedLayerSpec.__init__", "deepspeed.pipe:TiedLayerSpec.__init__"),
    ("zeroshard.pipe:ProcessTopology.__init__", "deepspeed.runtime.pipe.topology:ProcessTopology.__init__"),
    ("zeroshard.pipe:PipeDataParallelTopology.__init__",
     "deepspeed.runtime.pipe.topology:PipeDataParallelTopology.__init__"),
    ("zeroshard.pipe:PipeModelDataParallelTopology.__init__",
     "deepspeed.runtime.pipe.topology:PipeModelDataParallelTopology.__init__"),
    ("zeroshard.runtime.pipe_engine:PipelineEngine.train_batch",
     "deepspeed.runtime.pipe.engine:PipelineEngine.train_batch"),
    ("zeroshard.runtime.pipe_engine:PipelineEngine.eval_batch",
     "deepspeed.runtime.pipe.engine:PipelineEngine.eval_batch"),
    ("zeroshard.runtime.pipe_engine:PipelineEngine.set_dataiterator",
     "deepspeed.runtime.pipe.engine:PipelineEngine.set_dataiterator"),
] + [(f"zeroshard.pipe:ProcessTopology.{m}", f"deepspeed.runtime.pipe.topology:ProcessTopology.{m}")
     for m in ("get_rank", "get_axis_names", "get_rank_repr", "get_dim", "get_coord", "get_axis_comm_lists",
               "filter_match", "get_axis_list", "world_size")
] + [(f"zeroshard.pipe:PipelineParallelGrid.{m}", f"deepspeed.runtime.pipe.topology:PipelineParallelGrid.{m}")
     for m in ("__init__", "stage_to_global", "get_data_parallel_rank", "get_pipe_parallel_rank")]

GRID_ATTRIBUTES = ("global_rank", "world_size", "data_parallel_size", "pipe_parallel_size", "model_parallel_size",
                   "slice_parallel_size", "stage_id", "data_parallel_id", "is_first_stage", "is_last_stage",
                   "dp_group", "pp_group", "p2p_groups")
"""What DeepSpeed's grid sets in its constructor and scripts read as attributes."""


@pytest.mark.parametrize(("ours", "theirs"), SIGNATURES, ids=[s[0].rpartition(":")[2] for s in SIGNATURES])
def test_signature_matches_deepspeed(ds: Any, ours: str, theirs: str) -> None:
    mine, ref = parameters(ours, theirs)
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    assert [n for n, p in mine.items() if p.kind in kinds] == [n for n, p in ref.items() if p.kind in kinds]
    for name, p in ref.items():
        assert name in mine, f"{ours} lacks DeepSpeed's parameter {name!r}"
        if p.kind is p.KEYWORD_ONLY and name == "tied_weight_attr":
            assert mine[name].default == p.default
        elif isinstance(p.default, (bool, int, float, str, type(None))) and name != "activation_checkpoint_func":
            assert mine[name].default == p.default, f"{ours}({name}=...): {mine[name].default!r} != {p.default!r}"


def _weight_lists() -> list[list[int]]:
    rng = random.Random(3)
    lists = [[1] * n for n in range(1, 12)]
    lists += [[0, 5, 5, 5, 5, 0], [100, 1, 1, 1, 1, 1, 1, 100], [0, 0, 1, 0, 1, 1, 0], [7]]
    lists += [[rng.choice([0, 1, 2, 3, 50, 1000]) for _ in range(rng.randint(1, 14))] for _ in range(60)]
    return lists


def test_uniform_and_parameter_boundaries_equal_deepspeeds(ds: Any) -> None:
    for weights in _weight_lists():
        for parts in range(1, 6):
            assert partition_uniform(len(weights), parts) == ds.utils.partition_uniform(len(weights), parts)
            assert partition_spread(weights, parts) == ds.utils.partition_balanced(weights, parts), (weights, parts)


class Embed(nn.Embedding):
    pass


class Block(nn.Module):
    def __init__(self, dim: int, wide: int = 2) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, wide * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)[..., : x.shape[-1]]


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x)


def _models() -> list[list[Any]]:
    rng = random.Random(5)
    out = []
    for _ in range(12):
        layers: list[Any] = [TiedLayerSpec("e", Embed, 16, 8)]
        for _ in range(rng.randint(1, 9)):
            layers.append(rng.choice([LayerSpec(Block, 8, rng.randint(1, 4)), _gelu, LayerSpec(nn.LayerNorm, 8)]))
        layers.append(TiedLayerSpec("e", Embed, 16, 8))
        out.append(layers)
    return out


def test_method_boundaries_equal_deepspeeds(ds: Any) -> None:
    """Per method, the layer weights DeepSpeed's PipelineModule computes, through its functions."""
    for layers in _models():
        counts = [sum(p.numel() for p in s.build().parameters()) if isinstance(s, LayerSpec) else 0 for s in layers]
        assert count_layer_params(layers) == counts
        for parts in range(1, min(5, len(layers)) + 1):
            assert partition_layers(layers, "uniform", parts) == ds.utils.partition_uniform(len(layers), parts)
            assert partition_layers(layers, "parameters", parts) == ds.utils.partition_balanced(counts, parts)
            typed = [1 if isinstance(s, LayerSpec) and s.typename is Block else 0 for s in layers]
            if any(typed):
                assert partition_layers(layers, "type:block", parts) == ds.utils.partition_balanced(typed, parts)


def test_balanced_partition_never_leaves_a_stage_empty() -> None:
    for weights in _weight_lists():
        for parts in range(1, len(weights) + 1):
            cut = partition_min_max(weights, parts)
            assert cut[0] == 0 and cut[-1] == len(weights)
            assert all(a < b for a, b in itertools.pairwise(cut)), (weights, parts, cut)
            heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(cut))
            assert heaviest <= max(sum(weights[a:b]) for a, b in itertools.pairwise(
                partition_uniform(len(weights), parts)))
    assert partition_min_max([1, 1, 1, 10], 2) == [0, 3, 4]
    with pytest.raises(ValueError, match="at least one layer per stage"):
        partition_min_max([1, 2], 3)


def test_unknown_partition_method_and_unmatched_type() -> None:
    layers = [LayerSpec(nn.Linear, 2, 2)] * 3
    with pytest.raises(ConfigError, match="partition_method='best'"):
        partition_layers(layers, "best", 2)
    with pytest.raises(ConfigError, match="no layer's type matches"):
        partition_layers(layers, "type:conv", 2)


def test_topology_queries_equal_deepspeeds(ds: Any) -> None:
    pairs = [(PipeDataParallelTopology(num_pp=2, num_dp=3), ds.topology.PipeDataParallelTopology(num_pp=2, num_dp=3)),
             (PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2),
              ds.topology.PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)),
             (ProcessTopology(["x", "y"], [2, 3]), ds.topology.ProcessTopology(["x", "y"], [2, 3]))]
    for ours, theirs in pairs:
        assert ours.world_size() == theirs.world_size()
        for axis in ours.get_axis_names():
            assert ours.get_dim(axis) == theirs.get_dim(axis)
            assert ours.get_axis_comm_lists(axis) == theirs.get_axis_comm_lists(axis)
            for i in range(ours.get_dim(axis)):
                assert ours.get_axis_list(axis, i) == theirs.get_axis_list(axis, i)
                assert ours.filter_match(**{axis: i}) == theirs.filter_match(**{axis: i})
        assert ours.get_dim("nope") == 0 and ours.get_axis_comm_lists("nope") == []
        for rank in range(ours.world_size()):
            assert tuple(ours.get_coord(rank)) == tuple(theirs.get_coord(rank))
            assert ours.get_rank(**ours.get_coord(rank)._asdict()) == rank
            assert ours.get_rank_repr(rank) == theirs.get_rank_repr(rank)


def test_topology_maps_onto_zeroshards_mesh_order() -> None:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3).as_topology()
    grid = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    for rank in range(12):
        c = grid.get_coord(rank)
        assert topo.coord(rank) == {"pp": c.pipe, "dp": c.data, "tp": c.model}
    with pytest.raises(ValueError, match="no zeroshard equivalent"):
        ProcessTopology(["data", "pipe"], [2, 2]).as_topology()


def test_single_stage_module_builds_every_layer_under_global_names() -> None:
    net = PipelineModule([TiedLayerSpec("e", Embed, 16, 8), LayerSpec(Block, 8), _gelu,
                          TiedLayerSpec("e", Embed, 16, 8, forward_fn=lambda m, x: x @ m.weight.t())],
                         num_stages=1, seed_layers=True)
    names = [n for n, _ in net.named_parameters()]
    assert names == ["tied_modules.e.weight", "1.fc.weight", "1.fc.bias"]
    assert net(torch.tensor([[1, 2]])).shape == (1, 2, 16)
    assert net.stage_owner(3) == 0 and net.partitions() == [0, 4]
    with pytest.raises(ConfigError, match="num_stages= or topology="):
        PipelineModule([LayerSpec(Block, 8)])
    with pytest.raises(ConfigError, match="must divide the world size"):
        PipelineModule([LayerSpec(Block, 8)] * 3, num_stages=2)
    with pytest.raises(TypeError, match="nn.Module types"):
        LayerSpec(int)


def test_partition_summary_counts_whole_layers_after_an_in_place_split() -> None:
    """AutoTP replaces a module layer's Linears by this rank's pieces on its own stage only; the summary
    keeps the whole counts every stage is described with (it used to mix a split stage with whole ones)."""
    layers = [nn.Linear(8, 16), nn.Linear(16, 8)]
    net = PipelineModule(layers, num_stages=1)
    before = net.describe_partition()
    assert "layers [0, 2) 280 params (100%)" in before
    layers[0].weight = nn.Parameter(torch.zeros(8, 8))  # as a column split to 2 ranks leaves it
    layers[0].bias = nn.Parameter(torch.zeros(8))
    assert net.describe_partition() == before


def test_grid_has_every_public_method_of_deepspeeds(ds: Any) -> None:
    theirs = {n for n in vars(ds.topology.PipelineParallelGrid) if not n.startswith("_")}
    missing = sorted(n for n in theirs if not hasattr(PipelineParallelGrid, n))
    assert not missing, f"PipelineParallelGrid lacks DeepSpeed's {missing}"


def test_grid_at_world_size_one_without_a_process_group() -> None:
    """`python train.py` with a one-stage PipelineModule: the grid answers with no group to build."""
    net = PipelineModule([LayerSpec(nn.Linear, 2, 2)], num_stages=1)
    grid = net._grid
    assert net.mpu() is grid and grid.topology() is net.topology()
    assert all(hasattr(grid, name) for name in GRID_ATTRIBUTES)
    assert (grid.get_stage_id(), grid.get_data_parallel_rank(), grid.get_slice_parallel_rank()) == (0, 0, 0)
    assert grid.is_first_stage and grid.is_last_stage and grid.p2p_groups == [[0, 0]]
    assert grid.get_data_parallel_world_size() == grid.get_pipe_parallel_world_size() == 1
    assert grid.stage_to_global(0) == 0 and grid.get_data_parallel_group_ranks() == [0]
    assert [(t.get_dim("pipe"), t.get_dim("data")) for t in map(default_topology, (1, 2, 6, 8, 12))] == [
        (1, 1), (2, 1), (2, 3), (4, 2), (6, 2)]  # DeepSpeed's prime factors, dealt pipe, data, pipe, ...


def test_dualpipev_is_refused_by_name() -> None:
    with pytest.raises(NotSupportedError, match="DualPipeVModule"):
        DualPipeVModule()


def test_importable_through_the_deepspeed_alias() -> None:
    import subprocess
    import sys

    code = ("import zeroshard.compat as c; c.install(); import deepspeed, deepspeed.pipe as p; "
            "from deepspeed.runtime.pipe.topology import PipeDataParallelTopology; "
            "import zeroshard.pipe as z; print(p.PipelineModule is z.PipelineModule, deepspeed.pipe.LayerSpec is "
            "z.LayerSpec, PipeDataParallelTopology is z.PipeDataParallelTopology)")
    env = {**os.environ, "ZEROSHARD_ALIAS_QUIET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert out.stdout.split() == ["True", "True", "True"], out.stderr[-2000:]
