"""deepspeed.utils.module_utils: `recursive_getattr` / `recursive_setattr`, DeepSpeed 0.19.8's new home for
them (deepspeed.compression.helper still serves them for DeepSpeed-Chat; compat/helpers.py)."""

from zeroshard.compat.helpers import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]
