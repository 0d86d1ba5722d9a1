"""deepspeed.runtime.zero.parameter_offload: DeepSpeed's parameter-dict machinery, by name only.

zeroshard's stage 3 keeps each module's ordinary `_parameters` dict (its hooks gather a unit's
parameters before forward), so `ZeROOrderedDict` and `ensure_zero_ordered_dict` are refused.
"""

from zeroshard.compat.refused import refused_class as _refused
from zeroshard.compat.refused import refused_function as _refused_function

_INSTEAD = "zeroshard's stage 3 keeps modules' ordinary _parameters dicts and gathers in its own hooks"

ZeROOrderedDict = _refused("deepspeed.runtime.zero.parameter_offload.ZeROOrderedDict", _INSTEAD)
ensure_zero_ordered_dict = _refused_function("deepspeed.runtime.zero.parameter_offload.ensure_zero_ordered_dict",
                                             _INSTEAD)

__all__ = ["ZeROOrderedDict", "ensure_zero_ordered_dict"]
