"""A direct `loss.backward()` (DeepSpeed 0.19's "PyTorch-style backward") is refused at step(),
instead of stepping on gradients that were never reduced across ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zeroshard
from engine_helpers import make_config


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_direct_backward_is_refused(groups: Any, stage: int) -> None:
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)),
                                      config=make_config(zero_optimization={"stage": stage}))
    x = torch.randn(2, 4)
    engine(x).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"engine.backward\(loss\) instead of loss.backward\(\)"):
        engine.step()
    loss = engine(x).pow(2).mean()  # the supported way still works afterwards
    engine.backward(loss)
    engine.step()
    with torch.no_grad():
        engine(x)  # an evaluation forward does not need a backward
    engine.step()
