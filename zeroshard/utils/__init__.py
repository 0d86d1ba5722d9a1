"""`deepspeed.utils`'s public names, each an alias onto zeroshard's own code.

    from zeroshard.utils import safe_get_full_fp32_param     # deepspeed.utils.safe_get_full_fp32_param

The `safe_*` functions read and write one parameter's fp32 master, gradient and optimizer state
at any ZeRO stage (runtime/param_access.py): the `full` ones are collective at stages 1-3 (every
rank calls them, for the same parameters, in the same order), valid right after
`load_checkpoint`; the `local` ones return this rank's fragments. Names are imported on first
use, so `import zeroshard.utils` stays light.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

logger = logging.getLogger("zeroshard")
"""The library's logger (DeepSpeed's `deepspeed.utils.logger`)."""


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the listed ranks (None or [-1]: every rank), as DeepSpeed's log_dist."""
    from zeroshard.comm.functional import get_rank

    rank = get_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


_LAZY = {
    **{name: "zeroshard.runtime.param_access" for name in (
        "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_grad",
        "safe_get_full_optimizer_state", "safe_set_full_optimizer_state", "safe_get_local_fp32_param",
        "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_full_grad",
        "safe_set_local_grad", "safe_set_local_fp32_param", "safe_set_local_optimizer_state",
        "safe_update_full_grad_vectorized")},
    **{name: "zeroshard.zero.leaf" for name in (
        "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
        "set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix")},
    "see_memory_usage": "zeroshard.runtime.memory_usage",
    "RepeatingLoader": "zeroshard.runtime.dataloader",
    "unwrap_model_for_generation": "zeroshard.runtime.inference",
}

__all__ = ["log_dist", "logger", *_LAZY]

if TYPE_CHECKING:
    from zeroshard.runtime.dataloader import RepeatingLoader
    from zeroshard.runtime.inference import unwrap_model_for_generation
    from zeroshard.runtime.memory_usage import see_memory_usage
    from zeroshard.zero.leaf import (
        get_z3_leaf_modules,
        set_z3_leaf_module,
        set_z3_leaf_modules,
        set_z3_leaf_modules_by_name,
        set_z3_leaf_modules_by_suffix,
        unset_z3_leaf_modules,
        z3_leaf_module,
    )


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'zeroshard.utils' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    if module.__name__ == "zeroshard.runtime.param_access":
        value = module.SAFE_FUNCTIONS[name]
    else:
        value = getattr(module, name)
    globals()[name] = value
    return value
