"""DeepSpeed's accelerator interface: `get_accelerator()` returns one object for this process's device.

    from zeroshard.accelerator import get_accelerator
    device = torch.device(get_accelerator().device_name(local_rank))

Scripts written for DeepSpeed call it at import time, so importing this package is cheap: the
implementation (zeroshard/accelerator/device.py, built on torch.accelerator and torch's device
modules) is imported on the first `get_accelerator()`. Imports nothing of zeroshard at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeroshard.accelerator.device import Accelerator

__all__ = ["get_accelerator", "set_accelerator", "is_current_accelerator_supported"]

_ACCELERATOR: "Accelerator | None" = None


def get_accelerator() -> "Accelerator":
    """The process's accelerator: `DS_ACCELERATOR` if set ("cuda", "cpu", "xpu", ...), else the
    accelerator torch detects (`torch.accelerator.current_accelerator()`), else the CPU.

    Raises:
        ValueError: `DS_ACCELERATOR` names a device type torch does not know or cannot use here.
    """
    global _ACCELERATOR
    if _ACCELERATOR is None:
        from zeroshard.accelerator.device import detect

        _ACCELERATOR = detect()
    return _ACCELERATOR


def set_accelerator(accelerator: "Accelerator") -> None:
    """Replace the process's accelerator (DeepSpeed's `set_accelerator`); call it before anything
    asks for the device."""
    global _ACCELERATOR
    _ACCELERATOR = accelerator


def is_current_accelerator_supported() -> bool:
    """True: every device type torch offers is supported through torch's own device modules."""
    return True
