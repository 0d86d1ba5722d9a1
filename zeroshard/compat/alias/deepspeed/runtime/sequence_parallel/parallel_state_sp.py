"""deepspeed.runtime.sequence_parallel.parallel_state_sp -> zeroshard.sequence.parallel_state."""

from zeroshard.compat._names import reexport as _reexport

_NAMES = ["initialize_sequence_parallel", "_release_sequence_parallel_groups", "get_sequence_parallel_group",
          "get_sequence_data_parallel_group", "get_sequence_parallel_world_size",
          "get_sequence_data_parallel_world_size", "get_sequence_parallel_rank", "get_sequence_data_parallel_rank",
          "get_model_parallel_rank", "get_model_parallel_world_size", "get_model_parallel_group"]
__getattr__, __dir__ = _reexport(__name__, {n: f"zeroshard.sequence.parallel_state:{n}" for n in _NAMES})
