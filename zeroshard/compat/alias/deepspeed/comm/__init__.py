"""deepspeed.comm -> zeroshard.comm (DeepSpeed's torch.distributed-like functions)."""

from zeroshard.compat._names import reexport as _reexport

_NAMES = ["init_distributed", "is_initialized", "get_rank", "get_world_size", "get_local_rank",
          "barrier", "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
          "reduce_scatter_tensor", "reduce", "new_group", "all_to_all_single",
          "destroy_process_group", "get_global_rank", "ReduceOp"]
__getattr__, __dir__ = _reexport(__name__, {**{n: f"zeroshard.comm:{n}" for n in _NAMES},
                                            "init_distributed": "zeroshard.compat.comm:init_distributed"})
