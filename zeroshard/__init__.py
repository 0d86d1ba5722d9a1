"""zeroshard: ZeRO data-parallel training driven by a DeepSpeed ds_config.json.

    engine, optimizer, loader, scheduler = zeroshard.initialize(model=..., config="ds_config.json")

Names are imported on first use, so `zeroshard launch` (which needs none of them) starts
without importing torch or the runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zeroshard.compat.paths import serve as _serve_deepspeed_paths

_serve_deepspeed_paths()  # zeroshard.checkpointing, zeroshard.runtime.lr_schedules, ... (compat/paths.py)

__version__ = "0.1.0"

_EXPORTS = {
    "initialize": "zeroshard.runtime.initialize",
    "ZeroEngine": "zeroshard.runtime.engine",
    "Config": "zeroshard.config",
    "load_config": "zeroshard.config",
    "init_distributed": "zeroshard.comm",
    "add_config_arguments": "zeroshard.arguments",
    "ZeroshardError": "zeroshard.errors",
    "ConfigError": "zeroshard.errors",
    "NotSupportedError": "zeroshard.errors",
    "CommError": "zeroshard.errors",
    "LaunchError": "zeroshard.errors",
    "DeepSpeedEngine": "zeroshard.runtime.engine",
    "tp_model_init": "zeroshard.tensor_parallel",
    "get_accelerator": "zeroshard.accelerator",
}

_SUBMODULES = ("comm", "zero", "utils", "runtime", "checkpoint", "config", "estimate", "accelerator", "moe",
               "checkpointing", "tensor_parallel", "ops", "compression")
"""DeepSpeed scripts reach these as attributes (`deepspeed.zero.Init`, `deepspeed.comm.get_rank`,
`deepspeed.accelerator.get_accelerator()`, `deepspeed.checkpointing`, `deepspeed.ops.adam`)."""

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from zeroshard.accelerator import get_accelerator
    from zeroshard.arguments import add_config_arguments
    from zeroshard.comm import init_distributed
    from zeroshard.config import Config, load_config
    from zeroshard.errors import CommError, ConfigError, LaunchError, NotSupportedError, ZeroshardError
    from zeroshard.runtime.engine import ZeroEngine
    from zeroshard.runtime.initialize import initialize
    from zeroshard.tensor_parallel import tp_model_init


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"zeroshard.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'zeroshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
