"""deepspeed.runtime.zero.offload_config: the offload section models and the device names."""

from enum import Enum

from zeroshard.compat.ds_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig


class OffloadDeviceEnum(str, Enum):
    """The values of `offload_param.device` / `offload_optimizer.device`."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum"]
