"""Worker for bench/two_node.py (or torchrun): 1-bit Adam or 0/1 Adam against plain Adam, 1-bit Lamb
against plain Lamb, at stage 0 on the
"small" GPT, fp32. Rank 0 prints one `ONEBIT_STEP` line: mean step time and bytes this rank
sends per step (comm log, ring-equivalent wire bytes) during the warm-up and after it, and the
loss after the last step.

    sudo python bench/two_node.py --rate 100mbit -- bench/onebit_step.py --optimizer onebit
    python -m torch.distributed.run --nproc-per-node 2 bench/onebit_step.py --optimizer adam
    python -m torch.distributed.run --nproc-per-node 2 bench/onebit_step.py --optimizer zoadam
    sudo python bench/two_node.py --rate 30mbit -- bench/onebit_step.py --optimizer onebitlamb

For zoadam, `--freeze-step` is `var_freeze_step`; "warm-up" means the variance phase (full and
1-bit steps mixed per the variance schedule) and "after" the local-step phase.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import zeroshard
from zeroshard.examples.gpt import GPT, GPTConfig

WIRE = {"all_reduce": lambda w: 2 * (w - 1) / w, "all_gather": lambda w: (w - 1) / w,
        "all_to_all": lambda w: (w - 1) / w}
"""Bytes one rank sends per logged byte: a ring all-reduce 2(w-1)/w of its buffer, an
all-gather (w-1)/w of its output, an all-to-all (w-1)/w of its input."""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=("adam", "onebit", "zoadam", "lamb", "onebitlamb"), default="onebit")
    parser.add_argument("--var-update-scaler", type=int, default=2, help="zoadam only")
    parser.add_argument("--local-step-scaler", type=int, default=2, help="zoadam only")
    parser.add_argument("--local-step-clipper", type=int, default=4, help="zoadam only")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--freeze-step", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig.preset("small")
    params = {"lr": args.lr}
    if args.optimizer in ("onebit", "onebitlamb"):
        params["freeze_step"] = args.freeze_step
    if args.optimizer == "zoadam":
        params.update(var_freeze_step=args.freeze_step, var_update_scaler=args.var_update_scaler,
                      local_step_scaler=args.local_step_scaler, local_step_clipper=args.local_step_clipper)
    type_name = {"adam": "Adam", "onebit": "OneBitAdam", "zoadam": "ZeroOneAdam", "lamb": "Lamb",
                 "onebitlamb": "OneBitLamb"}[args.optimizer]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": type_name, "params": params},
              "steps_per_print": 10_000, "comms_logger": {"enabled": True},
              "zero_optimization": {"stage": 0}}
    engine, *_ = zeroshard.initialize(model=GPT(cfg), config=config)
    world = engine.world_size
    log = engine._comm.log
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2 * world, cfg.block_size + 1), generator=g)
    mine = tokens[2 * engine.rank : 2 * engine.rank + 2]
    x, y = mine[:, :-1], mine[:, 1:]  # one batch, memorised: the loss must fall
    rows = []
    for _ in range(args.steps):
        log.reset()
        start = time.perf_counter()
        out = engine(x, y)
        engine.backward(out)
        engine.step()
        loss = torch.tensor([float(out.item())])
        seconds = time.perf_counter() - start
        wire = sum(r.bytes * WIRE[r.op](world) for r in log.records if r.op in WIRE)
        rows.append((seconds, wire))
        engine._comm.all_reduce(loss, "avg")  # outside the timed step and its bytes
    k = args.freeze_step
    warm, after = rows[1:k], rows[k + 1 :]  # step 1 pays the first-touch allocations
    if engine.rank == 0:
        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs) if xs else float("nan")

        print(f"ONEBIT_STEP optimizer={args.optimizer} world={world} steps={args.steps} freeze={k} "
              f"warm_step_s={mean([s for s, _ in warm]):.3f} after_step_s={mean([s for s, _ in after]):.3f} "
              f"warm_wire_B={mean([b for _, b in warm]):.0f} after_wire_B={mean([b for _, b in after]):.0f} "
              f"final_loss={float(loss):.4f} params={sum(p.numel() for p in engine.module.parameters())}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
