"""One torchrun job (4 ranks): AutoTP (`tensor_parallel.autotp_size` 2) on a 2-stage PipelineModule under
DeepSpeed 0.19 (`--engine ds`) or zeroshard (`zs`), the same script on both sides.

Rank 0 writes OUT (JSON): {"losses": [...]} when `train_batch` ran, else {"error": "<type>: <message>",
"phase": "initialize" | "train_batch"}.
DeepSpeed's AutoTP rebuilds its groups as a (dp, tp) mesh over the whole world and ignores the
pipeline axis, so its initialize fails (issue 27); zeroshard trains PP 2 x TP 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "dist"))
from tiny_layers import Block, Embed, Head

VOCAB, DIM, SEQ, MICRO, GAS, STEPS = 16, 8, 6, 2, 2, 3
PHASE = ["start"]  # where the job was when it failed: "initialize" or "train_batch"


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def seed_fn(seed: Any) -> None:
    torch.manual_seed(int(seed))


def run(engine: str, world: int, rank: int) -> list[float]:
    if engine == "ds":
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule
        init = deepspeed.initialize
    else:
        import zeroshard
        from zeroshard.pipe import LayerSpec, PipelineModule
        init = zeroshard.initialize
    layers = [LayerSpec(Embed, VOCAB, DIM), *[LayerSpec(Block, DIM) for _ in range(4)], LayerSpec(Head, DIM, VOCAB)]
    net = PipelineModule(layers, num_stages=2, loss_fn=loss_fn, seed_layers=True, seed_fn=seed_fn, base_seed=1234,
                         partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},  # no JIT-built op
           "zero_optimization": {"stage": 1},
           "tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [
               {"patterns": [r".*\.fc\.weight$"], "partition_type": "column"},
               {"patterns": [r".*\.proj\.weight$"], "partition_type": "row"}]}}}
    PHASE[0] = "initialize"
    eng, *_ = init(model=net, model_parameters=[p for p in net.parameters()], config=cfg)
    PHASE[0] = "train_batch"
    dp = world // 4
    dp_rank = (rank // 2) % dp
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (dp, GAS, MICRO, SEQ + 1), generator=g)
        losses.append(float(eng.train_batch(iter([(tokens[dp_rank, m, :, :-1], tokens[dp_rank, m, :, 1:])
                                                  for m in range(GAS)]))))
    return losses


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["ds", "zs"], required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.engine == "ds":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        from zeroshard.comm import init_distributed

        init_distributed(timeout_s=120)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        result: dict[str, Any] = {"losses": run(args.engine, world, rank)}
    except Exception as e:  # the outcome under test: recorded, not raised
        result = {"error": f"{type(e).__name__}: {e}"[:2000], "phase": PHASE[0]}
        print(f"rank {rank}: {result['error']}", file=sys.stderr, flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
