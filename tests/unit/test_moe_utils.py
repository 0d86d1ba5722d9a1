"""zeroshard.moe.utils and the expert-group layout: DeepSpeed 0.19.8's optimizer groups for expert
parameters, and its expert-parallel / expert-data-parallel rank lists."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.compat import ds_groups
from zeroshard.moe.ep_groups import expert_parallel_ranks
from zeroshard.moe.layer import MoE
from zeroshard.moe.utils import (
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)


def moe_model(ep_size: int = 2) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), MoE(4, nn.Linear(4, 4), num_experts=4, ep_size=ep_size))


def test_dense_groups_come_back_unchanged() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    group = {"params": model.parameters(), "name": "all", "weight_decay": 0.1}
    groups = split_params_into_different_moe_groups_for_optimizer(group)
    assert len(groups) == 1 and groups[0]["name"] == "all" and groups[0]["weight_decay"] == 0.1
    assert [id(p) for p in groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert not any(is_moe_param(p) for p in model.parameters())
    assert has_moe_layers(model) == (False, 0)
    assert zeroshard.moe.utils.is_moe_param is is_moe_param
    with pytest.raises(ValueError, match="param_groups must be"):
        split_params_into_different_moe_groups_for_optimizer("params")  # type: ignore[arg-type]


def test_expert_params_get_groups_of_their_own() -> None:
    model = moe_model()
    params = list(model.parameters())
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": params, "name": "main", "lr": 0.5}], max_group_size=20)
    dense, *moe = groups
    assert dense["name"] == "main" and not dense.get("moe")
    assert [id(p) for p in dense["params"]] == [id(p) for p in params if not is_moe_param(p)]
    # two local experts of 4x4 + 4 = 20 elements each: one expert per group at max_group_size 20
    assert [len(g["params"]) for g in moe] == [2, 2]
    assert all(g["moe"] and g["name"] == "ep_size_2" and g["lr"] == 0.5 for g in moe)
    assert has_moe_layers(model) == (True, 4)
    shared, expert = split_params_into_shared_and_expert_params(params)
    assert len(shared) == 3 and len(expert) == 4  # 2 linears' weights + biases; the gate's weight is shared
    torch.optim.AdamW(groups)  # usable as the optimizer's groups


def test_configure_moe_param_groups_as_deepspeed() -> None:
    model = moe_model()
    groups = configure_moe_param_groups(list(model.parameters()))
    assert [g["name"] for g in groups] == ["dense-params", "ep_size_2"]
    assert configure_moe_param_groups(groups) is groups  # already split
    with pytest.raises(TypeError, match="tensors or param-group dicts"):
        configure_moe_param_groups([1])


@pytest.mark.parametrize(("world", "ep", "ep_groups", "edp_groups"), [
    (2, 1, [[0], [1]], [[0, 1]]),
    (2, 2, [[0, 1]], [[0], [1]]),
    (4, 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    (8, 4, [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]),
])
def test_layout_is_deepspeeds(world: int, ep: int, ep_groups: list[list[int]], edp_groups: list[list[int]]) -> None:
    assert expert_parallel_ranks(world, ep) == (ep_groups, edp_groups)
    assert ds_groups._get_expert_parallel_ranks(world, 1, ep) == (ep_groups, edp_groups)


def test_layout_data_before_expert_and_refusals() -> None:
    assert expert_parallel_ranks(4, 2, data_before_expert=True) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="must divide the data-parallel world size"):
        expert_parallel_ranks(6, 4)
    with pytest.raises(ValueError, match="data parallelism only"):
        ds_groups._get_expert_parallel_ranks(8, 2, 2)
