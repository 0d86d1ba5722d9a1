"""`zero_optimization.stage3_release_grads` (Note: [gradient lifetime] in zero/grad_shard.py): the
stage-3 gradient shard exists only from each unit's first reduction of a step to the end of the
step. The numbers must not change (bitwise, fp32 and bf16, with gradient accumulation), no
gradient memory (shard or staging pool) may be held between a step and the next backward, the gradients read as
DeepSpeed's (`safe_get_full_grad`: between backward and step, None after), and an offloaded
optimizer keeps its host shard.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from engine_helpers import global_batches, init_engine, make_config, make_model, train_engine

from zeroshard.runtime.monitor import allocated_bytes


def _config(release: bool, precision: str = "fp32", gas: int = 1, **zero: Any) -> dict[str, Any]:
    extra: dict[str, Any] = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    return make_config(gradient_accumulation_steps=gas, gradient_clipping=1.0,
                       zero_optimization={"stage": 3, "reduce_bucket_size": 500,
                                          "stage3_param_persistence_threshold": 100,
                                          "stage3_release_grads": release, **zero}, **extra)


def _grad_bytes(engine: Any) -> int:
    return sum(s.grads for s in engine.model_state_bytes())


@pytest.mark.parametrize("precision,gas", [("fp32", 1), ("fp32", 2), ("bf16", 2)])
def test_same_numbers_as_kept_gradients(groups, precision: str, gas: int) -> None:
    world = groups.world_size
    batches = global_batches(4, 2 * gas * world)
    runs = []
    for release in (False, True):
        engine = init_engine(make_model(), _config(release, precision, gas))
        runs.append(train_engine(engine, batches, groups.rank, world))
    (kept_losses, kept_params), (released_losses, released_params) = runs
    assert released_losses == kept_losses
    for step, (a, b) in enumerate(zip(kept_params, released_params)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {step} parameter {i}: released gradients changed the update"


def test_no_gradient_memory_between_steps(groups, frozen_heap: None) -> None:
    measured = {}
    for release in (False, True):
        gc.collect()
        baseline = allocated_bytes(torch.device("cpu"))
        engine = init_engine(make_model(), _config(release))
        x, y = global_batches(1, 2 * groups.world_size)[0]
        x, y = x[:2], y[:2]
        engine.backward(engine(x, y))
        during = _grad_bytes(engine)
        engine.step()
        gc.collect()
        measured[release] = (during, _grad_bytes(engine), engine.transient_bytes(),
                             allocated_bytes(torch.device("cpu")) - baseline)
        del engine
        gc.collect()
    (kept_during, kept_after, kept_pool, kept_live) = measured[False]
    (rel_during, rel_after, rel_pool, rel_live) = measured[True]
    assert rel_during == kept_during > 0, "between backward and step the whole gradient shard exists"
    assert kept_after == kept_during and rel_after == 0
    assert kept_pool > 0 and rel_pool == 0, "the staging pool is freed with the gradients"
    # The live tensors after the step differ by the gradient shard and the staging pool (within
    # 10%: a few small tensors, ~0.5 KiB per rank here, differ between the two engines' runs).
    freed = kept_after + kept_pool
    assert abs((kept_live - rel_live) - freed) <= 0.1 * freed, (kept_live, rel_live, freed)


def test_gradients_read_as_with_kept_ones(groups) -> None:
    from zeroshard.utils import safe_get_full_grad

    seen = []
    for release in (False, True):
        engine = init_engine(make_model(), _config(release))
        x, y = global_batches(1, 2 * groups.world_size)[0]
        engine.backward(engine(x[:2], y[:2]))
        params = list(engine.module.parameters())
        before = [safe_get_full_grad(p) for p in params]
        engine.step()
        seen.append((before, [safe_get_full_grad(p) for p in params]))
    (kept, kept_after), (released, released_after) = seen
    assert all(g is not None for g in released) and any(g.abs().sum() > 0 for g in released)
    assert all(torch.equal(a, b) for a, b in zip(kept, released))
    assert kept_after == released_after == [None] * len(kept)  # outside backward..step, as DeepSpeed


def test_offloaded_optimizer_keeps_its_host_shard(groups) -> None:
    engine = init_engine(make_model(), _config(True, offload_optimizer={"device": "cpu"}))
    x, y = global_batches(1, 2 * groups.world_size)[0]
    engine.backward(engine(x[:2], y[:2]))
    engine.step()
    assert _grad_bytes(engine) > 0
