"""zeroshard.moe: DeepSpeed's MoE helpers work for dense models and refuse experts by name."""

from __future__ import annotations

import pytest
import torch

import zeroshard
from zeroshard.errors import NotSupportedError
from zeroshard.moe.layer import MoE
from zeroshard.moe.utils import (
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)


def test_dense_groups_come_back_unchanged() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    group = {"params": model.parameters(), "name": "all", "weight_decay": 0.1}
    groups = split_params_into_different_moe_groups_for_optimizer(group)
    assert len(groups) == 1 and groups[0]["name"] == "all" and groups[0]["weight_decay"] == 0.1
    assert [id(p) for p in groups[0]["params"]] == [id(p) for p in model.parameters()]
    two = ({"params": [model[0].weight]}, {"params": [model[0].bias]})
    assert len(split_params_into_different_moe_groups_for_optimizer(two)) == 2
    assert not any(is_moe_param(p) for p in model.parameters())
    assert has_moe_layers(model) == (False, 0)
    shared, expert = split_params_into_shared_and_expert_params(model.parameters())
    assert len(shared) == 4 and expert == []
    torch.optim.AdamW(groups)  # usable as the optimizer's groups
    assert zeroshard.moe.utils.is_moe_param is is_moe_param


def test_experts_are_refused_by_name() -> None:
    expert = torch.nn.Parameter(torch.zeros(2, 2))
    expert.allreduce = False  # DeepSpeed's marker for an expert parameter
    expert.group_name = "ep_size_2"
    with pytest.raises(NotSupportedError, match="expert parameter.*ep_size_2.*mixture-of-experts"):
        split_params_into_different_moe_groups_for_optimizer([{"params": [expert], "name": "g"}])
    with pytest.raises(NotSupportedError, match="mixture-of-experts"):
        configure_moe_param_groups([expert])
    with pytest.raises(NotSupportedError, match="MoE"):
        MoE(hidden_size=8)
    with pytest.raises(ValueError, match="param_groups must be"):
        split_params_into_different_moe_groups_for_optimizer("params")  # type: ignore[arg-type]
