"""`deepspeed.runtime.utils.see_memory_usage`: one log line of this process's memory use."""

from __future__ import annotations

import gc
import logging
import os
import resource
import sys

import torch

from zeroshard.runtime.monitor import format_bytes

logger = logging.getLogger("zeroshard")


def _rank() -> int:
    return int(os.environ.get("RANK", 0))


def see_memory_usage(message: str, force: bool = False) -> str | None:
    """Log `message` with the accelerator's allocated / peak memory and the process's peak RSS,
    on rank 0, when `force` is True (DeepSpeed's signature: without force it does nothing).

    Returns:
        The logged line on rank 0 when `force`, else None.
    """
    if not force or _rank() != 0:
        return None
    gc.collect()
    parts = [message]
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        mem = getattr(torch, acc.type, None) if acc is not None else None
        if mem is not None and hasattr(mem, "memory_allocated"):
            parts.append(f"{acc.type} allocated {format_bytes(mem.memory_allocated())}, "  # type: ignore[union-attr]
                         f"peak {format_bytes(mem.max_memory_allocated())}")
    # ru_maxrss is KiB on Linux, bytes on macOS.
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    parts.append(f"CPU peak RSS {format_bytes(peak_rss)}")
    line = " | ".join(parts)
    logger.info(line)
    return line
