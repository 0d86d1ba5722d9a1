"""deepspeed.zero -> zeroshard.zero (Init, GatheredParameters, register_external_parameter)."""

from zeroshard.compat._names import reexport as _reexport

__getattr__, __dir__ = _reexport(__name__, {
    n: f"zeroshard.zero:{n}" for n in
    ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter"]})
