"""DeepSpeed's `deepspeed.moe.utils`: telling expert parameters apart and grouping them for the optimizer.

DeepSpeed marks an expert parameter `allreduce = False` with `group_name = "ep_size_<E>"`
(moe/experts.py). Scripts build their optimizer's groups with
`split_params_into_different_moe_groups_for_optimizer`, which moves expert parameters into groups
of their own (`"moe": True`, named after the expert group) so that ZeRO partitions their state
over the expert-data-parallel group. Imports torch and `zeroshard.moe.layer`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from zeroshard.moe.layer import MoE

ParamGroups = dict[str, Any] | Sequence[dict[str, Any]]


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter (`allreduce = False`, as DeepSpeed marks them)."""
    return getattr(param, "allreduce", True) is False


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """True for a group `split_params_into_different_moe_groups_for_optimizer` made for experts."""
    return bool(param_group.get("moe", False))


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """`(True, num_experts of the first MoE layer)` when the model has one, else `(False, 0)`."""
    for module in model.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def split_params_into_shared_and_expert_params(
        params: Iterable[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """`(shared, expert)` parameters, each in the given order."""
    shared: list[nn.Parameter] = []
    expert: list[nn.Parameter] = []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
        group: Iterable[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients (in each parameter's dtype) of the shared and of the expert parameters that have one."""
    shared, expert = split_params_into_shared_and_expert_params(p for p in group if p.grad is not None)
    return [p.grad.to(p.dtype) for p in shared], [p.grad.to(p.dtype) for p in expert]  # type: ignore[union-attr]


def _as_list(param_groups: ParamGroups) -> list[dict[str, Any]]:
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: param_groups must be a dict "
                         f"or a list/tuple of dicts, got {type(param_groups).__name__}")
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: group {i} must be a dict "
                             "with a 'params' key")
        group["params"] = list(group["params"])
    return groups


def _chunks(params: list[nn.Parameter], max_numel: int | float | None) -> list[list[nn.Parameter]]:
    """Consecutive runs of `params` of at most `max_numel` elements each (a larger parameter alone)."""
    if max_numel is None:
        return [params]
    chunks: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        numel = getattr(p, "ds_numel", p.numel())
        if chunks and size + numel <= max_numel:
            chunks[-1].append(p)
            size += numel
        else:
            chunks.append([p])
            size = numel
    return chunks


def split_params_into_different_moe_groups_for_optimizer(param_groups: ParamGroups,
                                                         max_group_size: int | float | None = 178956971
                                                         ) -> list[dict[str, Any]]:
    """The optimizer's parameter groups, with expert parameters moved into groups of their own.

    Each given group keeps its dense parameters; for each (group, expert group name) pair a new
    group follows all given groups: the original's options, `"name": "ep_size_<E>"`, `"moe": True`,
    its expert parameters, split into groups of at most `max_group_size` elements (None: one
    group), as DeepSpeed 0.19.8 does. A dense model's groups come back unchanged (as a list).

    Args:
        param_groups: a param-group dict, or a list/tuple of them (modified in place, as DeepSpeed does).
        max_group_size: elements per expert group at most.

    Raises:
        ValueError: `param_groups` is not a dict, list or tuple of dicts with "params".

    Example::

        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": model.parameters(), "name": "parameters"})
        optimizer = torch.optim.AdamW(groups, lr=1e-3)
    """
    groups = _as_list(param_groups)
    new_groups: list[dict[str, Any]] = []
    for group in groups:
        dense, experts = split_params_into_shared_and_expert_params(group["params"])
        names = list(dict.fromkeys(p.group_name for p in experts))  # type: ignore[attr-defined]
        group["params"] = dense
        for name in names:
            mine = [p for p in experts if p.group_name == name]  # type: ignore[attr-defined]
            for chunk in _chunks(mine, max_group_size):
                new_groups.append({**group, "name": name, "moe": True, "params": chunk})
    return groups + new_groups


def configure_moe_param_groups(model_parameters: list[Any]) -> list[Any]:
    """DeepSpeed's `initialize` hook: a list of parameters becomes groups with experts split out
    ("dense-params" plus the expert groups); a list of groups without "moe" groups is split; groups
    already split are returned as they are.

    Raises:
        ValueError: `model_parameters` is not a list.
        TypeError: an entry is neither a tensor nor a dict.
    """
    if not isinstance(model_parameters, list):
        raise ValueError(f"configure_moe_param_groups: model_parameters must be a list, got "
                         f"{type(model_parameters).__name__}")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("configure_moe_param_groups: expected tensors or param-group dicts, got "
                            f"{type(p).__name__}")
    if not model_parameters:
        return model_parameters
    if isinstance(model_parameters[0], dict):
        if any("moe" in g for g in model_parameters):
            return model_parameters
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters, "name": "dense-params"})
