"""deepspeed.runtime.zero.utils: `ZeRORuntimeException`.

DeepSpeed raises it for a ZeRO misuse found at run time; zeroshard raises its own errors (all
subclasses of ZeroshardError, each naming the cause), so the name is that base class.
"""

from zeroshard.errors import ZeroshardError as ZeRORuntimeException

__all__ = ["ZeRORuntimeException"]
