"""`deepspeed.runtime.zero.partition_parameters`'s public names (zeroshard.zero.*)."""

from zeroshard.zero.init import GatheredParameters, Init, register_external_parameter
from zeroshard.zero.units import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]
