"""`engine.compile()` against eager at ZeRO stages 0-3, world size 1: first-step time (tracing and
compiling), steady step time, graphs and graph breaks, and the largest loss difference.

    OMP_NUM_THREADS=1 python bench/compile_step.py [--steps 12] [--preset small] [--micro 8]

Each stage runs in a fresh process with an empty inductor cache (TORCHINDUCTOR_CACHE_DIR), so its
first compiled step pays the whole compile (a warm cache makes a second run's first step a few
seconds). Two engines from the same seed train on the same batches in lockstep, one eager step then
one compiled step, so both see the same machine load. Steady step time is the median of the steps
after the second. One thread: on a shared 2-core box, two OpenMP threads spin against other jobs
and the step times swing 2-4x. Prints a Markdown table (the one in bench/README.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

import zeroshard
from zeroshard.examples.gpt import GPT, GPTConfig


def _engine(preset: str, stage: int, micro: int) -> Any:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset))
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every unit behind its gather/release hooks
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": zero}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _step(engine: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    start = time.perf_counter()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - start, loss.item()


def run_stage(stage: int, args: argparse.Namespace) -> str:
    """One stage, in this process: the table's row."""
    shape = GPTConfig.preset(args.preset)
    g = torch.Generator().manual_seed(1)
    eager, compiled = _engine(args.preset, stage, args.micro), _engine(args.preset, stage, args.micro)
    compiled.compile()
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    dev = 0.0
    for _ in range(args.steps):
        tokens = torch.randint(0, shape.vocab_size, (args.micro, shape.block_size + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        t_e, loss_e = _step(eager, x, y)
        t_c, loss_c = _step(compiled, x, y)
        times["eager"].append(t_e)
        times["compiled"].append(t_c)
        dev = max(dev, abs(loss_c - loss_e) / abs(loss_e))
    stats = compiled.compile_stats
    e, c = times["eager"], times["compiled"]
    steady_e, steady_c = statistics.median(e[2:]), statistics.median(c[2:])
    return (f"| {stage} | {e[0]:.2f} | {c[0]:.1f} | {steady_e * 1e3:.0f} | {steady_c * 1e3:.0f} "
            f"| {steady_e / steady_c:.2f}x | {stats.graphs} | {stats.graph_breaks} | {dev:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--preset", default="small", help="GPTConfig preset (small: ~0.8M parameters)")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--stage", type=int, default=None, help="run one stage here (the parent runs 0-3)")
    args = parser.parse_args()
    if args.stage is not None:
        print(run_stage(args.stage, args), flush=True)
        return
    rows = []
    for stage in range(4):
        with tempfile.TemporaryDirectory(prefix="zeroshard-compile-bench-") as cache:
            out = subprocess.run([sys.executable, __file__, "--stage", str(stage), "--steps", str(args.steps),
                                  "--preset", args.preset, "--micro", str(args.micro)], check=True, text=True,
                                 capture_output=True, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
        rows.append(next(line for line in out.stdout.splitlines() if line.startswith("| ")))
        print(rows[-1], flush=True)
    shape = GPTConfig.preset(args.preset)
    print(f"\nGPT preset {args.preset!r}, micro-batch {args.micro} x {shape.block_size} tokens, fp32, world size 1, "
          f"{args.steps} steps, torch {torch.__version__}, backend inductor, {torch.get_num_threads()} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| stage | eager first step (s) | compiled first step (s) | eager step (ms) | compiled step (ms) "
          "| speed-up | graphs | graph breaks | max loss rel. diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
