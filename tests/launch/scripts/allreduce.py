"""Two-node launch test worker: a gloo all_reduce across every rank; prints one line to assert."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world_size * (world_size + 1) / 2
    dist.destroy_process_group()
    print(f"ALLREDUCE rank={rank} world={world_size} local_rank={os.environ['LOCAL_RANK']} "
          f"value={value.item():g} env={os.environ.get('ZS_LAUNCH_TEST', '<unset>')}", flush=True)
    return 0 if value.item() == expected else 1


if __name__ == "__main__":
    sys.exit(main())
