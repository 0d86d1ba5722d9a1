"""deepspeed.profiling.flops_profiler.profiler -> zeroshard.flops_profiler."""

from zeroshard.flops_profiler import (
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = ["FlopsProfiler", "get_model_profile", "number_to_string", "macs_to_string", "flops_to_string",
           "params_to_string", "duration_to_string"]
