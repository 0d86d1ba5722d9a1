"""FP8 (`fp8` section) against bf16: steady step time, tokens/s and the loss gap, one process.

    OMP_NUM_THREADS=1 python bench/fp8_step.py [--preset small] [--micro 8] [--steps 12] [--stage 0]

Three engines from the same seed (bf16; bf16 + fp8 tensorwise; bf16 + fp8 rowwise) train on the
same batches in lockstep, one step each in turn, so all see the same machine load. Steady step time
is the median of the steps after the second. On the CPU `torch._scaled_mm` dequantises and runs an
fp32 GEMM, so FP8 is slower there; the number that matters (issue 43: 1.25x bf16's tokens/s) needs a
GPU with float8 tensor cores, where the same script runs unchanged on `cuda`. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import zeroshard
from zeroshard.examples.gpt import GPT, GPTConfig
from zeroshard.runtime.fp8 import fp8_layers

RUNS: dict[str, dict[str, Any] | None] = {
    "bf16": None,
    "fp8 tensorwise": {"enabled": True, "recipe": "tensorwise"},
    "fp8 rowwise": {"enabled": True, "recipe": "rowwise"},
}


def _engine(preset: str, stage: int, micro: int, fp8: dict[str, Any] | None) -> Any:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset))
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}}
    if fp8 is not None:
        config["fp8"] = fp8
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _step(engine: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--stage", dest="zero_stage", type=int, default=0)
    args = p.parse_args()
    cfg = GPTConfig.preset(args.preset)
    engines = {name: _engine(args.preset, args.zero_stage, args.micro, fp8) for name, fp8 in RUNS.items()}
    device = next(engines["bf16"].module.parameters()).device
    g = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {name: [] for name in RUNS}
    losses: dict[str, list[float]] = {name: [] for name in RUNS}
    for _ in range(args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.micro, cfg.block_size + 1), generator=g).to(device)
        for name, engine in engines.items():
            dt, loss = _step(engine, tokens[:, :-1], tokens[:, 1:])
            times[name].append(dt)
            losses[name].append(loss)
    tokens_per_step = args.micro * cfg.block_size
    base = statistics.median(times["bf16"][2:])
    print(f"GPT {args.preset}, micro-batch {args.micro} x {cfg.block_size} tokens, ZeRO {args.zero_stage}, {device}, "
          f"{args.steps} steps")
    print("| run | float8 layers | steady step s | tokens/s | vs bf16 | largest loss gap |")
    print("|---|---|---|---|---|---|")
    for name, engine in engines.items():
        t = statistics.median(times[name][2:])
        gap = max(abs(a - b) / b for a, b in zip(losses[name], losses["bf16"], strict=True))
        print(f"| {name} | {len(fp8_layers(engine.module))} | {t:.4f} | {tokens_per_step / t:,.0f} | "
              f"{base / t:.2f}x | {gap:.4f} |")


if __name__ == "__main__":
    main()
