"""deepspeed.runtime.zero.config: `DeepSpeedZeroConfig` and its offload sections over zeroshard's reader."""

from zeroshard.compat.ds_config import (
    DeepSpeedZeroConfig,
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
)

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig"]
