"""The one-step delayed parameter update (`offload_optimizer.delayed_update`) follows its rule bit
for bit (Note: [delayed update] in zeroshard/zero/offload/delayed_step.py).

The reference (`offload_reference` in engine_helpers.py) is plain torch: fused AdamW on fp32
masters; each rank's gradient computed on its own micro-batch and summed in rank order (2 ranks:
a + b == b + a exactly, so the engine's all-reduce gives the same bits), then averaged; the
first WARMUP steps update and publish before the next forward; after them, step k publishes the
masters of update k-1 and then applies update k, so the forward of step k+1 runs on the weights
of update k-1. Run at world sizes 1 (plain pytest) and 2 (torchrun), ZeRO stages 1-3, fp32.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from engine_helpers import (
    MICRO,
    assert_params_close,
    gathered_snapshot,
    global_batches,
    init_engine,
    make_config,
    make_model,
    offload_reference,
    publish,
    rank_micro_batches,
    train_engine,
)
from torch import Tensor, nn

from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.zero.offload.delayed_step import DelayedStep

STEPS = 10
WARMUP = 3


def config(stage: int, delayed: bool = True, warmup: int = WARMUP, **zero: Any) -> dict[str, Any]:
    offload: dict[str, Any] = {"device": "cpu"}
    if delayed:
        offload.update(delayed_update=True, delayed_update_warmup_steps=warmup)
    return make_config(zero_optimization={"stage": stage, "reduce_bucket_size": 500,
                                          "offload_optimizer": offload, **zero})


def _engine_fused(engine: Any) -> bool:
    inner = engine.optimizer.optimizer
    assert isinstance(inner, DelayedStep), f"expected the delayed step, got {type(inner).__name__}"
    return bool(inner.inner.defaults.get("fused"))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_matches_reference(groups, stage: int) -> None:
    rank, world = groups.rank, groups.world_size
    model = make_model()
    batches = global_batches(STEPS, MICRO * world)
    engine = init_engine(copy.deepcopy(model), config(stage))
    losses, got = train_engine(engine, batches, rank, world)
    want_losses, want, want_master = offload_reference(model, batches, world, WARMUP, _engine_fused(engine))
    for k in range(STEPS):
        assert_params_close(got[k], want[k], 0.0, f"stage {stage}, weights after step {k + 1}")
    assert losses == [per_rank[rank] for per_rank in want_losses]
    # the synchronous rule agrees through the warm-up and differs from step WARMUP + 1 on, whose
    # update is still in flight when the step returns: the comparison above can fail
    _, sync, _ = offload_reference(model, batches, world, None, _engine_fused(engine))
    assert all(torch.equal(a, b) for a, b in zip(sync[WARMUP - 1], want[WARMUP - 1]))
    assert not any(torch.equal(a, b) for a, b in zip(sync[WARMUP], want[WARMUP]))
    engine.strategy.settle_step()  # the last update lands: the masters of update STEPS
    assert_params_close(gathered_snapshot(engine.module), want_master, 0.0, f"stage {stage}, after settle")


def test_gradient_accumulation(groups, monkeypatch) -> None:
    """Two micro-batches per step at stage 2, each reduced into the gradient shard the update in
    flight is not reading: the background step is slowed so that it still runs while the next
    step's backward reduces (an update reading the shard being written would differ)."""
    import time

    run = DelayedStep._run
    monkeypatch.setattr(DelayedStep, "_run", lambda self, stepper: (time.sleep(0.05), run(self, stepper)))
    rank, world = groups.rank, groups.world_size
    model = make_model()
    batches = global_batches(STEPS, MICRO * 2 * world)
    cfg = config(2)
    cfg["gradient_accumulation_steps"] = 2
    engine = init_engine(copy.deepcopy(model), cfg)
    _, got = train_engine(engine, batches, rank, world)
    _, want, _ = offload_reference(model, batches, world, WARMUP, _engine_fused(engine), gas=2)
    for k in range(STEPS):
        assert_params_close(got[k], want[k], 0.0, f"accumulation, weights after step {k + 1}")


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16(groups, stage: int) -> None:
    """bf16 weights and gradients, fp32 masters in host memory (the GPU bench's recipe): the
    gradients summed in fp32 are exact, so the rule holds bit for bit too."""
    rank, world = groups.rank, groups.world_size
    model = make_model()
    batches = global_batches(STEPS, MICRO * world)
    cfg = config(stage)
    cfg["bf16"] = {"enabled": True}
    engine = init_engine(copy.deepcopy(model), cfg)
    _, got = train_engine(engine, batches, rank, world)
    _, want, want_master = offload_reference(model, batches, world, WARMUP, _engine_fused(engine), bf16=True)
    for k in range(STEPS):
        assert_params_close(got[k], want[k], 0.0, f"bf16 stage {stage}, weights after step {k + 1}")
    engine.strategy.settle_step()
    from zeroshard.utils import safe_get_full_fp32_param

    masters = [safe_get_full_fp32_param(p).reshape(-1) for p in engine.module.parameters()]
    assert_params_close(masters, [m.reshape(-1) for m in want_master], 0.0, f"bf16 stage {stage}, masters")


