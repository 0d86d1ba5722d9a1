"""engine.optimizer as DeepSpeed's ZeRO optimizer (runtime/zero_optimizer.py), and the stage-3 hook
removal and re-registration TRL's GRPO makes around generation (zero/parameter_offload.py).

The hooks are removed and put back by TRL's own `remove_hooks` / `add_hooks` (trl/models/utils.py),
around a generation inside `GatheredParameters` as TRL's `_unwrap_model_for_generation` does with
`gather_deepspeed3_params=True`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from tp_helpers import MICRO, SEQ, batches, lm_loss, tiny_llama

import zeroshard
from zeroshard.comm import ProcessGroups
from zeroshard.errors import UsageError
from zeroshard.zero.init import GatheredParameters
from zeroshard.zero.units import PartitionedParameterError


def _config(stage: int, **extra: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 500}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 40  # the norms persist, the rest is partitioned
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": zero, **extra}


def _engine(stage: int, **extra: Any) -> Any:
    model = tiny_llama()
    engine, optimizer, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                                   config=_config(stage, **extra))
    assert optimizer is engine.optimizer, "initialize returns engine.optimizer, as DeepSpeed does"
    return engine


# -- TRL's own hook removal and re-registration (trl/models/utils.py, TRL 1.16, the [test] extra) ---------

trl_utils = pytest.importorskip("trl.models.utils", reason="TRL is not installed (the [test] extra has it)")


@contextmanager
def trl_unwrap_for_generation(model: Any) -> Iterator[torch.nn.Module]:
    """TRL's `_unwrap_model_for_generation(model, accelerator, gather_deepspeed3_params=True)` at
    ZeRO-3 (accelerator.unwrap_model(engine) is engine.module)."""
    with GatheredParameters(model.parameters()):
        trl_utils.remove_hooks(model)
        yield model.module
        trl_utils.add_hooks(model)


# -- tests ----------------------------------------------------------------------------------------


def _train_step(engine: Any, ids: torch.Tensor) -> float:
    loss = lm_loss(engine, ids)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _generate(module: torch.nn.Module, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)


def _weights(engine: Any) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return [p.detach().clone() for p in params]


def test_generation_with_hooks_removed_leaves_training_unchanged(groups: ProcessGroups) -> None:
    """GRPO's loop at ZeRO-3: train, generate with every parameter gathered and the hooks removed,
    put the hooks back, train on. Every step equals a stage-3 run that never generated (exactly)
    and a stage-0 run (fp32 round-off); the generated tokens equal stage 0's."""
    rank, world = groups.rank, groups.world_size
    data = batches(5, world)
    prompt = data[0][rank][:, : SEQ // 2]
    gen = _engine(3)
    plain, ref = _engine(3), _engine(0)
    offload = gen.optimizer.parameter_offload
    root_hooks = len(gen.module._forward_pre_hooks), len(gen.module._forward_hooks)
    got, want_z3, want_z0 = [], [], []
    for step, shards in enumerate(data):
        if step in (0, 2, 3):  # before any training (nothing recorded yet), mid-run, twice in a row
            with trl_unwrap_for_generation(gen) as unwrapped:
                assert offload.forward_hooks == [] and offload.backward_hooks == []
                assert (len(gen.module._forward_pre_hooks), len(gen.module._forward_hooks)) == (0, 0)
                tokens = _generate(unwrapped, prompt)
            assert torch.equal(tokens, _generate(ref.module, prompt)), f"step {step}: generation differs"
            assert (len(gen.module._forward_pre_hooks), len(gen.module._forward_hooks)) == root_hooks
            assert offload.param_coordinator.is_invalid_trace(), "re-registration drops the recorded order"
        got.append(_train_step(gen, shards[rank]))
        want_z3.append(_train_step(plain, shards[rank]))
        want_z0.append(_train_step(ref, shards[rank]))
        assert not offload.param_coordinator.is_invalid_trace(), "a training step records the order again"
    assert got == want_z3, f"stage 3 with generation {got} != without {want_z3}"
    torch.testing.assert_close(got, want_z0, rtol=1e-5, atol=1e-6)
    for a, b, c in zip(_weights(gen), _weights(plain), _weights(ref)):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


def test_removed_hooks_really_stop_gathering(groups: ProcessGroups) -> None:
    """Without the hooks a forward outside a gather reads partitioned weights and is refused;
    `_register_deepspeed_module` twice never doubles a hook, and only takes the whole model."""
    engine = _engine(3)
    ids = batches(1, groups.world_size)[0][groups.rank]
    offload = engine.optimizer.parameter_offload
    counts = len(offload.forward_hooks), len(offload.backward_hooks)
    assert counts[0] > 0
    assert [p for _, p in engine.module.ds_external_parameters()] == []
    trl_utils.remove_hooks(engine)
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in engine.module.modules()) == 0
    # No hook gathers: the weights are partitioned (refused, or DeepSpeed's empty placeholders
    # that the embedding cannot index).
    with pytest.raises((PartitionedParameterError, RuntimeError, IndexError)), torch.no_grad():
        engine.module(input_ids=ids)
    offload._register_deepspeed_module(offload.module)
    offload._register_deepspeed_module(offload.module)
    assert (len(offload.forward_hooks), len(offload.backward_hooks)) == counts
    assert len(engine.module._forward_pre_hooks) == 1, "one gather hook on the root unit"
    with pytest.raises(UsageError, match="whole model"):
        offload._register_deepspeed_module(engine.module.model)
    with pytest.raises(UsageError, match="already invalid trace"):
        offload.param_coordinator._invalidate_trace()
    _train_step(engine, ids)  # the hooks gather again


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_below_stage3_no_parameter_offload(groups: ProcessGroups, stage: int) -> None:
    """As in DeepSpeed: no parameter_offload below stage 3 (TRL's hasattr sees none), and the torch
    optimizer's groups are shared with engine.optimizer (an lr scheduler on either steps both)."""
    engine = _engine(stage)
    opt = engine.optimizer
    assert not hasattr(opt, "parameter_offload")
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups is opt.optimizer.param_groups
    assert opt.cur_scale == 1.0 and opt.loss_scaler.cur_scale == 1.0 and opt.overflow is False
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    engine.lr_scheduler = sched
    _train_step(engine, batches(1, groups.world_size)[0][groups.rank])
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert opt.state_dict()["state"].keys() == opt.optimizer.state_dict()["state"].keys() != set()


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_cur_scale_is_the_engine_scale(groups: ProcessGroups, stage: int) -> None:
    """fp16: engine.optimizer.cur_scale and loss_scaler follow the dynamic loss scale; an overflow
    halves it and sets engine.optimizer.overflow (Accelerate's step_was_skipped)."""
    engine = _engine(stage, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    opt = engine.optimizer
    assert opt.cur_scale == opt.loss_scaler.cur_scale == engine.get_loss_scale() == 2.0**8
    assert opt.loss_scaler is engine.loss_scaler and opt.dynamic_loss_scale
    ids = batches(1, groups.world_size)[0][groups.rank]
    loss = lm_loss(engine, ids)
    engine.backward(loss * float("inf"))
    engine.step()
    assert opt.overflow is True and opt.cur_scale == 2.0**7 == engine.get_loss_scale()
    _train_step(engine, ids)
    assert opt.overflow is False and opt.cur_scale == 2.0**7


def test_deepcopy_free_state_dict_round_trip(groups: ProcessGroups) -> None:
    """engine.optimizer's state_dict/load_state_dict are the torch optimizer's (checkpoints)."""
    engine = _engine(3)
    _train_step(engine, batches(1, groups.world_size)[0][groups.rank])
    saved = copy.deepcopy(engine.optimizer.state_dict())
    engine.optimizer.load_state_dict(saved)
    assert engine.optimizer.state_dict()["param_groups"] == saved["param_groups"]
