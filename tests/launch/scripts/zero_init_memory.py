"""Build a ~400 MB model with or without zero.Init on each rank; print the peak RSS growth."""

import resource
import sys

import torch
from torch import nn

from zeroshard.comm import init_distributed
from zeroshard.zero.init import Init

LAYERS, WIDTH = 8, 2048  # 8 x 2048 x 2048 fp32 = 8 x 16 MiB = 128 MiB + biases... scaled below


class Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS * 3))
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)


def main() -> None:
    groups = init_distributed()
    use_init = sys.argv[1] == "init"
    torch.manual_seed(0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with Init(enabled=use_init):
        model = Big()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    layer_bytes = max(p.numel() * 4 for p in model.parameters())
    print(f"RESULT rank={groups.rank} init={use_init} peak_growth={peak} model={model_bytes} "
          f"largest={layer_bytes} world={groups.world_size}", flush=True)


if __name__ == "__main__":
    main()
