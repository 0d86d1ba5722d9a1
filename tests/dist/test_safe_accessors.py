"""DeepSpeed's safe_* parameter, gradient and optimizer-state accessors on zeroshard, at 1/2/3
ranks and every stage, checked against stage 0 (split out of test_deepspeed_api.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    api_config,
    backward_only,
    close,
    fresh,
    global_batches,
    init_engine,
    make_model,
    params_of,
    train_engine,
)
from torch import nn

from zeroshard.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from zeroshard.zero import GatheredParameters

STAGES = [0, 1, 2, 3]



@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_safe_get_full_matches_stage0_at_every_stage(groups: Any, precision: str) -> None:
    rank, world = groups.rank, groups.world_size
    batches = global_batches(3, 2 * 2 * world)
    ref = fresh(0, precision)
    train_engine(ref, batches[:2], rank, world)
    backward_only(ref, batches[2], rank, world)
    want_p = [safe_get_full_fp32_param(p) for p in params_of(ref)]
    want_g = [safe_get_full_grad(p) for p in params_of(ref)]
    want_m = [safe_get_full_optimizer_state(p, "exp_avg_sq") for p in params_of(ref)]
    if precision == "fp32":  # stage 0 in fp32: the master is the parameter itself
        for p, w in zip(params_of(ref), want_p):
            assert torch.equal(p.detach(), w)
    # Stage 2/3 sum each micro-batch's reduced gradient, stage 0/1 reduce the summed gradient:
    # the same numbers added in another order (fp32 round-off, ~1e-6 relative).
    tol = 1e-5 if precision == "fp32" else 1e-3
    for stage in STAGES[1:]:
        engine = fresh(stage, precision)
        train_engine(engine, batches[:2], rank, world)
        backward_only(engine, batches[2], rank, world)
        for i, p in enumerate(params_of(engine)):
            close(safe_get_full_fp32_param(p), want_p[i], tol, f"stage {stage} fp32 param {i}")
            close(safe_get_full_grad(p), want_g[i], tol, f"stage {stage} grad {i}")
            close(safe_get_full_optimizer_state(p, "exp_avg_sq"), want_m[i], tol, f"stage {stage} exp_avg_sq {i}")
            assert safe_get_full_fp32_param(p).shape == p.shape and safe_get_full_fp32_param(p).dtype == torch.float32
        engine.step()
        assert safe_get_full_grad(params_of(engine)[0]) is None, "gradients are gone after step()"


def test_safe_get_full_grad_is_the_averaged_gradient(groups: Any) -> None:
    rank, world = groups.rank, groups.world_size
    (batch,) = global_batches(1, 2 * 2 * world)
    model = make_model(0)
    reference = make_model(0)
    engine = init_engine(model, api_config(2))
    backward_only(engine, batch, rank, world)
    x, y = batch
    n = x.shape[0] // 2
    for i in range(n):
        (reference(x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]) / n).backward()
    for (name, p), q in zip(engine.module.named_parameters(), reference.parameters()):
        close(safe_get_full_grad(p), q.grad, 1e-5, name)
    local = safe_get_local_grad(params_of(engine)[0])
    assert local is not None and local.dim() == 1
    engine.step()


@pytest.mark.parametrize("stage", STAGES)
def test_local_fragments_cover_each_parameter_once(groups: Any, comm: Any, stage: int) -> None:
    rank, world = groups.rank, groups.world_size
    engine = fresh(stage)
    train_engine(engine, global_batches(1, 2 * 2 * world), rank, world)
    for p in params_of(engine):
        local = safe_get_local_fp32_param(p)
        state = safe_get_local_optimizer_state(p, "exp_avg")
        assert local is not None and state is not None and local.shape == state.shape
        count = torch.tensor([float(local.numel())])
        comm.all_reduce(count)
        owners = world if stage == 0 else 1  # stage 0: every rank holds all of it
        assert int(count.item()) == owners * p.numel()


@pytest.mark.parametrize("stage", STAGES)
def test_safe_set_full_fp32_param_and_optimizer_state(groups: Any, stage: int) -> None:
    rank, world = groups.rank, groups.world_size
    batches = global_batches(2, 2 * 2 * world)
    engines = [fresh(0), fresh(stage)]
    for engine in engines:
        train_engine(engine, batches[:1], rank, world)
        target = engine.module.lm_head.weight if hasattr(engine.module, "lm_head") else params_of(engine)[0]
        value = torch.full(target.shape, 0.125)
        safe_set_full_fp32_param(target, value)
        assert torch.equal(safe_get_full_fp32_param(target), value)
        with GatheredParameters([target]):
            assert torch.equal(target.detach().float(), value), "the parameter itself follows the master"
        safe_set_full_optimizer_state(target, torch.zeros(target.shape), "exp_avg")
        assert torch.count_nonzero(safe_get_full_optimizer_state(target, "exp_avg")) == 0
    losses = [train_engine(e, batches[1:], rank, world)[0] for e in engines]
    assert abs(losses[0][0] - losses[1][0]) <= 1e-5 * abs(losses[0][0])
    for a, b in zip(params_of(engines[0]), params_of(engines[1])):
        close(safe_get_full_fp32_param(b), safe_get_full_fp32_param(a), 1e-5, "after set + one step")


@pytest.mark.parametrize("stage", STAGES)
def test_safe_set_grads_change_the_step_as_at_stage0(groups: Any, stage: int) -> None:
    """Gradients rewritten through safe_set_full_grad / safe_update_full_grad_vectorized are
    the ones step() clips and applies: the same rewrite gives stage 0's trajectory."""
    rank, world = groups.rank, groups.world_size
    batches = global_batches(3, 2 * 2 * world)
    engines = [fresh(0), fresh(stage)]
    for engine in engines:
        train_engine(engine, batches[:1], rank, world)
        backward_only(engine, batches[1], rank, world)
        params = params_of(engine)
        first = params[0]
        new = safe_get_full_grad(first) * -3.0 + 0.01
        safe_set_full_grad(first, new)
        close(safe_get_full_grad(first), new, 1e-6, f"stage {engine.zero_optimization_stage()} set_full_grad")
        safe_update_full_grad_vectorized(params[1:], lambda g, p: g * 0.5)
        engine.step()
        with pytest.raises(ValueError, match="ends an accumulation step"):
            safe_set_full_grad(first, new)
    for a, b in zip(params_of(engines[0]), params_of(engines[1])):
        close(safe_get_full_fp32_param(b), safe_get_full_fp32_param(a), 1e-5, f"stage {stage} after the rewritten step")
    losses = [train_engine(e, batches[2:], rank, world)[0] for e in engines]
    assert abs(losses[0][0] - losses[1][0]) <= 1e-5 * abs(losses[0][0])


