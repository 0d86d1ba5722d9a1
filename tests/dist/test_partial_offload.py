"""`offload_optimizer.ratio` (partial optimizer offload, stage 3): the leading int((1 - ratio) * n)
of the n units keep their master, gradient shard and optimizer state on the model's device, the
rest are offloaded (Note: [partial offload] in zeroshard/zero/offload/split_home.py), and the
update rule is unchanged: the run equals a plain-torch AdamW reference bit for bit. On this CPU
both homes are host memory, so what differs between ratios is only where the bytes are counted;
the placement on an accelerator is not exercised here. World sizes 1 (pytest) and 2 (torchrun).
"""

from __future__ import annotations

import copy

import pytest
from engine_helpers import (
    MICRO,
    assert_params_close,
    global_batches,
    init_engine,
    make_config,
    make_model,
    offload_reference,
    train_engine,
)

from zeroshard.config import load_config
from zeroshard.errors import ConfigError, NotSupportedError

STEPS = 6


def config(ratio: float) -> dict:
    return make_config(zero_optimization={"stage": 3, "reduce_bucket_size": 500,
                                          "offload_optimizer": {"device": "cpu", "ratio": ratio}})


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_update_rule_and_placement(groups, ratio: float) -> None:
    rank, world = groups.rank, groups.world_size
    model = make_model()
    batches = global_batches(STEPS, MICRO * world)
    engine = init_engine(copy.deepcopy(model), config(ratio))
    _, got = train_engine(engine, batches, rank, world)
    fused = bool(engine.optimizer.optimizer.defaults.get("fused"))
    _, want, _ = offload_reference(model, batches, world, None, fused)
    for k in range(STEPS):
        assert_params_close(got[k], want[k], 0.0, f"ratio {ratio}, weights after step {k + 1}")

    plan = engine.strategy._plan
    units = len(plan.buckets)
    assert units >= 3, "the split needs several units to mean anything"
    on_device = int((1 - ratio) * units)  # DeepSpeed's rule for its sub-groups
    split = plan.shard_range(on_device)[0] if on_device < units else plan.shard_numel
    by_home = {b.device: b for b in engine.model_state_bytes()}
    offloaded = by_home.get("cpu (offload)")
    assert (offloaded.master_params if offloaded else 0) == 4 * (plan.shard_numel - split)
    assert (offloaded.grads if offloaded else 0) == 4 * (plan.shard_numel - split)
    assert by_home["cpu"].master_params == 4 * split
    if 0.0 < ratio < 1.0:
        assert 0 < split < plan.shard_numel, "a ratio strictly between 0 and 1 splits the shard"


def test_refused_where_not_built() -> None:
    def load(offload: dict, stage: int = 3) -> None:
        load_config({"train_batch_size": 2, "zero_optimization": {"stage": stage, "offload_optimizer": offload}},
                    dp_world_size=1)

    with pytest.raises(ConfigError, match="ratio=0.5: it is the share"):
        load({"device": "none", "ratio": 0.5})
    with pytest.raises(NotSupportedError, match="ratio below 1 with device \"nvme\""):
        load({"device": "nvme", "nvme_path": "/tmp", "ratio": 0.5})
    with pytest.raises(NotSupportedError, match="ratio below 1 with delayed_update"):
        load({"device": "cpu", "ratio": 0.5, "delayed_update": True})
    with pytest.raises(ConfigError, match="ratio"):  # stage 3 only, as in DeepSpeed
        load({"device": "cpu", "ratio": 0.5}, stage=2)


def test_checkpoint_moves_between_ratios(groups, shared_dir) -> None:
    """A checkpoint saved at ratio 0.5 resumes at ratio 1.0 (and the reverse) exactly: the ratio
    only places the states."""
    rank, world = groups.rank, groups.world_size
    batches = global_batches(6, MICRO * world)
    for saved, loaded in ((0.5, 1.0), (1.0, 0.5)):
        engine = init_engine(make_model(), config(saved))
        train_engine(engine, batches[:3], rank, world)
        engine.save_checkpoint(shared_dir, tag=f"r{saved}")
        _, cont = train_engine(engine, batches[3:], rank, world)
        resumed = init_engine(make_model(seed=7), config(loaded))
        resumed.load_checkpoint(shared_dir, tag=f"r{saved}")
        _, again = train_engine(resumed, batches[3:], rank, world)
        for k in range(3):
            assert_params_close(again[k], cont[k], 0.0, f"saved at {saved}, loaded at {loaded}, step {k + 4}")


def test_pipeline_refused() -> None:
    from zeroshard.config.pipeline import check_for_pipeline

    cfg = load_config({"train_batch_size": 2, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, dp_world_size=1)
    with pytest.raises(NotSupportedError, match="offload_optimizer.ratio with a PipelineModule"):
        check_for_pipeline(cfg, virtual_stages=1)
