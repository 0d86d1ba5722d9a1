"""Small DeepSpeed utility functions that libraries import by name, written for zeroshard."""

from __future__ import annotations

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
