"""Worker for bench/two_node.py: stage-3 step time and loss of the "small" GPT, with or without
qgZ (`--qgz`). Rank 0 prints one `ZEROPP_STEP` line.

    sudo python bench/two_node.py --rate 100mbit -- bench/zeropp_step.py [--qgz] [--steps 8]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import zeroshard
from zeroshard.examples.gpt import GPT, GPTConfig


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--qgz", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig.preset("small")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "bf16": {"enabled": True},
              "steps_per_print": 10_000,
              "zero_optimization": {"stage": 3, "zero_quantized_gradients": args.qgz}}
    engine, *_ = zeroshard.initialize(model=GPT(cfg), config=config)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]  # one batch, memorised: the loss must fall
    times, loss = [], float("nan")
    for step in range(args.steps):
        start = time.perf_counter()
        out = engine(x, y)
        engine.backward(out)
        engine.step()
        loss = float(out.item())
        times.append(time.perf_counter() - start)
    if engine.rank == 0:
        steady = times[2:] or times
        print(f"ZEROPP_STEP qgz={args.qgz} steps={args.steps} mean_step_s={sum(steady) / len(steady):.3f} "
              f"final_loss={loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
