"""deepspeed.runtime.config_utils: `DeepSpeedConfigModel`, the pydantic base of DeepSpeed's configs."""

from zeroshard.compat.ds_config import DeepSpeedConfigModel

__all__ = ["DeepSpeedConfigModel"]
