"""deepspeed.runtime.pipe.module -> zeroshard.pipe.module."""

from zeroshard.compat._names import reexport as _reexport

_NAMES = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipelineError"]
__getattr__, __dir__ = _reexport(__name__, {n: f"zeroshard.pipe.module:{n}" for n in _NAMES})
