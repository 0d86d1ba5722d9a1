"""deepspeed.runtime.pipe.engine -> zeroshard.runtime.pipe_engine."""

from zeroshard.compat._names import reexport as _reexport

__getattr__, __dir__ = _reexport(__name__, {"PipelineEngine": "zeroshard.runtime.pipe_engine:PipelineEngine"})
