"""Launch-test worker: a pipeline stage whose process exits in the middle of train_batch.

    pipe_dead_stage.py     (torchrun, 2 or 4 ranks: 2 stages x data parallel 1 or 2)

The last rank (stage 1) exits (sys.exit(0), as a script's stray `return` on one rank) inside its
forward at the second batch, while its peers wait in torch's schedule. Every other rank must get
zeroshard's PipelineError naming stage 1 and its rank within seconds (the collective timeout is
60 s, the job's kill timer longer), print it as `REPORT rank R: ...` and exit 0 (so that torchrun
does not end the survivors before they print).
"""

from __future__ import annotations

import sys
import time

import torch
from torch import Tensor, nn

import zeroshard
from zeroshard.pipe import LayerSpec, PipelineModule
from zeroshard.pipe.module import PipelineError


class Dying(nn.Module):
    def __init__(self, dim: int, rank: int, world: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.calls, self.dies = 0, rank == world - 1

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.dies and self.calls > 5:  # torch's shape inference + 4 micro-batches, then batch 2
            print(f"REPORT rank {torch.distributed.get_rank()}: exiting inside stage 1's forward", flush=True)
            sys.exit(0)
        return self.fc(x)


def main() -> None:
    groups = zeroshard.init_distributed(timeout_s=60)
    rank, world = groups.rank, groups.world_size
    layers = [LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4), LayerSpec(Dying, 4, rank, world)]
    net = PipelineModule(layers, num_stages=2, loss_fn=lambda out, y: ((out.sum(-1) - y) ** 2).mean(),
                         partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zeroshard.initialize(model=net, model_parameters=list(net.parameters()), config=config)
    start = time.monotonic()
    try:
        for _ in range(3):
            start = time.monotonic()
            engine.train_batch(iter([(torch.randn(2, 4), torch.randn(2))] * 4))
    except PipelineError as e:
        print(f"REPORT rank {rank} after {time.monotonic() - start:.1f} s: {e}".splitlines()[0], flush=True)
        return
    print(f"REPORT rank {rank}: trained 3 batches without noticing", flush=True)


if __name__ == "__main__":
    main()
