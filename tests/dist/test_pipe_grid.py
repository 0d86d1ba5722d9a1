"""DeepSpeed's `engine.grid` (`PipelineParallelGrid`) in the shape real pipeline scripts use it: the
script shards its dataset with `grid.get_data_parallel_rank()` / `get_data_parallel_world_size()`
(DeepSpeedExamples' pipeline scripts, Megatron-DeepSpeed), and the run equals the same layers in one
process. World 1: one stage; 2: PP 2; 3: PP 3; 4 (dist4): PP 2 x DP 2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import zeroshard
from zeroshard.comm import ProcessGroups
from zeroshard.pipe import PipelineModule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_pipeline import BASE_SEED, GAS, MICRO, check_against_reference, data, loss_fn, pipe_config, specs

STEPS, BLOCKS = 3, 2


def _stages(world: int) -> int:
    return 2 if world in (2, 4) else world


def _dataset(dp: int) -> TensorDataset:
    """test_pipeline's data laid out as one dataset, so that DistributedSampler(shuffle=False) over dp
    replicas hands data-parallel rank d exactly the micro-batches test_pipeline's reference gives it."""
    rows = [(ids[i], labels[i]) for step in data(STEPS, dp) for j in range(GAS * MICRO)
            for d in range(dp) for ids, labels in [step[d][j // MICRO]] for i in [j % MICRO]]
    return TensorDataset(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]))


def test_a_script_shards_its_data_with_engine_grid(groups: ProcessGroups) -> None:
    stages = _stages(groups.world_size)
    net = PipelineModule(specs(BLOCKS, False), num_stages=stages, loss_fn=loss_fn, seed_layers=True,
                         base_seed=BASE_SEED)
    engine, *_ = zeroshard.initialize(model=net, config=pipe_config(1, clip=0.0))
    grid = engine.grid
    dp = grid.get_data_parallel_world_size()
    assert dp == groups.world_size // stages and grid.get_pipe_parallel_world_size() == stages
    sampler = DistributedSampler(_dataset(dp), num_replicas=dp, rank=grid.get_data_parallel_rank(), shuffle=False)
    batches = iter(DataLoader(sampler.dataset, batch_size=MICRO, sampler=sampler))
    losses = [float(engine.train_batch(batches)) for _ in range(STEPS)]
    check_against_reference(engine, losses, BLOCKS, False, STEPS, dp, clip=0.0)


def test_grid_answers_as_deepspeeds(groups: ProcessGroups) -> None:
    stages = _stages(groups.world_size)
    net = PipelineModule(specs(BLOCKS, False), num_stages=stages, loss_fn=loss_fn)
    engine, *_ = zeroshard.initialize(model=net, config=pipe_config(0, clip=0.0))
    grid, rank = engine.grid, groups.rank
    assert engine.mpu is grid and net._grid is grid and net.mpu() is grid
    dp = groups.world_size // stages
    # DeepSpeed's layout: axes (pipe, data), data fastest.
    assert grid.get_global_rank() == rank and grid.get_stage_id() == rank // dp == engine.stage_id
    assert grid.get_data_parallel_rank() == rank % dp
    assert grid.is_first_stage == (rank // dp == 0) and grid.is_last_stage == (rank // dp == stages - 1)
    assert grid.get_data_parallel_group_ranks() == [rank // dp * dp + d for d in range(dp)]
    assert grid.stage_to_global(stages - 1) == (stages - 1) * dp + rank % dp
    assert grid.p2p_groups[rank] == [rank, (rank + dp) % groups.world_size]
    assert grid.get_slice_parallel_world_size() == 1 and grid.get_slice_parallel_rank() == 0
    assert grid.get_model_parallel_world_size() == stages  # every stage of one replica (DeepSpeed's)
    assert grid.get_model_parallel_rank() == rank // dp
    if groups.world_size == 1:
        return
    # Each group, handed to torch.distributed as a script does, sums over exactly its ranks; a
    # one-rank axis is a real one-rank group, not None (torch's whole world).
    for group, size in ((grid.get_data_parallel_group(), dp), (grid.get_pipe_parallel_group(), stages),
                        (grid.get_slice_parallel_group(), 1), (grid.get_model_parallel_group(), stages)):
        assert group is not None
        one = torch.ones(1)
        dist.all_reduce(one, group=group)
        assert int(one) == size


def test_grid_of_a_3d_topology(groups: ProcessGroups) -> None:
    """PP 2 x TP 2 at 4 ranks, the grid built directly (as Megatron-DeepSpeed builds it from its topology):
    the slice (tensor) axis is the fastest, DeepSpeed's model group is every stage and slice of a replica."""
    from zeroshard.pipe import PipelineParallelGrid, PipeModelDataParallelTopology

    if groups.world_size != 4:
        pytest.skip("PP 2 x TP 2 needs 4 ranks (tests/run.py's dist4)")
    grid = PipelineParallelGrid(topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1))
    rank = groups.rank
    coord = (grid.get_stage_id(), grid.get_slice_parallel_rank(), grid.get_data_parallel_rank())
    assert coord == (rank // 2, rank % 2, 0)
    assert grid.get_model_parallel_world_size() == 4 and grid.get_model_parallel_rank() == rank
    assert grid.stage_to_global(1, model=0) == 2 and grid.p2p_groups[rank] == [rank, (rank + 2) % 4]
    for group, size in ((grid.get_slice_parallel_group(), 2), (grid.get_pipe_parallel_group(), 2),
                        (grid.get_model_parallel_group(), 4), (grid.get_data_parallel_group(), 1)):
        one = torch.ones(1)
        dist.all_reduce(one, group=group)
        assert int(one) == size
