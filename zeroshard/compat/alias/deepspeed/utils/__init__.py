"""deepspeed.utils -> zeroshard.utils (logger, safe_get_* / safe_set_*, z3 leaf modules)."""

from deepspeed.utils import groups, zero_to_fp32  # DeepSpeed's utils binds groups too (`from .groups import *`)
from zeroshard.compat._names import reexport as _reexport

_NAMES = ["logger", "log_dist", "safe_get_full_fp32_param", "safe_set_full_fp32_param",
          "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_set_full_optimizer_state",
          "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
          "safe_set_full_grad", "safe_set_local_grad", "safe_set_local_fp32_param",
          "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized", "set_z3_leaf_modules",
          "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
          "see_memory_usage", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix"]
_LOG_LEVEL = "zeroshard.compat.ds_utils:set_log_level_from_string"
__getattr__, __dir__ = _reexport(__name__, {**{n: f"zeroshard.utils:{n}" for n in _NAMES},
                                            "set_log_level_from_string": _LOG_LEVEL})
