"""`EngineView`: the part of the engine its helper modules read (checkpoint_state, param_access,
inference, compile, auto_resume).

The engine (runtime/engine.py) imports those helpers; they take the engine as an argument. Typing
that argument with `ZeroEngine` itself would make each helper name the engine back, so the two
could never be read, tested or changed apart. They name this protocol instead, which `ZeroEngine`
satisfies structurally. A member is listed here only when a helper reads it. Imports torch,
checkpoint_format, comm, config, zero, tensor_parallel and runtime/loss_scaler for types only.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from zeroshard.checkpoint_format import Checkpointer
    from zeroshard.comm import Comm
    from zeroshard.config import Config
    from zeroshard.runtime.loss_scaler import LossScaler
    from zeroshard.tensor_parallel.setup import ParallelGroups
    from zeroshard.zero.strategy import ZeroStrategy


class EngineView(Protocol):
    """What checkpoints, parameter access, generation, compilation and auto-resume read of an engine."""

    module: nn.Module
    optimizer: Any
    lr_scheduler: Any
    training_dataloader: Any
    checkpointer: Checkpointer | None
    global_steps: int
    global_samples: int
    skipped_steps: int
    micro_steps: int
    pipeline_parallelism: bool
    parallel: ParallelGroups | None

    @property
    def zs_config(self) -> Config: ...

    @property
    def comm(self) -> Comm: ...

    @property
    def strategy(self) -> ZeroStrategy: ...

    @property
    def loss_scaler(self) -> LossScaler | None: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def grads_ready(self) -> bool: ...

    @property
    def mp_world_size(self) -> int: ...

    def get_loss_scale(self) -> float: ...

    def train_batch_size(self) -> int: ...

    def train_micro_batch_size_per_gpu(self) -> int: ...

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None, *args: Any,
                        **kwargs: Any) -> tuple[str | None, dict[str, Any] | None]: ...
