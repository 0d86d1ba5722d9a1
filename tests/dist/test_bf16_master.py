"""`bf16.bf16_master_weights_and_grads` + `bf16.bf16_optimizer_states` at stages 1-3 (world 1, 2, 3).

With both on, the master shard, the gradient shard and Adam's moments are bf16 (DeepSpeed 0.19's
`master_weights_and_grads_dtype`): model-state bytes per rank drop by the dtype ratio, the step
stays consistent across stages, and a checkpoint resumes bitwise. The comparison with DeepSpeed
itself is in tests/launch/test_deepspeed_examples.py (demo-s2/s3-bf16-master).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import global_batches, init_engine, make_config, make_model, train_engine

MASTER = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _config(stage: int, master: bool, offload: bool = False, **extra: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 300}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 100
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return make_config(zero_optimization=zero, bf16=MASTER if master else {"enabled": True}, **extra)


def _one_step(cfg: dict[str, Any], rank: int, world: int) -> Any:
    engine = init_engine(make_model(), cfg)
    train_engine(engine, global_batches(1, 2 * world), rank, world)
    return engine


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_master_grads_and_states_are_bf16(groups: Any, stage: int, offload: bool) -> None:
    rank, world = groups.rank, groups.world_size
    plain = _one_step(_config(stage, False, offload), rank, world)
    master = _one_step(_config(stage, True, offload), rank, world)
    opt = master.optimizer
    for group in opt.param_groups:
        for p in group["params"]:
            assert p.dtype == torch.bfloat16, p.dtype
            state = opt.state[p]
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
            assert p.grad is None or p.grad.dtype == torch.bfloat16
    want, got = plain.model_state_bytes(), master.model_state_bytes()
    assert [m.device for m in got] == [m.device for m in want]
    for w, g in zip(want, got):
        # fp32 -> bf16 halves the gradient shard and both Adam moments on every home.
        assert g.grads * 2 == w.grads, (w, g)
        assert g.optimizer_states * 2 == w.optimizer_states, (w, g)
        assert g.params == w.params, (w, g)
        if offload:  # a separate bf16 master at the CPU home
            assert g.master_params * 2 == w.master_params, (w, g)
        else:  # a bf16 master beside bf16 parameters on their device is the parameters themselves
            assert g.master_params == 0 and (w.master_params > 0 or w.grads == 0), (w, g)


def test_stages_agree(groups: Any) -> None:
    """Stages 1, 2 and 3 take the same bf16 steps (the same sums in the same grouping are not
    guaranteed across stages, so within a few bf16 ulps: 2**-8 relative per element is one ulp;
    4 ulps bounds the drift measured over 3 steps)."""
    rank, world = groups.rank, groups.world_size
    data = global_batches(3, 2 * world)
    runs = {}
    for stage in (1, 2, 3):
        engine = init_engine(make_model(), _config(stage, True))
        runs[stage] = train_engine(engine, data, rank, world)
    for stage in (2, 3):
        for a, b in zip(runs[stage][0], runs[1][0]):
            assert abs(a - b) <= 4 * 2.0 ** -8 * abs(b), (stage, runs[stage][0], runs[1][0])
    # and the flag does change the run: fp32 masters give different weights after 3 steps
    plain = train_engine(init_engine(make_model(), _config(1, False)), data, rank, world)
    assert any(not torch.equal(a, b) for a, b in zip(plain[1][-1], runs[1][1][-1]))


@pytest.mark.parametrize("stage,offload", [(1, False), (2, True), (3, False)], ids=["s1", "s2-offload", "s3"])
def test_resume_is_bitwise_exact(groups: Any, shared_dir: Path, stage: int, offload: bool) -> None:
    rank, world = groups.rank, groups.world_size
    data = global_batches(6, 2 * world)
    engine = init_engine(make_model(), _config(stage, True, offload))
    train_engine(engine, data[:3], rank, world)
    engine.save_checkpoint(shared_dir)
    want_losses, want = train_engine(engine, data[3:], rank, world)
    resumed = init_engine(make_model(seed=7), _config(stage, True, offload))
    resumed.load_checkpoint(shared_dir, load_rng_state=True)
    for p in resumed.optimizer.param_groups[0]["params"]:
        assert resumed.optimizer.state[p]["exp_avg"].dtype == torch.bfloat16
    got_losses, got = train_engine(resumed, data[3:], rank, world)
    assert got_losses == want_losses
    for step, (a_list, b_list) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            assert torch.equal(a, b), f"step {step} parameter {i} differs"


def test_checkpoint_loads_into_fp32_masters(groups: Any, shared_dir: Path) -> None:
    """A bf16-master checkpoint loads into an engine with fp32 masters at another stage (the
    states are widened exactly: every bf16 value is an fp32 value) and consolidates to fp32."""
    from zeroshard.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    rank, world = groups.rank, groups.world_size
    engine = init_engine(make_model(), _config(2, True))
    train_engine(engine, global_batches(2, 2 * world), rank, world)
    engine.save_checkpoint(shared_dir)
    plain = init_engine(make_model(seed=7), _config(1, False))
    plain.load_checkpoint(shared_dir)
    for a, b in zip(plain.module.parameters(), engine.module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert len(plain.optimizer.state) == len(plain.optimizer.param_groups[0]["params"])  # states loaded
    for p in plain.optimizer.state:
        assert plain.optimizer.state[p]["exp_avg"].dtype == torch.float32
    state = get_fp32_state_dict_from_zero_checkpoint(shared_dir)
    assert {v.dtype for v in state.values()} == {torch.float32}
    for name, p in engine.module.named_parameters():
        assert torch.equal(state[name], p.float()), name
