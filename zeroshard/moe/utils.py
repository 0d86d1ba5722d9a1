"""DeepSpeed's `deepspeed.moe.utils` for models without mixture-of-experts layers.

Scripts written for DeepSpeed build their optimizer's parameter groups through
`split_params_into_different_moe_groups_for_optimizer` whether or not the model has experts. Without
expert parameters it returns the groups unchanged (as a list), as DeepSpeed does; an expert parameter
(DeepSpeed marks them `param.allreduce = False`) or a DeepSpeed `MoE` layer is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from zeroshard.errors import NotSupportedError

ParamGroups = dict[str, Any] | Sequence[dict[str, Any]]


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter: DeepSpeed marks them with `allreduce = False`."""
    return getattr(param, "allreduce", True) is False


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """`(False, 0)` for a dense model; a DeepSpeed `MoE` layer (by class name) is refused."""
    for name, module in model.named_modules():
        if type(module).__name__ == "MoE":
            _refuse(f"module {name or '<root>'} is a mixture-of-experts layer ({type(module).__qualname__})")
    return False, 0


def _refuse(what: str) -> None:
    raise NotSupportedError(
        f"{what}: zeroshard does not implement mixture-of-experts (expert parallelism). Train a dense "
        "model, or use DeepSpeed for MoE.")


def _check_dense(params: Iterable[torch.Tensor], where: str) -> None:
    for i, p in enumerate(params):
        if is_moe_param(p):
            _refuse(f"{where}: parameter {i} (shape {tuple(p.shape)}) is an expert parameter "
                    f"(allreduce=False, group {getattr(p, 'group_name', '?')!r})")


def split_params_into_shared_and_expert_params(
        params: Iterable[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """`(shared, expert)`: every parameter of a dense model is shared; expert parameters are refused."""
    params = list(params)
    _check_dense(params, "split_params_into_shared_and_expert_params")
    return params, []


def split_params_into_different_moe_groups_for_optimizer(param_groups: ParamGroups,
                                                         max_group_size: int | float | None = 178956971
                                                         ) -> list[dict[str, Any]]:
    """The optimizer's parameter groups, with expert parameters split into their own groups.

    zeroshard has no experts: the groups come back unchanged, as a list (a single dict or a tuple
    is accepted, as in DeepSpeed).

    Args:
        param_groups: a param-group dict, or a list/tuple of them.
        max_group_size: DeepSpeed's bound on an expert group's size; unused without experts.

    Raises:
        ValueError: `param_groups` is not a dict, list or tuple.
        NotSupportedError: a group holds an expert parameter.
    """
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
        _check_dense(group["params"], f"param group {i} ({group.get('name', 'unnamed')})")
    return groups


def configure_moe_param_groups(model_parameters: list[Any]) -> list[Any]:
    """DeepSpeed's hook to split expert groups inside `initialize`; a dense model's list is unchanged."""
    if not isinstance(model_parameters, list):
        raise ValueError(f"configure_moe_param_groups: model_parameters must be a list, got "
                         f"{type(model_parameters).__name__}")
    if model_parameters and isinstance(model_parameters[0], dict):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    _check_dense(model_parameters, "model_parameters")
    return model_parameters
