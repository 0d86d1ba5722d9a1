"""The `torch_autocast` section at run time: the autocast context of the engine's forward.

Parameters, gradients and master weights keep the training dtype (fp32 unless `bf16`/`fp16` is
on); only the forward's ops run in the autocast dtype, chosen per op by torch. Imports config only.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch
from torch import nn

from zeroshard.config import TorchAutocastConfig
from zeroshard.errors import ConfigError

DEFAULT_SAFE_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
"""DeepSpeed's default `lower_precision_safe_modules`."""


def autocast_dtype(section: TorchAutocastConfig, device_type: str) -> torch.dtype | None:
    """The dtype the forward is autocast to, None when the section is off."""
    if not section.enabled:
        return None
    if section.precision is None:
        return torch.get_autocast_dtype(device_type)
    return torch.bfloat16 if section.precision == "bf16" else torch.float16


def safe_module_classes(section: TorchAutocastConfig) -> tuple[type[nn.Module], ...]:
    """Import the classes `lower_precision_safe_modules` names; a bad name fails at initialize.

    Raises:
        ConfigError: a name does not import or is not an nn.Module subclass.
    """
    if section.lower_precision_safe_modules is None:
        return DEFAULT_SAFE_MODULES
    classes = []
    for i, name in enumerate(section.lower_precision_safe_modules):
        key = f"torch_autocast.lower_precision_safe_modules[{i}]"
        package, _, cls_name = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(package), cls_name) if package else None
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"{key}: {name!r} does not import ({e}). Give a fully qualified class, "
                              "e.g. \"torch.nn.Linear\".") from e
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ConfigError(f"{key}: {name!r} is not an nn.Module class. Give a fully qualified module "
                              "class, e.g. \"torch.nn.Linear\".")
        classes.append(cls)
    return tuple(classes)


def forward_context(dtype: torch.dtype | None, device_type: str) -> contextlib.AbstractContextManager[object]:
    """`torch.autocast` for the forward when the section is on (it takes over an outer autocast,
    as DeepSpeed's), else nothing: the caller's own autocast, if any, stays in force."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype, enabled=True)


def cast_inputs_half(inputs: Any) -> Any:
    """`fp16.auto_cast`: the floating tensors among the forward's positional inputs (through
    lists, tuples and dicts) cast to fp16, as DeepSpeed does; keyword inputs are left alone,
    as in DeepSpeed."""
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(cast_inputs_half(v) for v in inputs)
    if isinstance(inputs, dict):
        return {k: cast_inputs_half(v) for k, v in inputs.items()}
    if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
        return inputs.half()
    return inputs
