"""`managed_gradient_accumulation: false` (DeepSpeed 0.19) at 1/2/3 ranks: the script owns the
accumulation boundary. Every `step()` reduces what the backward passes since the last one
accumulated and steps the optimizer, however many there were; the results equal the managed
engine driven to the same boundaries by `set_gradient_accumulation_boundary`. Also: in managed
mode `was_step_applied()` is False inside accumulation (DeepSpeed's rule), and the calls that
would contradict the script's boundary are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_helpers import api_config, fresh, global_batches, init_engine, make_model, params_of, rank_micro_batches

from zeroshard.errors import CheckpointError, ConfigConflictError
from zeroshard.utils import safe_get_full_fp32_param

STAGES = [0, 1, 2, 3]
COUNTS = [2, 3, 1]
"""Backward passes per optimizer step: differs per step and from the config's 2."""


def unmanaged(stage: int, **extra: Any) -> Any:
    return fresh(stage, managed_gradient_accumulation=False, **extra)


def build(stage: int, offloaded: bool, managed: bool) -> Any:
    """The tiny GPT at `stage`, GAS 2, optimizer (and at stage 3 parameter) offload when `offloaded`."""
    cfg = api_config(stage, managed_gradient_accumulation=managed)
    if offloaded:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return init_engine(make_model(0), cfg)


CASES = [(s, False) for s in STAGES] + [(s, True) for s in (1, 2, 3)]


@pytest.mark.parametrize(("stage", "offloaded"), CASES, ids=[f"stage{s}{'-offload' if o else ''}" for s, o in CASES])
def test_every_step_reduces_and_steps(groups: Any, stage: int, offloaded: bool) -> None:
    from zeroshard.comm.divergence import tracker_of

    rank, world = groups.rank, groups.world_size
    batches = [global_batches(1, 2 * n * world, seed=10 + i)[0] for i, n in enumerate(COUNTS)]
    managed = build(stage, offloaded, managed=True)
    for batch, n in zip(batches, COUNTS):
        for i, (x, y) in enumerate(rank_micro_batches(batch, rank, world, 2, n)):
            managed.set_gradient_accumulation_boundary(i == n - 1)
            managed.backward(managed(x, y) / n, scale_wrt_gas=False)
        managed.step()
    engine = build(stage, offloaded, managed=False)
    assert not engine.managed_gradient_accumulation()
    tracker = tracker_of(engine.comm.groups.dp_group) if world > 1 else None
    samples = engine.global_samples
    for step, (batch, n) in enumerate(zip(batches, COUNTS)):
        before = tracker._seq if tracker is not None else 0
        for x, y in rank_micro_batches(batch, rank, world, 2, n):
            engine.backward(engine(x, y) / n, scale_wrt_gas=False)
            assert not engine.is_gradient_accumulation_boundary(), "the boundary is step() alone"
        if tracker is not None and stage < 2:
            assert tracker._seq == before, f"stage {stage}: a backward reduced"
        engine.step()
        if tracker is not None:
            assert tracker._seq > before, "step() reduced nothing"
        assert engine.was_step_applied(), f"step {step}: every step() applies an update"
        assert engine.global_steps == step + 1
        samples += 2 * world * n
        assert engine.global_samples == samples, "global_samples counts the micro-batches each step took"
    for a, b in zip(params_of(managed), params_of(engine)):
        want, got = safe_get_full_fp32_param(a), safe_get_full_fp32_param(b)
        assert want is not None and got is not None
        assert got.equal(want), f"stage {stage}: unmanaged differs from the managed boundaries"


