"""Optimizer step time: Adam states swapped through NVMe (zero/offload/nvme_swap.py) against CPU offload
(torch's fused AdamW on an in-memory shard), same element count. bench/nvme.md.

    python bench/nvme_step.py DIR [--numel 25e6] [--sub-group 5e6] [--buffer-count 3] [--steps 5]

The NVMe step returns with its last write-backs in flight (they overlap the next forward and
backward in training); here each timed step ends with `sync()`, so the figure includes them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from zeroshard.zero.offload.nvme_io import IOOptions
from zeroshard.zero.offload.nvme_swap import AdamHyper, SwappedAdam


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--numel", type=float, default=25e6)
    ap.add_argument("--sub-group", type=float, default=5e6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--buffer-count", type=int, default=3, help="slots of the pool (offload_optimizer.buffer_count)")
    args = ap.parse_args()
    n = int(args.numel)
    grad = torch.randn(n)
    p = torch.nn.Parameter(torch.randn(n))
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    cpu = []
    for _ in range(args.steps + 1):
        p.grad = grad
        t = time.perf_counter()
        opt.step()
        cpu.append(time.perf_counter() - t)
    swap = SwappedAdam(args.dir, n, rank=0, sub_group_numel=int(args.sub_group), io=IOOptions(queue_depth=8),
                       buffer_count=args.buffer_count)
    swap.write_state("master", torch.randn(n))
    out = torch.empty(n)
    nvme = []
    for _ in range(args.steps + 1):
        t = time.perf_counter()
        swap.step(grad, AdamHyper(lr=1e-3), lp_out=out)
        for i in range(len(swap._slots)):  # the write-backs still in flight, not the resident ones
            swap._wait_slot(i)
        nvme.append(time.perf_counter() - t)
    swap.close()
    c, v = statistics.median(cpu[1:]), statistics.median(nvme[1:])
    groups = -(-n // swap.sub_group_numel)
    swapped = max(0, groups - len(swap._slots)) / groups  # resident slots are not swapped
    moved = 2 * 3 * 4 * n * swapped  # read + write of three fp32 states
    print(f"{n / 1e6:.0f}M elements, sub-group {int(args.sub_group) / 1e6:.0f}M, "
          f"torch threads {torch.get_num_threads()}: "
          f"CPU offload step {c * 1e3:.0f} ms, NVMe step {v * 1e3:.0f} ms "
          f"({moved / 2**20:.0f} MiB swapped, {moved / v / 2**20:.0f} MiB/s), CPU/NVMe = {c / v:.2f}")


if __name__ == "__main__":
    main()
