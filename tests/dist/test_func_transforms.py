"""`torch.func` transforms called on the engine at 1/2/3 ranks (DeepSpeed 0.19's
test_zero_torch_func): a forward inside `grad` / `jacrev` / `vmap(grad)` is the transform's, not
a micro-batch, so its gradients come back to the caller unscaled and untouched by the engine's
accumulation; training afterwards is unaffected. At stage 3 the differentiating transforms are
refused by name, while a plain `vmap` forward works."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from engine_helpers import init_engine
from torch import nn

from zeroshard.errors import NotSupportedError


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).sum()


def build(stage: int, gas: int) -> tuple[Any, nn.Module]:
    torch.manual_seed(3)
    model = Tiny()
    baseline = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas, "steps_per_print": 1000,
           "zero_optimization": {"stage": stage}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    return init_engine(model, cfg), baseline


@pytest.mark.parametrize("gas", [1, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_transforms_through_the_engine_match_the_module(groups: Any, stage: int, gas: int) -> None:
    engine, baseline = build(stage, gas)
    x = torch.randn(8, generator=torch.Generator().manual_seed(7))
    batch = torch.stack([x, x + 0.1, x - 0.1])
    for name, transform in [
        ("grad", torch.func.grad),
        ("jacrev", torch.func.jacrev),
        ("vmap(grad)", lambda f: torch.func.vmap(torch.func.grad(f))),
    ]:
        arg = batch if name.startswith("vmap") else x
        got = transform(lambda xi: engine(xi))(arg)
        want = transform(lambda xi: baseline(xi))(arg)
        assert torch.allclose(got, want, atol=1e-6), f"stage {stage}, gas {gas}: {name} through the engine"
    grad, value = torch.func.grad_and_value(lambda xi: engine(xi))(x)
    assert torch.allclose(value, baseline(x)) and torch.allclose(grad, torch.func.grad(baseline)(x), atol=1e-6)
    assert engine.micro_steps == 0 and not engine.grads_ready, "a transform's forward is not a micro-batch"
    for _ in range(gas):  # training afterwards: one optimizer step as usual
        engine.backward(engine(x.unsqueeze(0)))
        engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()


def test_stage3_refuses_differentiating_transforms_by_name(groups: Any) -> None:
    engine, baseline = build(3, 1)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(7))
    with pytest.raises(NotSupportedError, match="torch.func.grad / jacrev / jvp through a ZeRO stage-3 engine"):
        torch.func.grad(lambda xi: engine(xi))(x[0])
    got = torch.func.vmap(lambda xi: engine(xi))(x)
    assert torch.allclose(got, torch.func.vmap(baseline)(x), atol=1e-6), "plain vmap at stage 3"
    engine.backward(engine(x[:1]))
    engine.step()
    assert engine.global_steps == 1
