"""engine.optimizer's DeepSpeed names without a process group: loss_scaler, cur_scale, overflow, and
the torch optimizer's state shared, not copied (runtime/zero_optimizer.py)."""

from __future__ import annotations

import pytest
import torch

from zeroshard.runtime.loss_scaler import DynamicLossScaler, StaticLossScaler
from zeroshard.runtime.zero_optimizer import ZeroOptimizer


def _wrapped(scaler: object = None) -> ZeroOptimizer:
    p = torch.nn.Parameter(torch.ones(3))
    return ZeroOptimizer(torch.optim.SGD([p], lr=0.1), loss_scaler=scaler, parameter_offload=None)


def test_bf16_fp32_scale_is_a_static_one() -> None:
    opt = _wrapped()
    assert opt.cur_scale == opt.loss_scale == 1.0
    assert isinstance(opt.loss_scaler, StaticLossScaler) and opt.loss_scaler.cur_scale == 1.0
    assert not opt.dynamic_loss_scale and opt.overflow is False


def test_fp16_cur_scale_follows_the_dynamic_scaler() -> None:
    scaler = DynamicLossScaler(init_scale=2.0**4, scale_window=1, hysteresis=2)
    opt = _wrapped(scaler)
    assert opt.loss_scaler is scaler and opt.dynamic_loss_scale
    assert opt.cur_scale == opt.loss_scaler.cur_scale == 16.0 and scaler.delayed_shift == 2
    scaler.update(True)
    assert opt.cur_scale == 16.0, "hysteresis 2: the first overflow keeps the scale"
    scaler.update(True)
    assert opt.cur_scale == 8.0
    scaler.update(False)
    scaler.update(False)
    assert opt.cur_scale == 16.0


def test_static_fp16_scale() -> None:
    opt = _wrapped(StaticLossScaler(128.0))
    assert opt.cur_scale == opt.loss_scaler.cur_scale == 128.0 and not opt.dynamic_loss_scale


def test_groups_and_state_are_the_wrapped_optimizers() -> None:
    opt = _wrapped()
    inner = opt.optimizer
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    p = inner.param_groups[0]["params"][0]
    p.grad = torch.ones(3)
    opt.step()
    sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    assert torch.allclose(p.detach(), torch.full((3,), 0.9))
    assert opt.state_dict() == inner.state_dict()
    opt.zero_grad()
    assert p.grad is None


def test_no_parameter_offload_below_stage3_and_private_names_stay_private() -> None:
    opt = _wrapped()
    assert not hasattr(opt, "parameter_offload")
    opt.optimizer.swap = "the NVMe optimizer's swap files"  # a public name of a wrapped optimizer
    assert opt.swap == "the NVMe optimizer's swap files"
    opt.optimizer._swap_internals = "private"
    with pytest.raises(AttributeError):
        assert opt._swap_internals != "private"
