"""Tensor parallelism (AutoTP): shard a model's linear layers over the `tp` axis of the device mesh.

`plan.py` resolves which layers split how (a Hugging Face `tp_plan`, DeepSpeed's
`partition_config`, a preset) and applies it; `layers.py` holds the column- and row-parallel
layers (plain local parameters, see Note: [why not DTensor parameters]); `setup.py` builds the
groups initialize() trains with (the `tensor_parallel` section, or a Megatron `mpu`).
"""

from zeroshard.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from zeroshard.tensor_parallel.setup import ParallelGroups, tp_model_init
from zeroshard.tensor_parallel.tp_plan import Plan, Style, TensorParallelState, resolve_plan, shard_model, tp_state_of

__all__ = [
    "ColumnParallelLinear",
    "ParallelGroups",
    "Plan",
    "RowParallelLinear",
    "Style",
    "TensorParallelState",
    "resolve_plan",
    "shard_model",
    "tp_model_init",
    "tp_state_of",
]
