"""deepspeed.compression.helper: `recursive_getattr` / `recursive_setattr` (compat/helpers.py)."""

from zeroshard.compat.helpers import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]
