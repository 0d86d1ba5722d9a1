"""Worker for bench/two_node.py: times a gloo all-reduce of a flat fp32 tensor across every rank.

    python bench/two_node.py -- bench/allreduce_time.py [--numel N] [--iters K]

Rank 0 prints one `ALLREDUCE_TIME` line: mean and min seconds per all-reduce and the bytes each
rank sends in a ring all-reduce, 2 * (world - 1) / world * numel * 4.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--local_rank", type=int, default=-1, help="given by zeroshard launch, as DeepSpeed's launcher")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((args.numel,), float(rank + 1))
    dist.all_reduce(x)  # warm-up: connections and buffers
    expected = world * (world + 1) / 2
    ok = bool((x == expected).all())
    times = []
    for _ in range(args.iters):
        x.fill_(1.0)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    ok = ok and bool((x == world).all())
    dist.destroy_process_group()
    if rank == 0:
        sent = 2 * (world - 1) / world * args.numel * 4
        print(f"ALLREDUCE_TIME world={world} numel={args.numel} mean_s={sum(times) / len(times):.4f} "
              f"min_s={min(times):.4f} ring_bytes_per_rank={sent:.0f} correct={ok}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
