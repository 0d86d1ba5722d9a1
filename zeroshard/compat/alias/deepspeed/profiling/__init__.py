"""deepspeed.profiling: the flops profiler's API (zeroshard/flops_profiler.py)."""

from deepspeed.profiling import flops_profiler

__all__ = ["flops_profiler"]
