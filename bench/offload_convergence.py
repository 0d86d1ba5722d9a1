"""What the one-step delayed update and ZenFlow do to convergence: training loss of synchronous CPU
offload against `offload_optimizer.delayed_update` (warm-up 40 and 0), or with `--zenflow` against
`zero_optimization.zenflow` (no clipping in that set: ZenFlow refuses it), same seed, same batches.

    OMP_NUM_THREADS=1 python bench/offload_convergence.py [--steps 300] [--lr 3e-3] [--zenflow]

The GPT preset `small` (4 blocks, 0.8M parameters) on the shipped byte corpus, micro-batch 8 x
128 tokens, AdamW, gradient clipping 1.0, ZeRO 2, fp32, world size 1. Prints a Markdown table of
the mean training loss over windows of steps (the one in docs/offload.md).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import zeroshard
from zeroshard.examples.gpt import GPT, CharDataset, GPTConfig, load_corpus

RUNS: dict[str, dict[str, Any]] = {
    "sync": {},
    "delayed, warm-up 40": {"delayed_update": True, "delayed_update_warmup_steps": 40},
    "delayed, warm-up 0": {"delayed_update": True, "delayed_update_warmup_steps": 0},
}
ZENFLOW_RUNS: dict[str, dict[str, Any]] = {  # zero_optimization.zenflow sections; {}: synchronous offload
    "sync, no clipping": {},
    "zenflow top 10%, update 4": {"topk_ratio": 0.1, "select_strategy": "step", "select_interval": 20,
                                  "update_interval": 4},
    "zenflow top 5%, update 4": {"topk_ratio": 0.05, "select_strategy": "step", "select_interval": 20,
                                 "update_interval": 4},
}


def _losses(extra: dict[str, Any], args: argparse.Namespace, data: CharDataset) -> list[float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("small"))
    zero: dict[str, Any] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    if args.zenflow and extra:
        zero["zenflow"] = extra
    elif not args.zenflow:
        zero["offload_optimizer"].update(extra)
    config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0 if args.zenflow else 1.0, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
              "zero_optimization": zero}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(args.steps):
        idx = torch.randint(0, len(data), (args.micro,), generator=g)
        x, y = (torch.stack(t) for t in zip(*(data[int(i)] for i in idx)))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--zenflow", action="store_true", help="ZenFlow's rows instead of the delayed update's")
    args = parser.parse_args()
    data = CharDataset(load_corpus(), GPTConfig.preset("small").block_size)
    runs = ZENFLOW_RUNS if args.zenflow else RUNS
    curves = {name: _losses(extra, args, data) for name, extra in runs.items()}
    windows = range(0, args.steps, args.window)
    print(f"GPT small, micro-batch {args.micro}, lr {args.lr}, {args.steps} steps; mean loss per window")
    print("| steps | " + " | ".join(runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for w in windows:
        cells = [f"{sum(c[w:w + args.window]) / len(c[w:w + args.window]):.4f}" for c in curves.values()]
        print(f"| {w + 1}-{min(w + args.window, args.steps)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
