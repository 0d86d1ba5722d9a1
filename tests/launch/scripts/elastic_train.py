"""Launch-test worker for `zeroshard launch --max_restarts N --nnodes MIN:MAX` (issue 42).

    elastic_train.py [--local_rank=I] DIR STAGE [--deepspeed_config CFG]

Trains scripts/ckpt_auto_resume.py's tiny GPT (its model, data and ds_config) to its STEPS with
`checkpoint.auto_resume_dir` (CFG's, else DIR/ckpt), saving at steps 2 and 4. So every attempt that
torchrun starts resumes by itself from the newest checkpoint, at whatever world size it got.

    ZS_DIE=1   in torchrun's first attempt (TORCHELASTIC_RESTART_COUNT 0) rank 1 SIGKILLs itself at
               the start of step 5, after the step-4 save
    ZS_HOLD=1  in the first attempt, at a world size above 1, every rank prints HOLD before step 5 and
               waits (60 s at most) for DIR/go: the test kills a node while they wait

Rank 0 writes the attempt's per-step losses to DIR/attempt<k>.pt (k = TORCHELASTIC_RESTART_COUNT);
every rank prints START / HOLD / DONE lines stamped with time.time().
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from ckpt_auto_resume import STEPS, config, dataset

import zeroshard
from zeroshard.examples.gpt import GPT, GPTConfig

DIE_AT = 5
TINY = GPTConfig.preset("tiny")  # engine_helpers.TINY, which ckpt_auto_resume's model uses


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--deepspeed_config", default=None)
    p.add_argument("out", type=Path)
    p.add_argument("stage", type=int)
    args = p.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    resume_dir = args.out / "ckpt"
    if args.deepspeed_config:
        resume_dir = Path(json.loads(Path(args.deepspeed_config).read_text())["checkpoint"]["auto_resume_dir"])
    groups = zeroshard.init_distributed()
    rank, world = groups.rank, groups.world_size
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY.__dict__))
    engine, _, loader, _ = zeroshard.initialize(model=model, training_data=dataset(),
                                                config=config(args.stage, 1, resume_dir))
    print(f"START rank {rank}/{world} attempt {attempt} step {engine.global_steps} "
          f"gas {engine.gradient_accumulation_steps()} t={time.time():.3f}", flush=True)
    first = attempt == 0
    losses, it = [], iter(loader)
    while engine.global_steps < STEPS:
        if first and engine.global_steps + 1 == DIE_AT:
            if os.environ.get("ZS_HOLD") == "1" and world > 1:
                print(f"HOLD rank {rank} world {world} pid {os.getpid()} t={time.time():.3f}", flush=True)
                deadline = time.monotonic() + 60
                while not (args.out / "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            if os.environ.get("ZS_DIE") == "1" and rank == 1:
                print(f"DIE rank 1 step {DIE_AT} t={time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        total = torch.zeros(1)
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(it)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / engine.gradient_accumulation_steps()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append((engine.global_steps, total.item() / world))
        if engine.global_steps in (2, 4):
            engine.save_checkpoint(resume_dir)
    if rank == 0:
        torch.save(losses, args.out / f"attempt{attempt}.pt")
    print(f"DONE rank {rank}/{world} attempt {attempt} t={time.time():.3f}: {losses}", flush=True)


if __name__ == "__main__":
    main()
