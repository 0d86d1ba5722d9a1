"""Launch-test worker for `zeroshard launch --max_restarts N --nnodes MIN:MAX` (issue 42).

    elastic_train.py [--local_rank=I] [--gas G] DIR STAGE [--deepspeed_config CFG]

Trains scripts/ckpt_auto_resume.py's tiny GPT (its model, data and ds_config, with G micro-batches per
step: default 1) to its STEPS with `checkpoint.auto_resume_dir` (CFG's, else DIR/ckpt), saving at steps
2 and 4. So every attempt that torchrun starts resumes by itself from the newest checkpoint, at
whatever world size it got (keeping the global batch of the checkpoint).

    ZS_DIE=1   in torchrun's first attempt (TORCHELASTIC_RESTART_COUNT 0) rank 1 SIGKILLs itself at
               the start of step 5, after the step-4 save
    ZS_HOLD=N  in the first attempt, at a world size above 1, every rank prints HOLD before step N and
               waits (60 s at most) for DIR/go: the test kills a node (or signals a rank) while they wait
    ZS_JOIN=N  at world size 1, the rank prints HOLD before step N and waits (120 s at most) for the
               SIGTERM with which torchrun's agent stops its workers when another node joins; it then
               trains step N, after which the preemption handler saves global_stepN and exits 75. A
               restart for a join keeps TORCHELASTIC_RESTART_COUNT, so the larger group is attempt 0 too.

Rank 0 writes the attempt's per-step losses to DIR/attempt<k>.pt (k = TORCHELASTIC_RESTART_COUNT) and
prints a STEP line after every step (`STEP world W step N loss L`, L as Python's repr: exact), and
PREEMPTED after the step an emergency checkpoint holds. Every rank prints START / HOLD / DONE lines;
the lines are stamped with time.time().
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from types import FrameType

import torch
from ckpt_auto_resume import STEPS, config, dataset

import zeroshard
from zeroshard.errors import PREEMPTED_EXIT_CODE
from zeroshard.examples.gpt import GPT, GPTConfig

DIE_AT = 5
TINY = GPTConfig.preset("tiny")  # engine_helpers.TINY, which ckpt_auto_resume's model uses


def _note_sigterm(received: list[float]) -> None:
    """Also note the time of a SIGTERM in `received`, then run the handler initialize() installed."""
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(time.time())
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, handler)


def _hold(out: Path, rank: int, world: int, step: int, received: list[float]) -> None:
    """Wait before `step`: for DIR/go at a world size above 1 (ZS_HOLD), for a SIGTERM at 1 (ZS_JOIN)."""
    hold = os.environ.get("ZS_HOLD") if world > 1 else os.environ.get("ZS_JOIN")
    if hold is None or int(hold) != step:
        return
    print(f"HOLD rank {rank} world {world} pid {os.getpid()} t={time.time():.3f}", flush=True)
    deadline = time.monotonic() + (60 if world > 1 else 120)
    while not (received if world == 1 else (out / "go").exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    if received:
        print(f"SIGTERM rank {rank} world {world} before step {step} t={received[0]:.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--deepspeed_config", default=None)
    p.add_argument("--gas", type=int, default=1)
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
                                                config=config(args.stage, args.gas, resume_dir))
    received: list[float] = []
    _note_sigterm(received)
    print(f"START rank {rank}/{world} attempt {attempt} step {engine.global_steps} "
          f"gas {engine.gradient_accumulation_steps()} t={time.time():.3f}", flush=True)
    first = attempt == 0
    losses, it = [], iter(loader)
    while engine.global_steps < STEPS:
        if first:
            _hold(args.out, rank, world, engine.global_steps + 1, received)
        if first and engine.global_steps + 1 == DIE_AT and os.environ.get("ZS_DIE") == "1" and rank == 1:
            print(f"DIE rank 1 step {DIE_AT} t={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        total = torch.zeros(1)
        try:
            for _ in range(engine.gradient_accumulation_steps()):
                x, y = next(it)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                total += loss.detach() / engine.gradient_accumulation_steps()
        except SystemExit as e:
            if e.code == PREEMPTED_EXIT_CODE and rank == 0:
                print(f"PREEMPTED world {world} after step {engine.global_steps} t={time.time():.3f}", flush=True)
            raise
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append((engine.global_steps, total.item() / world))
        if rank == 0:
            print(f"STEP world {world} step {engine.global_steps} loss {losses[-1][1]!r} t={time.time():.3f}",
                  flush=True)
        if engine.global_steps in (2, 4):
            engine.save_checkpoint(resume_dir)
    if rank == 0:
        torch.save(losses, args.out / f"attempt{attempt}.pt")
    print(f"DONE rank {rank}/{world} attempt {attempt} t={time.time():.3f}: {losses}", flush=True)


if __name__ == "__main__":
    main()
