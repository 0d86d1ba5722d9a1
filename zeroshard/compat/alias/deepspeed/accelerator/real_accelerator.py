"""deepspeed.accelerator.real_accelerator: where DeepSpeed defines `get_accelerator` (Megatron-DeepSpeed's
pretrain_gpt.py imports it from here); the same objects as `deepspeed.accelerator`."""

from zeroshard.compat._names import reexport as _reexport

__getattr__, __dir__ = _reexport(__name__, {"get_accelerator": "zeroshard.accelerator:get_accelerator",
                                            "set_accelerator": "zeroshard.accelerator:set_accelerator",
                                            "is_current_accelerator_supported":
                                                "zeroshard.compat.ds_utils:is_current_accelerator_supported"})
