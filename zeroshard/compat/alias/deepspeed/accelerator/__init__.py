"""deepspeed.accelerator -> zeroshard.accelerator."""

from zeroshard.compat._names import reexport as _reexport

__getattr__, __dir__ = _reexport(__name__, {"get_accelerator": "zeroshard.accelerator:get_accelerator",
                                            "set_accelerator": "zeroshard.accelerator:set_accelerator",
                                            "is_current_accelerator_supported":
                                                "zeroshard.compat.ds_utils:is_current_accelerator_supported"})
