"""deepspeed.runtime.zero: GatheredParameters, Init and partition_parameters."""

from deepspeed.runtime.zero import partition_parameters
from zeroshard.compat._names import reexport as _reexport

__getattr__, __dir__ = _reexport(__name__, {
    "GatheredParameters": "zeroshard.zero:GatheredParameters", "Init": "zeroshard.compat.comm:Init",
    "register_external_parameter": "zeroshard.zero:register_external_parameter",
    "ZeroParamStatus": "zeroshard.zero.units:ZeroParamStatus",
    "unwrap_model_for_generation": "zeroshard.compat.ds_utils:unwrap_model_for_generation"})
