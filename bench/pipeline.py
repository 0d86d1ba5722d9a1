"""Measured pipeline bubble per schedule, from per-rank op timelines (issue 26 item 11).

    torchrun --standalone --nproc-per-node=P bench/pipeline.py [--micro-batches M] [--dim D]

Each rank times every forward / backward / weight-gradient op torch's PipelineStage runs inside
the schedule's `step` (the schedule's span, not the gradient reduction or optimizer step). Per
rank, bubble = (span - busy) / busy, the idle time per unit of compute, which the theory gives
as (p - 1) / m for GPipe and 1F1B and (p - 1) / (v m) for interleaved 1F1B. Rank 0 prints one
row per schedule (mean and max over ranks, median over the measured steps). Results: bench/pipeline.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import zeroshard
from zeroshard.pipe import LayerSpec, PipelineModule

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zero_bubble", 2)]


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(F.gelu(self.fc(x)))


def _timed(record: list[tuple[float, float]], fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append((start, time.perf_counter()))
    return wrapper


def run(schedule: str, virtual: int, p: int, m: int, dim: int, steps: int) -> list[float]:
    layers = [LayerSpec(Block, dim) for _ in range(2 * p * virtual)]
    net = PipelineModule(layers, num_stages=p, loss_fn=lambda out, y: F.mse_loss(out, y), partition_method="uniform",
                         virtual_stages=virtual)
    cfg = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": m, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 10**6,
           "pipeline": {"schedule": schedule}}
    engine, *_ = zeroshard.initialize(model=net, model_parameters=list(net.parameters()), config=cfg)
    sched, stages = engine.schedule_parts()
    ops: list[tuple[float, float]] = []
    spans: list[tuple[float, float]] = []
    for st in stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(st, name, _timed(ops, getattr(st, name)))
    sched.step = _timed(spans, sched.step)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, dim, generator=g), torch.randn(16, dim, generator=g)) for _ in range(m)]
    ratios = []
    for step in range(steps + 2):
        ops.clear()
        spans.clear()
        engine.train_batch(iter(data))
        if step < 2:  # warm-up: shape inference, allocator
            continue
        start, end = spans[0]
        busy = sum(b - a for a, b in ops if a >= start and b <= end)
        ratios.append((end - start - busy) / busy)
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    world = zeroshard.comm.init_distributed()
    p, m = world.world_size, args.micro_batches
    rows = []
    for schedule, virtual in SCHEDULES:
        mine = statistics.median(run(schedule, virtual, p, m, args.dim, args.steps))
        everyone: list[Any] = [None] * p
        dist.all_gather_object(everyone, mine)
        theory = {"gpipe": (p - 1) / m, "1f1b": (p - 1) / m, "interleaved_1f1b": (p - 1) / (virtual * m),
                  "interleaved_zero_bubble": 0.0}[schedule]
        rows.append(f"| {schedule} | {p} | {virtual} | {m} | {statistics.mean(everyone):.3f} | {max(everyone):.3f} "
                    f"| {theory:.3f} |")
    if world.rank == 0:
        print("| schedule | stages p | virtual v | micro-batches m | measured bubble (mean over ranks) | max rank "
              "| theory |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
