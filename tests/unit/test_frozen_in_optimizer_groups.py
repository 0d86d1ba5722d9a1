"""A client optimizer whose groups also hold frozen parameters (built from every parameter of the
model): the frozen ones are left out of what it steps, as DeepSpeed does, at every stage; a
parameter the model does not have is still refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].weight.requires_grad = False
    model[0].bias.requires_grad = False
    return model


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_parameters_in_client_groups_are_left_out(stage: int) -> None:
    model = _model()
    frozen = model[0].weight.detach().clone()
    groups = [{"params": [m.weight for m in model], "weight_decay": 0.01}, {"params": [m.bias for m in model]}]
    optimizer = torch.optim.SGD(groups, lr=0.1)
    config = {"train_batch_size": 1, "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage}}
    engine, opt, *_ = zeroshard.initialize(model=model, optimizer=optimizer, config=config)
    assert sum(len(g["params"]) for g in optimizer.param_groups) <= 4  # the two frozen tensors are not stepped
    engine.backward(engine(torch.ones(2, 3)).sum())
    engine.step()
    assert engine.global_steps == 1
    if stage < 3:
        torch.testing.assert_close(engine.module[0].weight.detach(), frozen)


def test_a_foreign_parameter_is_still_refused() -> None:
    model = _model()
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(2)), *model[1].parameters()], lr=0.1)
    with pytest.raises(ValueError, match="not a trainable parameter of the model"):
        zeroshard.initialize(model=model, optimizer=optimizer,
                             config={"train_batch_size": 1, "zero_allow_untested_optimizer": True})
