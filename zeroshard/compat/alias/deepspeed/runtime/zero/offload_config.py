"""deepspeed.runtime.zero.offload_config: the offload section models and the device names."""

from enum import Enum

from zeroshard.compat.ds_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig


class OffloadDeviceEnum(str, Enum):
    """The values of `offload_param.device` / `offload_optimizer.device`."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The states `engine.offload_states(include=...)` moves (runtime/offload_states.py)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadStateTypeEnum"]