@pytest.mark.parametrize("case", ["clip", "skip"])
def test_clip_and_skipped_step(groups, case: str) -> None:
    """Clipping acts on step k's gradient before the snapshot (the norm is that step's); a step
    whose gradient is non-finite starts no update, the update in flight still lands."""
    rank, world = groups.rank, groups.world_size
    model = make_model()
    batches = global_batches(STEPS, MICRO * world)
    cfg = config(2)
    skip = 6 if case == "skip" else None
    if case == "clip":
        cfg["gradient_clipping"] = 0.2
    def hook(step: int, loss: Tensor) -> Tensor:  # one rank's gradient turns nan at step `skip`
        return loss * float("nan") if step + 1 == skip and rank == world - 1 else loss

    engine = init_engine(copy.deepcopy(model), cfg)
    _, got = train_engine(engine, batches, rank, world, before_backward=hook)
    _, want, _ = offload_reference(model, batches, world, WARMUP, _engine_fused(engine),
                                   max_norm=cfg["gradient_clipping"], skip=skip)
    for k in range(STEPS):
        assert_params_close(got[k], want[k], 0.0, f"{case}, weights after step {k + 1}")
    assert engine.skipped_steps == (1 if skip else 0)
    if case == "clip":  # the clip acted at the last step
        assert engine.get_global_grad_norm() > cfg["gradient_clipping"]


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_settles_and_resumes_exactly(groups, shared_dir, stage: int) -> None:
    """A save waits for the update in flight and publishes it; continuing after the save and
    resuming from it then run the same steps bit for bit (the warm-up count resumes too)."""
    rank, world = groups.rank, groups.world_size
    batches = global_batches(8, MICRO * world)
    engine = init_engine(make_model(), config(stage, warmup=2))
    train_engine(engine, batches[:4], rank, world)
    assert engine.optimizer.optimizer.in_flight
    engine.save_checkpoint(shared_dir, tag="s4")
    assert not engine.optimizer.optimizer.in_flight
    _, cont = train_engine(engine, batches[4:], rank, world)

    resumed = init_engine(make_model(seed=5), config(stage, warmup=2))
    resumed.load_checkpoint(shared_dir, tag="s4")
    assert resumed.optimizer.optimizer.steps == 4
    _, again = train_engine(resumed, batches[4:], rank, world)
    for k in range(4):
        assert_params_close(again[k], cont[k], 0.0, f"stage {stage}, step {k + 5} after resume")


def test_lr_scheduler_after_launch_does_not_race(groups) -> None:
    """The scheduler steps right after the background step starts; the step uses the lr it was
    launched with (a copy of the groups), so a schedule gives the same bits as the reference."""
    rank, world = groups.rank, groups.world_size
    model = make_model()
    batches = global_batches(6, MICRO * world)
    cfg = config(2, warmup=1)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                       "warmup_num_steps": 4, "warmup_type": "linear"}}
    engine = init_engine(copy.deepcopy(model), cfg)
    lrs = []
    for batch in batches:
        lrs.append(engine.get_lr()[0])
        (x, y), = rank_micro_batches(batch, rank, world, MICRO, 1)
        engine.backward(engine(x, y))
        engine.step()
    engine.strategy.settle_step()
    got = gathered_snapshot(engine.module)
    # reference with the recorded lr per step
    ref = copy.deepcopy(model)
    params = list(ref.parameters())
    master = [nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.01, fused=_engine_fused(engine))
    for k, (batch, lr) in enumerate(zip(batches, lrs), start=1):
        total = None
        for r in range(world):
            (x, y), = rank_micro_batches(batch, r, world, MICRO, 1)
            grads = torch.autograd.grad(ref(x, y), params)
            total = list(grads) if total is None else [t + g for t, g in zip(total, grads)]
        for m, g in zip(master, total):
            m.grad = g * (1.0 / world) if world != 1 else g
        for group in opt.param_groups:
            group["lr"] = lr
        if k > 1:
            publish(params, master)
        opt.step()
    assert_params_close(got, [m.detach() for m in master], 0.0, "with WarmupLR")


