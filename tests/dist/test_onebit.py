"""1-bit Adam (`"type": "OneBitAdam"`, optim/onebit_adam.py) on the tiny GPT at stage 0.

- Warm-up: bitwise plain Adam (the same torch AdamW kernel on the same all-reduced gradients).
- After `freeze_step`: the loss curve stays within a stated tolerance of plain Adam's.
- The momentum all-reduce moves ~1/32 of the fp32 gradient all-reduce's wire bytes.
- Checkpoints: the error buffers are saved per rank and restored, so a resumed run equals the
  uninterrupted one bit for bit; a plain Adam run loads the checkpoint (errors dropped).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import global_batches, init_engine, make_config, make_model, train_engine

from zeroshard.errors import ConfigError
from zeroshard.optim.onebit_adam import OneBitAdam
from zeroshard.optim.onebit_allreduce import wire_bytes

FREEZE = 4
STEPS = 20
LR = 1e-2


def onebit_config(freeze_step: int = FREEZE, **extra: Any) -> dict[str, Any]:
    return make_config(optimizer={"type": "OneBitAdam", "params": {
        "lr": LR, "weight_decay": 0.01, "freeze_step": freeze_step, "cuda_aware": False,
        "comm_backend_name": "nccl"}}, **extra)


def adam_config(**extra: Any) -> dict[str, Any]:
    return make_config(optimizer={"type": "Adam", "params": {"lr": LR, "weight_decay": 0.01}}, **extra)


def _batches(world: int, steps: int = STEPS) -> list:
    # One batch repeated: the tiny model memorises it, so the loss really falls over 20 steps.
    return global_batches(1, 2 * world) * steps


def test_warmup_is_plain_adam_then_compression_stays_close(groups) -> None:
    rank, world = groups.rank, groups.world_size
    model = make_model()
    plain = init_engine(copy.deepcopy(model), adam_config())
    plain_losses, plain_params = train_engine(plain, _batches(world), rank, world)
    onebit = init_engine(copy.deepcopy(model), onebit_config())
    assert isinstance(onebit.optimizer.optimizer, OneBitAdam)  # DeepSpeed's name for the wrapped one
    losses, params = train_engine(onebit, _batches(world), rank, world)
    # Warm-up: bitwise (same fused AdamW kernel, same all-reduced gradients).
    for step in range(FREEZE):
        assert all(torch.equal(a, b) for a, b in zip(params[step], plain_params[step])), f"warm-up step {step}"
        assert losses[step] == plain_losses[step]
    assert onebit.optimizer.compressing
    if world > 1:  # the compression really changed the trajectory
        assert any(not torch.equal(a, b) for a, b in zip(params[FREEZE], plain_params[FREEZE]))
    # Tolerance after the warm-up: each step's loss at most 10% above plain Adam's and at least
    # 60% of it. Measured (fp32, lr 1e-2, freeze 4, 20 steps, bench/onebit.md): 1-bit Adam's loss
    # was at most 5.4% above plain Adam's at 2 ranks (final 2.456 vs 2.389) and 5.1% at 3 ranks
    # (final 2.578 vs 2.661). Below: the variance frozen at step 4 (early, small gradients) gives
    # larger steps than plain Adam's; at 1 rank, where nothing is compressed and only the frozen
    # variance differs, the loss runs up to 28% below plain's (final 1.486 vs 2.064). A broken
    # momentum average (the mean|c| scale, or one scale for all parameters) measured 28-99% above.
    for step in range(FREEZE, STEPS):
        assert 0.6 * plain_losses[step] <= losses[step] <= 1.10 * plain_losses[step], (
            f"step {step}: 1-bit {losses[step]:.4f} vs plain {plain_losses[step]:.4f}\n{losses}\n{plain_losses}")
    assert losses[-1] < 0.5 * losses[0], "1-bit Adam still trains"


def _wire_bytes(records: list, world: int) -> float:
    """Bytes one rank sends for the logged collectives: a ring all-reduce sends 2(w-1)/w of its
    buffer, an all-gather (w-1)/w of its output, an all-to-all (w-1)/w of its input."""
    factor = {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world,
              "all_to_all": (world - 1) / world}
    return sum(r.bytes * factor[r.op] for r in records if r.op in factor)


def test_momentum_allreduce_bytes_drop_32x(groups) -> None:
    rank, world = groups.rank, groups.world_size
    model = make_model()
    engine = init_engine(model, onebit_config(comms_logger={"enabled": True}))
    log = engine._comm.log
    per_step = []
    for batch in _batches(world, FREEZE + 3):
        log.reset()
        train_engine(engine, [batch], rank, world)
        per_step.append((_wire_bytes(log.records, world), {r.op for r in log.records}))
    warm, compressed = per_step[FREEZE - 1], per_step[FREEZE + 1]
    n = sum(p.numel() for p in model.parameters())
    if world == 1:  # nothing crosses a wire; the compressed stage issues no all-to-all at all
        assert warm[0] == compressed[0] == 0 and "all_to_all" not in compressed[1]
        return
    assert warm[0] >= 2 * (world - 1) / world * 4 * n  # the whole fp32 gradient, every warm-up step
    assert "all_to_all" in compressed[1]
    # Theory (optim/onebit_allreduce.py wire_bytes): 1 bit per element (each parameter padded to 8 * world
    # elements) plus two fp32 scales per parameter per rank, and the 8-byte all-reduce that agrees
    # on the gradient norm. The scales weigh on this tiny model (10,848 elements in many small
    # tensors); the bench's larger model shows the ~32x (bench/onebit.md).
    numels = [p.numel() for p in model.parameters()]
    theory = wire_bytes(numels, world) + 2 * (world - 1) / world * 8
    assert compressed[0] == pytest.approx(theory, rel=1e-9), (compressed, theory)
    plain_theory = 2 * (world - 1) / world * 4 * n
    assert warm[0] == pytest.approx(plain_theory, rel=0.01), (warm, plain_theory)  # + the tiny loss/norm reductions
    ratio = warm[0] / compressed[0]
    assert ratio >= 20, (ratio, per_step)


def test_checkpoint_resume_equals_uninterrupted_and_loads_into_adam(groups, shared_dir: Path) -> None:
    rank, world = groups.rank, groups.world_size
    batches = _batches(world, FREEZE + 6)
    model = make_model()
    straight = init_engine(copy.deepcopy(model), onebit_config())
    _, want = train_engine(straight, batches, rank, world)

    first = init_engine(copy.deepcopy(model), onebit_config())
    train_engine(first, batches[: FREEZE + 3], rank, world)
    ar = first.optimizer.optimizer._allreduce
    errors = [t.clone() for t in ar.worker_errors + ar.server_errors_full]
    if world > 1:
        assert sum(float(e.abs().sum()) for e in errors) > 0, "the run compressed: its errors are not zero"
    first.save_checkpoint(str(shared_dir))

    resumed = init_engine(make_model(seed=5), onebit_config())
    resumed.load_checkpoint(str(shared_dir))
    ar = resumed.optimizer.optimizer._allreduce
    got_errors = ar.worker_errors + ar.server_errors_full
    assert all(torch.equal(a, b) for a, b in zip(got_errors, errors)), "this rank's own errors come back"
    assert resumed.optimizer.compressing
    _, got = train_engine(resumed, batches[FREEZE + 3 :], rank, world)
    for step, (a_list, b_list) in enumerate(zip(got, want[FREEZE + 3 :])):
        assert all(torch.equal(a, b) for a, b in zip(a_list, b_list)), f"resumed step {step}"

    # Reshard to "off": a plain Adam run takes AdamW's state and drops the 1-bit errors.
    adam = init_engine(make_model(seed=5), adam_config())
    adam.load_checkpoint(str(shared_dir))
    state = adam.optimizer.state[adam.optimizer.param_groups[0]["params"][0]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert int(state["step"]) == FREEZE + 3
    losses, _ = train_engine(adam, batches[FREEZE + 3 :], rank, world)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_refused_above_stage0(groups) -> None:
    cfg = onebit_config()
    cfg["zero_optimization"] = {"stage": 2}
    with pytest.raises(ConfigError, match=r"OneBitAdam applies to zero_optimization\.stage 0 only"):
        init_engine(make_model(), cfg)
