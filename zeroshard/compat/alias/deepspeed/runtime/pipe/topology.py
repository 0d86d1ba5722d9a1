"""deepspeed.runtime.pipe.topology -> zeroshard.pipe.topology."""

from zeroshard.compat._names import reexport as _reexport

_NAMES = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid"]
__getattr__, __dir__ = _reexport(__name__, {n: f"zeroshard.pipe.topology:{n}" for n in _NAMES})
