"""Small DeepSpeed utility functions that libraries import by name, written for zeroshard."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch


def move_to_device(item: Any, device: torch.device | str, criterion_func: Any = None) -> Any:
    """Move every tensor in a (nested) list / tuple / dict to `device`; other values unchanged.

    `criterion_func(tensor) -> bool`, when given, selects which tensors move.
    """
    if isinstance(item, torch.Tensor):
        return item.to(device) if criterion_func is None or criterion_func(item) else item
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, Mapping):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """Copies of every tensor (detached, on `device`) in a nested structure.

    torch.save writes a view's whole underlying storage; cloning first writes only the view's
    own elements (a sliced or flattened parameter would otherwise drag its flat buffer along).
    """
    if isinstance(item, torch.Tensor):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, Mapping):
        return {k: clone_tensors_for_torch_save(v, device) for k, v in item.items()}
    return item


def recursive_getattr(model: Any, module_name: str) -> Any:
    """The object at dotted path `module_name` below `model` ("layers.0.attn" is
    model.layers[0].attn, as `named_modules()` spells it): DeepSpeed-Chat's LoRA code finds the
    layers it replaces by their names."""
    return functools.reduce(getattr, module_name.split("."), model)


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Put `module` at dotted path `module_name` below `model`. Set on the parent with setattr,
    so a module put in place of a submodule is registered as one (LoRA swaps its layers in)."""
    parent_name, _, name = module_name.rpartition(".")
    parent = recursive_getattr(model, parent_name) if parent_name else model
    setattr(parent, name, module)
