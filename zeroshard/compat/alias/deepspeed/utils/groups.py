"""deepspeed.utils.groups -> zeroshard.compat.ds_groups (expert-parallel, expert-data-parallel and
sequence-parallel groups)."""

from zeroshard.compat._names import reexport as _reexport

_NAMES = ["mpu", "_get_expert_parallel_group", "_get_expert_parallel_group_ranks", "_get_expert_parallel_group_dict",
          "_get_expert_data_parallel_group", "_get_expert_data_parallel_group_ranks",
          "_get_expert_data_parallel_group_dict", "_get_expert_parallel_world_size",
          "_get_expert_data_parallel_world_size", "_get_expert_parallel_rank", "_get_expert_data_parallel_rank",
          "_get_expert_parallel_src_rank", "_get_expert_broadcast_src_rank", "_get_max_expert_size",
          "_get_max_expert_size_name", "_get_max_expert_parallel_group", "_get_expert_model_parallel_world_size",
          "_get_data_parallel_group", "_get_data_parallel_world_size", "_get_data_parallel_rank",
          "_get_expert_parallel_ranks", "_get_sequence_parallel_group", "_get_sequence_parallel_world_size",
          "_get_sequence_parallel_rank", "_get_sequence_data_parallel_group", "_get_sequence_data_parallel_world_size",
          "_get_sequence_data_parallel_rank"]
__getattr__, __dir__ = _reexport(__name__, {n: f"zeroshard.compat.ds_groups:{n}" for n in _NAMES})
