"""`zero_optimization.ignore_unused_parameters: false` (stages 1 and 2): a trainable parameter that
gets no gradient in a whole optimizer step is an error naming it, raised at the step's last
backward (an AssertionError, as DeepSpeed's); a parameter used in any micro-batch of the step is
used; true (the default) gives unused parameters a zero gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.errors import UsageError


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.left = nn.Linear(4, 1)
        self.right = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, use_right: bool = False) -> torch.Tensor:
        h = self.body(x)
        return (self.right(h) if use_right else self.left(h)).sum()


def _engine(stage: int, ignore: bool) -> zeroshard.DeepSpeedEngine:
    model = TwoHeads()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "ignore_unused_parameters": ignore}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


@pytest.mark.parametrize("stage", [1, 2])
def test_unused_parameter_is_named_at_the_step_boundary(stage: int) -> None:
    engine = _engine(stage, ignore=False)
    x = torch.ones(1, 4)
    engine.backward(engine(x))  # first micro-batch: no check yet
    engine.step()
    with pytest.raises(UsageError, match=r"^zero_optimization\.ignore_unused_parameters is false and 2 trainable "
                       r"parameter\(s\) got no gradient in this optimizer step: right\.weight, right\.bias\.") as e:
        engine.backward(engine(x))
    assert isinstance(e.value, AssertionError) and "ignore_unused_parameters" in e.value.args[0]


@pytest.mark.parametrize("stage", [1, 2])
def test_used_in_any_micro_batch_is_used_and_true_ignores(stage: int) -> None:
    engine = _engine(stage, ignore=False)
    x = torch.ones(1, 4)
    for use_right in (False, True, True, False):  # two steps, each head used in one micro-batch
        engine.backward(engine(x, use_right))
        engine.step()
    assert engine.global_steps == 2
    lenient = _engine(stage, ignore=True)
    for _ in range(2):
        lenient.backward(lenient(x))
        lenient.step()
    assert lenient.global_steps == 1
