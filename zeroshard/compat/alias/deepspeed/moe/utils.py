"""deepspeed.moe.utils -> zeroshard.moe.utils."""

from zeroshard.compat._names import reexport as _reexport

_NAMES = ["split_params_into_different_moe_groups_for_optimizer", "is_moe_param", "is_moe_param_group",
          "has_moe_layers", "split_params_into_shared_and_expert_params",
          "split_params_grads_into_shared_and_expert_params", "configure_moe_param_groups"]
__getattr__, __dir__ = _reexport(__name__, {n: f"zeroshard.moe.utils:{n}" for n in _NAMES})
