"""deepspeed.ops.adam: DeepSpeed's Adam classes on torch's fused kernels."""

from zeroshard.compat.optimizers import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
