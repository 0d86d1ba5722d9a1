"""deepspeed.module_inject.layers: `GatherReplacedLayerParams` -> zeroshard's GatheredSplitParameters."""

from zeroshard.tensor_parallel.gathered import GatheredSplitParameters as GatherReplacedLayerParams

__all__ = ["GatherReplacedLayerParams"]
