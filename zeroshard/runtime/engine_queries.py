"""DeepSpeed's read-only engine queries (`train_batch_size()`, `get_lr()`, `fp16_enabled()`, ...).

A mixin of `ZeroEngine`: each query reads the engine's public `zs_config`, `comm` or
`optimizer`; none changes state, and none reads an engine underscore name. Kept apart so
engine.py holds the training step only. Imports nothing of zeroshard but the config and comm types (for annotations).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zeroshard.comm import Comm
    from zeroshard.config import Config


class EngineQueries:
    """DeepSpeed 0.19.8's `DeepSpeedEngine` queries, with its names and return types."""

    zs_config: "Config"  # the engine's properties
    comm: "Comm"
    optimizer: torch.optim.Optimizer | None

    def train_batch_size(self) -> int:
        return self.zs_config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.zs_config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.zs_config.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.zs_config.gradient_clipping

    @property
    def sparse_tensor_module_names(self) -> set[str]:
        """DeepSpeed's set of the `Embedding` weights whose gradients it reduces as sparse tensors
        (`sparse_gradients: true`). zeroshard refuses `sparse_gradients` (config/support.py) and
        reduces every gradient dense, so the set is empty; a fresh set each time."""
        return set()

    def zero_optimization_stage(self) -> int:
        return self.zs_config.zero_optimization.stage

    def zero_optimization(self) -> bool:
        return self.zs_config.zero_optimization.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zs_config.zero_optimization.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zs_config.zero_optimization.stage >= 3

    def zero_offload_optimizer(self) -> bool:
        return self.zs_config.zero_optimization.offload_optimizer.device != "none"

    zero_cpu_offload = zero_offload_optimizer

    def zero_offload_param(self) -> bool:
        return self.zs_config.zero_optimization.offload_param.device != "none"

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def dump_state(self) -> bool:
        return bool(self.zs_config.dump_state)

    def empty_partition_cache(self) -> None:
        """DeepSpeed releases stage-3 parameters it kept gathered; zeroshard releases every
        unit after use already (only `stage3_param_persistence_threshold` ones stay), so
        there is nothing to free."""

    def fp16_enabled(self) -> bool:
        return self.zs_config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.zs_config.precision == "bf16"

    bf16_enabled = bfloat16_enabled

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self.zs_config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def steps_per_print(self) -> int | None:
        return self.zs_config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return bool(self.zs_config.wall_clock_breakdown)

    @property
    def local_rank(self) -> int:
        return self.comm.groups.local_rank

    @property
    def dp_world_size(self) -> int:
        """The ranks the batch is split over (with sequence parallelism, without the sequence ranks):
        `ParallelDims.dp`, as `initialize` decided it."""
        if self.dims is None:
            raise AssertionError("expected an engine built by zeroshard.initialize (it sets engine.dims)")
        return self.dims.dp

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks sharing one sample (1 without sequence parallelism)."""
        seq = self._sequence_groups()
        return seq.size if seq is not None else 1

    @property
    def seq_dp_world_size(self) -> int:
        """The ranks ZeRO partitions over: data x sequence parallel (DeepSpeed's name)."""
        return self.comm.world_size

    @property
    def seq_data_parallel_group(self) -> Any:
        """ZeRO's group, the data- and sequence-parallel ranks together (a torch process group)."""
        return self.comm.groups.dp_group

    @property
    def seq_parallel_group(self) -> Any:
        """The sequence-parallel group (a torch process group; None without sequence parallelism)."""
        seq = self._sequence_groups()
        return seq.sp.dp_group if seq is not None else None

    def get_sequence_parallel_group(self) -> Any:
        return self.seq_parallel_group

    def _sequence_groups(self) -> Any:
        parallel = getattr(self, "parallel", None)
        return parallel.sequence if parallel is not None else None

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def mp_world_size(self) -> int:
        """Ranks holding pieces of one model replica (the tensor-parallel size; 1 without)."""
        parallel = getattr(self, "parallel", None)
        return parallel.tp_comm.world_size if parallel is not None and parallel.tp_comm is not None else 1

    @property
    def data_parallel_group(self) -> Any:
        """The ranks the batch is split over (with sequence parallelism, one per sequence group)."""
        seq = self._sequence_groups()
        return seq.dp.dp_group if seq is not None else self.comm.groups.dp_group

    def get_lr(self) -> list[float]:
        """The learning rate of every param group."""
        if self.optimizer is None:
            return []
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        """Per param group: `betas` (Adam-like optimizers), else `momentum` (SGD, RMSprop)."""
        if self.optimizer is None:
            return []
        key = "betas" if "betas" in self.optimizer.param_groups[0] else "momentum"
        return [g.get(key) for g in self.optimizer.param_groups]

    def get_type(self) -> Any:
        return self.zs_config.optimizer.type if self.zs_config.optimizer is not None else None

    def optimizer_name(self) -> str | None:
        return self.zs_config.optimizer.type if self.zs_config.optimizer is not None else None
