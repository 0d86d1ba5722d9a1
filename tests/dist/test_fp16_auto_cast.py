"""`fp16.auto_cast`: the floating positional inputs of the forward arrive in fp16, as DeepSpeed
casts them (through lists, tuples and dicts); integer tensors and keyword inputs are left alone."""

from __future__ import annotations

import torch
from engine_helpers import init_engine, make_config
from torch import nn


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.seen: list[object] = []

    def forward(self, x: torch.Tensor, pair: tuple, extra: dict, ids: torch.Tensor, *,
                kw: torch.Tensor) -> torch.Tensor:
        self.seen = [x.dtype, pair[0].dtype, extra["m"].dtype, ids.dtype, kw.dtype]
        return self.lin(x.to(self.lin.weight.dtype)).float().mean() + 0 * kw.sum()


def run(auto_cast: bool) -> list[object]:
    model = Recorder()
    engine = init_engine(model, make_config(fp16={"enabled": True, "auto_cast": auto_cast},
                                            zero_optimization={"stage": 1}))
    x = torch.randn(2, 4)
    loss = engine(x, (x.clone(),), {"m": x.clone()}, torch.arange(2), kw=x.clone())
    engine.backward(loss)
    engine.step()
    return model.seen


def test_auto_cast_casts_positional_floating_inputs(groups) -> None:
    assert run(True) == [torch.float16, torch.float16, torch.float16, torch.int64, torch.float32]


def test_without_auto_cast_inputs_are_untouched(groups) -> None:
    assert run(False) == [torch.float32, torch.float32, torch.float32, torch.int64, torch.float32]
