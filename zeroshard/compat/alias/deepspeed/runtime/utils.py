"""deepspeed.runtime.utils: the helpers libraries import from it."""

from zeroshard.compat._names import reexport as _reexport

__getattr__, __dir__ = _reexport(__name__, {
    "see_memory_usage": "zeroshard.utils:see_memory_usage",
    "move_to_device": "zeroshard.compat.helpers:move_to_device",
    "clip_grad_norm_": "torch.nn.utils:clip_grad_norm_",
})
