"""Pipeline parallelism: DeepSpeed's `deepspeed.pipe` API (PipelineModule, LayerSpec, TiedLayerSpec,
the process topologies) on torch.distributed.pipelining's schedules; ZeRO runs inside each stage.

    net = PipelineModule(layers=[LayerSpec(Embed, ...), *blocks, LayerSpec(Head, ...)],
                         num_stages=2, loss_fn=cross_entropy)
    engine, _, _, _ = zeroshard.initialize(model=net, config=ds_config)
    loss = engine.train_batch(data_iter)
"""

from zeroshard.pipe.grid import PipelineParallelGrid
from zeroshard.pipe.module import DualPipeVModule, LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from zeroshard.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "DualPipeVModule",
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineError",
    "PipelineModule",
    "PipelineParallelGrid",
    "ProcessTopology",
    "TiedLayerSpec",
]
