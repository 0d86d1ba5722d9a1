"""deepspeed.runtime.zero: GatheredParameters, Init and partition_parameters."""

from zeroshard.compat._names import reexport as _reexport

from deepspeed.runtime.zero import partition_parameters  # noqa: F401

__getattr__, __dir__ = _reexport(__name__, {
    "GatheredParameters": "zeroshard.zero:GatheredParameters", "Init": "zeroshard.zero:Init",
    "register_external_parameter": "zeroshard.zero:register_external_parameter"})
