"""deepspeed.runtime.precision_config: the fp16/bf16 section models over zeroshard's reader."""

from zeroshard.compat.ds_config import DeepSpeedBF16Config, DeepSpeedFP16Config, get_bfloat16_config

__all__ = ["DeepSpeedBF16Config", "DeepSpeedFP16Config", "get_bfloat16_config"]