@pytest.mark.parametrize("stage", [0, 3])
def test_gas_divides_the_loss_as_in_managed_mode(groups: Any, stage: int) -> None:
    """backward(loss) still divides by the config's gradient_accumulation_steps: N backward
    passes and one step() equal the managed engine with GAS N (DeepSpeed's
    test_unmanaged_matches_managed)."""
    rank, world = groups.rank, groups.world_size
    batches = global_batches(2, 2 * 2 * world)
    managed, engine = fresh(stage), unmanaged(stage)
    for batch in batches:
        for x, y in rank_micro_batches(batch, rank, world, 2, 2):
            managed.backward(managed(x, y))
            managed.step()
            engine.backward(engine(x, y))
        engine.step()
    assert managed.global_steps == engine.global_steps == 2
    assert managed.global_samples == engine.global_samples
    for a, b in zip(params_of(managed), params_of(engine)):
        assert safe_get_full_fp32_param(b).equal(safe_get_full_fp32_param(a))


def test_managed_was_step_applied_only_at_the_boundary(groups: Any) -> None:
    rank, world = groups.rank, groups.world_size
    engine = fresh(1)
    applied = []
    for batch in global_batches(2, 2 * 2 * world):
        for x, y in rank_micro_batches(batch, rank, world, 2, 2):
            engine.backward(engine(x, y))
            engine.step()
            applied.append(engine.was_step_applied())
    assert applied == [False, True, False, True]


@pytest.mark.parametrize("stage", [1, 3])
def test_boundary_calls_are_refused_and_saves_wait_for_step(groups: Any, shared_dir: Path, stage: int) -> None:
    rank, world = groups.rank, groups.world_size
    engine = unmanaged(stage)
    with pytest.raises(AssertionError, match="set_gradient_accumulation_boundary"):
        engine.set_gradient_accumulation_boundary(True)
    with pytest.raises(AssertionError, match="coalesce_grad_reduction"):
        with engine.coalesce_grad_reduction():
            pass
    x, y = rank_micro_batches(global_batches(1, 2 * world)[0], rank, world, 2, 1)[0]
    engine.backward(engine(x, y))
    with pytest.raises(CheckpointError, match="gradient accumulation"):
        engine.save_checkpoint(shared_dir)
    engine.step()
    engine.save_checkpoint(shared_dir)
    again = unmanaged(stage, seed=5)
    again.load_checkpoint(shared_dir)
    for a, b in zip(params_of(engine), params_of(again)):
        assert safe_get_full_fp32_param(b).equal(safe_get_full_fp32_param(a))


def test_conflicting_configs_are_refused_at_initialize(groups: Any) -> None:
    from torch import nn

    from zeroshard.pipe import PipelineModule

    for stage in (0, 1):
        cfg = api_config(stage, managed_gradient_accumulation=False)
        cfg["zero_optimization"]["overlap_comm"] = True
        with pytest.raises(ConfigConflictError, match="overlap_comm only with ZeRO stage 2") as err:
            init_engine(make_model(), cfg)
        assert isinstance(err.value, AssertionError), "DeepSpeed asserts: code catching AssertionError still works"
    layers = [nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)]
    pipe = PipelineModule(layers=layers, num_stages=1, loss_fn=nn.MSELoss())
    with pytest.raises(ConfigConflictError, match="not supported with pipeline parallelism"):
        init_engine(pipe, api_config(0, managed_gradient_accumulation=False))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_overflow_in_any_backward_skips_that_step_on_every_rank(groups: Any, stage: int) -> None:
    rank, world = groups.rank, groups.world_size
    engine = fresh(stage, "fp16", managed_gradient_accumulation=False)
    applied = []
    for step, batch in enumerate(global_batches(3, 2 * 2 * world)):
        for i, (x, y) in enumerate(rank_micro_batches(batch, rank, world, 2, 2)):
            loss = engine(x, y)
            if step == 1 and i == 0 and rank == world - 1:  # one rank, the first of two backward passes
                loss = loss * float("inf")
            engine.backward(loss)
        engine.step()
        applied.append(engine.was_step_applied())
    assert applied == [True, False, True], applied
    assert engine.global_steps == 3 and engine.skipped_steps == 1
