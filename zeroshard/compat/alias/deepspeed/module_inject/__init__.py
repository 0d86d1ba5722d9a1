"""deepspeed.module_inject: only `layers.GatherReplacedLayerParams` (OpenRLHF at TP > 1). AutoTP
itself is the `tensor_parallel` config section (zeroshard/tensor_parallel/); DeepSpeed's kernel
injection for inference is not served."""

from deepspeed.module_inject import layers

__all__ = ["layers"]
