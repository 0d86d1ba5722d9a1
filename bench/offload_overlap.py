"""CPU optimizer offload: synchronous against the one-step delayed update, and against no offload.

    OMP_NUM_THREADS=1 python bench/offload_overlap.py [--passes 8] [--steps 8] [--stage 2]
    python bench/offload_overlap.py --row      # one Markdown row (bench/gpu/device_check.sh)

Three engines from one seed, world size 1, on the default device (the GPU when there is one):
ZeRO `--stage` without offload, with `offload_optimizer.device` "cpu", and the same with
`offload_optimizer.delayed_update` (warm-up 1 step). Each pass times `--steps` consecutive
optimizer steps of one engine, ending with `strategy.settle_step()` so the delayed engine's last
background step is inside its pass; the modes alternate (none, sync, delayed, delayed, sync,
none, ...) so a burst of load hits each alike, and each mode's figure is its median pass. Prints
steps/s per mode and the ratios delayed / sync and delayed / none, all from the same run, and the
median time of the `engine.step()` call itself (the delayed one returns once the update started).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch

import zeroshard
from zeroshard.examples.gpt import GPT, GPTConfig

MODES = ("none", "sync", "delayed")


def _engine(mode: str, args: argparse.Namespace) -> Any:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.width,
                          vocab_size=args.vocab))
    zero: dict[str, Any] = {"stage": args.zero_stage}
    if mode != "none":
        zero["offload_optimizer"] = {"device": "cpu"}
    if mode == "delayed":
        zero["offload_optimizer"].update(delayed_update=True, delayed_update_warmup_steps=1)
    config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": zero}
    if torch.cuda.is_available():
        config["bf16"] = {"enabled": True}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _sync(engine: Any) -> None:
    engine.strategy.settle_step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _pass(engine: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], step_calls: list[float]) -> float:
    """Seconds per optimizer step over the pass; appends each `engine.step()` call's own time."""
    _sync(engine)
    start = time.perf_counter()
    for x, y in batches:
        engine.backward(engine(x.to(engine.device), y.to(engine.device)))
        t0 = time.perf_counter()
        engine.step()
        step_calls.append(time.perf_counter() - t0)
    _sync(engine)
    return (time.perf_counter() - start) / len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per pass")
    parser.add_argument("--stage", dest="zero_stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--row", action="store_true", help="print one Markdown row only")
    args = parser.parse_args()
    engines = {m: _engine(m, args) for m in MODES}
    params = sum(p.numel() for p in engines["none"].module.parameters())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.steps, args.micro, args.block + 1), generator=g)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    for m in MODES:  # warm-up: allocations, the optimizer state, the delayed engine's warm-up step
        _pass(engines[m], batches[:2], [])
    times: dict[str, list[float]] = {m: [] for m in MODES}
    calls: dict[str, list[float]] = {m: [] for m in MODES}
    order = list(MODES)
    for p in range(args.passes):
        for m in (order if p % 2 == 0 else order[::-1]):
            times[m].append(_pass(engines[m], batches, calls[m]))
    step = {m: statistics.median(t) for m, t in times.items()}
    rate = {m: 1.0 / s for m, s in step.items()}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'})"
    row = (f"| offload, ZeRO {args.zero_stage}, {params / 1e6:.1f}M params | {device} | {rate['none']:.2f} | "
           f"{rate['sync']:.2f} | {rate['delayed']:.2f} | {rate['delayed'] / rate['sync']:.2f} | "
           f"{rate['sync'] / rate['none']:.2f} | {rate['delayed'] / rate['none']:.2f} |")
    if args.row:
        print(row)
        return
    print(f"model {args.layers} x {args.width}, {params / 1e6:.2f}M params, micro-batch {args.micro} x {args.block}, "
          f"ZeRO {args.zero_stage}, {args.passes} passes of {args.steps} steps, torch {torch.__version__}")
    for m in MODES:
        print(f"{m:8s} ms/step per pass: " + " ".join(f"{1e3 * t:.0f}" for t in times[m])
              + f"; engine.step() call, median {1e3 * statistics.median(calls[m]):.1f} ms")
    print("| case | device | none (steps/s) | sync offload (steps/s) | delayed (steps/s) | delayed / sync | "
          "sync / none | delayed / none |")
    print("|---|---|---|---|---|---|---|---|")
    print(row)


if __name__ == "__main__":
    main()
