"""deepspeed.runtime.activation_checkpointing.checkpointing -> zeroshard.checkpointing."""

from zeroshard.compat._names import reexport as _reexport

_NAMES = ["checkpoint", "non_reentrant_checkpoint", "configure", "is_configured", "reset",
          "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed"]
__getattr__, __dir__ = _reexport(__name__, {n: f"zeroshard.checkpointing:{n}" for n in _NAMES})
