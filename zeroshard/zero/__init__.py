"""Partitioning strategies behind one interface (zero/strategy.py); `build_strategy` picks one.

DeepSpeed's user names (`zeroshard.zero.Init`, `GatheredParameters`, `register_external_parameter`,
`ZeroParamStatus`, the leaf-module functions) are imported on first use, so that importing this
package stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zeroshard.zero.stage0 import Stage0Strategy, broadcast_module_state
from zeroshard.zero.strategy import GradStats, ModelStateBytes, ZeroStrategy

_LAZY = {
    "Init": "zeroshard.zero.init",
    "GatheredParameters": "zeroshard.zero.init",
    "register_external_parameter": "zeroshard.zero.init",
    "unregister_external_parameter": "zeroshard.zero.init",
    "ZeroParamStatus": "zeroshard.zero.units",
    "set_z3_leaf_modules": "zeroshard.zero.leaf",
    "unset_z3_leaf_modules": "zeroshard.zero.leaf",
    "z3_leaf_module": "zeroshard.zero.leaf",
}

__all__ = ["GradStats", "ModelStateBytes", "Stage0Strategy", "ZeroStrategy", "broadcast_module_state",
           *_LAZY]

if TYPE_CHECKING:
    from zeroshard.zero.init import GatheredParameters, Init, register_external_parameter
    from zeroshard.zero.leaf import set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
    from zeroshard.zero.units import ZeroParamStatus


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'zeroshard.zero' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
