"""deepspeed.profiling.flops_profiler -> zeroshard.flops_profiler (torch's operator counter)."""

from deepspeed.profiling.flops_profiler.profiler import *  # noqa: F403  DeepSpeed re-exports the same way
from deepspeed.profiling.flops_profiler.profiler import __all__