def test_refused_where_not_built() -> None:
    from zeroshard.config import load_config

    with pytest.raises(ConfigError, match="needs offload_optimizer.device"):
        load_config({"train_batch_size": 2, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "none", "delayed_update": True}}}, dp_world_size=1)
    with pytest.raises(NotSupportedError, match=r"zenflow with offload_optimizer\.delayed_update: not implemented"):
        load_config({"train_batch_size": 2, "gradient_clipping": 0.0, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "cpu", "delayed_update": True}, "zenflow": {
                "select_strategy": "step", "select_interval": 2, "update_interval": 2}}}, dp_world_size=1)
    with pytest.raises(NotSupportedError, match="delayed_update with device \"nvme\""):
        load_config({"train_batch_size": 2, "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "delayed_update": True}}},
            dp_world_size=1)


@pytest.mark.parametrize("stage", [1, 3])
def test_fp32_reads_wait_for_the_step_in_flight(groups, monkeypatch, stage: int) -> None:
    """`safe_get_full_fp32_param` during a delayed step reads the masters of that update (it waits
    on this rank), while the module still holds the previous update until the next boundary; the
    run stays on the reference. The background step is slowed so the read lands while it runs."""
    import time

    from zeroshard.utils import safe_get_full_fp32_param

    run = DelayedStep._run
    monkeypatch.setattr(DelayedStep, "_run", lambda self, stepper: (time.sleep(0.2), run(self, stepper)))

    rank, world = groups.rank, groups.world_size
    model = make_model()
    batches = global_batches(6, MICRO * world)
    engine = init_engine(copy.deepcopy(model), config(stage, warmup=1))
    _, got = train_engine(engine, batches[:5], rank, world)
    assert engine.optimizer.optimizer.in_flight
    masters = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
    _, got_last = train_engine(engine, batches[5:], rank, world)
    _, want, _ = offload_reference(model, batches, world, 1, _engine_fused(engine))
    _, _, want_master5 = offload_reference(model, batches[:5], world, 1, _engine_fused(engine))
    assert_params_close([m.reshape(-1) for m in masters], [m.reshape(-1) for m in want_master5], 0.0,
                        f"stage {stage}, masters of update 5 read in flight")
    assert_params_close(got[4], want[4], 0.0, f"stage {stage}, weights after step 5 (update 4)")
    assert_params_close(got_last[0], want[5], 0.0, f"stage {stage}, weights after step 6")


def test_pipeline_refused() -> None:
    from zeroshard.config import load_config
    from zeroshard.config.pipeline import check_for_pipeline

    cfg = load_config({"train_batch_size": 2, "zero_optimization": {
        "stage": 1, "offload_optimizer": {"device": "cpu", "delayed_update": True}}}, dp_world_size=1)
    with pytest.raises(NotSupportedError, match="delayed_update with a PipelineModule"):
        check_for_pipeline(cfg, virtual_stages=1)



def test_background_failure_is_raised_at_the_next_boundary(groups, monkeypatch) -> None:
    """An exception inside the background step is not lost: the next wait for it (a step's
    boundary, a save, or here `settle_step()` itself) raises it, chained."""
    rank, world = groups.rank, groups.world_size
    engine = init_engine(make_model(), config(2, warmup=1))
    train_engine(engine, global_batches(1, MICRO * world), rank, world)  # the warm-up step

    def broken(self: Any, closure: Any = None) -> None:
        raise ValueError("injected")

    monkeypatch.setattr(type(engine.optimizer.optimizer.inner), "step", broken)
    train_engine(engine, global_batches(1, MICRO * world, seed=2), rank, world)  # starts, fails in its thread
    with pytest.raises(RuntimeError, match="background thread") as info:
        engine.strategy.settle_step()
    assert isinstance(info.value.__cause__, ValueError)
