"""deepspeed.runtime.pipe -> zeroshard.pipe."""

from zeroshard.compat._names import reexport as _reexport

_NAMES = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology"]
__getattr__, __dir__ = _reexport(__name__, {n: f"zeroshard.pipe:{n}" for n in _NAMES})
