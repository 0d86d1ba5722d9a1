"""`zeroshard.checkpointing`: DeepSpeed's activation-checkpointing API (`deepspeed.checkpointing`).

The implementation lives in zeroshard/runtime/activation_checkpointing.py; this module is its
public name. Not to be confused with model checkpoints (`engine.save_checkpoint`).
"""

from zeroshard.runtime.activation_checkpointing import (
    CheckpointingSettings,
    RNGStatesTracker,
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    non_reentrant_checkpoint,
    recompute_seconds,
    reset,
    settings,
)

CudaRNGStatesTracker = RNGStatesTracker
"""DeepSpeed's name for the tracker class."""

__all__ = [
    "CheckpointingSettings",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "recompute_seconds",
    "reset",
    "settings",
]
