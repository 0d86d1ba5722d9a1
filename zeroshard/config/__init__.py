"""ds_config (path | dict | "auto") -> one typed, validated, frozen `Config`.

Layer 1 of zeroshard: imports nothing of ours but `zeroshard.errors`. See docs/config.md.
"""

from zeroshard.config.batch import BatchSizes, solve_batch
from zeroshard.config.load import load_config, read_config_file, tensor_parallel_size
from zeroshard.config.schema import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CommsLoggerConfig,
    Config,
    CSVMonitorConfig,
    DataTypesConfig,
    FP16Config,
    ParallelWriteConfig,
    TensorBoardConfig,
    TorchAutocastConfig,
    WandbConfig,
)
from zeroshard.config.schema_optim import (
    AdamParams,
    LambParams,
    LRRangeTestParams,
    OneCycleParams,
    OptimizerConfig,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from zeroshard.config.schema_zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "tensor_parallel_size",
    "ActivationCheckpointingConfig",
    "AdamParams",
    "AioConfig",
    "BF16Config",
    "BatchSizes",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "CommsLoggerConfig",
    "Config",
    "DataTypesConfig",
    "FP16Config",
    "LRRangeTestParams",
    "LambParams",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OneCycleParams",
    "OptimizerConfig",
    "ParallelWriteConfig",
    "SchedulerConfig",
    "TensorBoardConfig",
    "TorchAutocastConfig",
    "WandbConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
    "ZeroConfig",
    "load_config",
    "read_config_file",
    "solve_batch",
]