@pytest.mark.parametrize("stage", STAGES)
def test_safe_set_local_round_trips(groups: Any, stage: int) -> None:
    rank, world = groups.rank, groups.world_size
    batches = global_batches(2, 2 * 2 * world)
    engine = fresh(stage)
    train_engine(engine, batches[:1], rank, world)
    backward_only(engine, batches[1], rank, world)
    for p in params_of(engine):
        grad = safe_get_local_grad(p)
        safe_set_local_grad(p, grad * 2)
        close(safe_get_local_grad(p), grad * 2, 1e-6, "local grad")
        master = safe_get_local_fp32_param(p)
        safe_set_local_fp32_param(p, master + 1)
        assert torch.equal(safe_get_local_fp32_param(p), master + 1)
        state = safe_get_local_optimizer_state(p, "exp_avg")
        safe_set_local_optimizer_state(p, torch.full_like(state, 0.5), "exp_avg")
        assert torch.equal(safe_get_local_optimizer_state(p, "exp_avg"), torch.full_like(state, 0.5))
        with pytest.raises(ValueError, match="elements; this rank's part"):
            safe_set_local_fp32_param(p, torch.zeros(master.numel() + 1))
    engine.step()


@pytest.mark.parametrize("stage", STAGES)
def test_safe_get_right_after_load_checkpoint(groups: Any, shared_dir: Path, stage: int) -> None:
    rank, world = groups.rank, groups.world_size
    engine = fresh(stage)
    train_engine(engine, global_batches(2, 2 * 2 * world), rank, world)
    want = [safe_get_full_fp32_param(p) for p in params_of(engine)]
    want_state = [safe_get_full_optimizer_state(p, "exp_avg") for p in params_of(engine)]
    engine.save_checkpoint(shared_dir)
    loaded = fresh(stage, seed=5)
    loaded.load_checkpoint(shared_dir)
    for i, p in enumerate(params_of(loaded)):
        assert torch.equal(safe_get_full_fp32_param(p), want[i])
        assert torch.equal(safe_get_full_optimizer_state(p, "exp_avg"), want_state[i])


def test_safe_functions_need_an_engine(groups: Any) -> None:
    with pytest.raises(ValueError, match="zeroshard.initialize"):
        safe_get_full_fp32_param(nn.Parameter(torch.zeros(2)))


@pytest.mark.parametrize("stage", STAGES)
def test_local_accessors_give_none_for_a_frozen_parameter(groups: Any, stage: int) -> None:
    """As DeepSpeed's: a frozen parameter has no master, gradient or optimizer state on any rank
    (the full and the local accessors alike), after backward and after the step."""
    rank, world = groups.rank, groups.world_size
    model = make_model()
    frozen = next(model.parameters())
    frozen.requires_grad = False
    engine = init_engine(model, api_config(stage, gas=1))
    backward_only(engine, global_batches(1, 2 * world)[0], rank, world)
    assert safe_get_local_grad(frozen) is None and safe_get_full_grad(frozen) is None
    engine.step()
    assert safe_get_local_fp32_param(frozen) is None and safe_get_full_fp32_param(frozen) is None
    assert safe_get_local_optimizer_state(frozen, "exp_avg") is None
    assert safe_get_full_optimizer_state(frozen, "exp_avg") is None
    trained = [p for p in params_of(engine) if p.requires_grad][0]
    assert safe_get_local_optimizer_state(trained, "exp_avg") is not None
