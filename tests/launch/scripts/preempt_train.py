"""Launch-test worker: a job preempted by SIGTERM / SIGUSR1 saves, exits 75, and resumes (issue 42 item 4).

    preempt_train.py train DIR STAGE    2 ranks, checkpoint.auto_resume_dir=DIR/ckpt (so
                                        preemption_save acts); trains STEPS steps, printing
                                        "STEP n rank r pid p" after each, a little slowly so
                                        that the test's signal lands mid-run
    preempt_train.py resume DIR STAGE   2 ranks: first an uninterrupted reference run from the
                                        same seed (no checkpoint section), then the same config
                                        as `train`, which auto-resumes from the emergency
                                        checkpoint and trains to STEPS

    preempt_train.py slow DIR STAGE     1 rank, checkpoint.save_dir=DIR/ckpt saved every 2 steps,
                                        preemption_grace_seconds 2; after step 4 the rank makes its
                                        checkpoint writes take 60 s and sends itself SIGTERM

Per-step losses (the mean over ranks) go to DIR/resume.pt as {"reference": [...], "resumed": [...]}.
`zeroshard launch` passes `--local_rank=<i>` first; it is dropped.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))

from engine_helpers import TINY, make_config

import zeroshard
from zeroshard.checkpoint import save
from zeroshard.examples.gpt import GPT, GPTConfig

STEPS = 14
STEP_PAUSE_S = 0.15


def config(stage: int, checkpoint: dict[str, Any] | None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 300}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 100
    extra = {"checkpoint": checkpoint} if checkpoint is not None else {}
    return make_config(gradient_clipping=0.5, zero_optimization=zero, **extra)


def slow_writes() -> None:
    """Every checkpoint write from now on takes a minute (past any test's grace)."""
    write = save._write_rank_files

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(60.0)
        return write(*args, **kwargs)

    save._write_rank_files = slow


def dataset() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TINY.vocab_size, (64, TINY.block_size + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def train(stage: int, checkpoint: dict[str, Any] | None, pause_s: float,
          preempt_at: int | None = None) -> list[tuple[int, float]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY.__dict__))
    engine, _, loader, _ = zeroshard.initialize(model=model, training_data=dataset(), config=config(stage, checkpoint))
    rank, world = engine.rank, engine.world_size
    print(f"START rank {rank}/{world} step {engine.global_steps}", flush=True)
    losses, it = [], iter(loader)
    while engine.global_steps < STEPS:
        x, y = next(it)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()  # SystemExit(75) here after the emergency save, on a preempted run
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append((engine.global_steps, total.item() / world))
        print(f"STEP {engine.global_steps} rank {rank} pid {os.getpid()}", flush=True)
        if engine.global_steps == preempt_at:
            slow_writes()
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(pause_s)
    return losses


def main(mode: str, out: Path, stage: int) -> None:
    zeroshard.init_distributed()
    resume = {"auto_resume_dir": str(out / "ckpt")}
    if mode in ("train", "slow"):
        periodic = {"save_dir": str(out / "ckpt"), "save_interval_steps": 2, "preemption_grace_seconds": 2}
        train(stage, resume if mode == "train" else periodic, STEP_PAUSE_S, 4 if mode == "slow" else None)
        print(f"DONE {mode}: never preempted", flush=True)
        return
    reference = train(stage, None, 0.0)
    resumed = train(stage, resume, 0.0)
    if torch.distributed.get_rank() == 0:
        torch.save({"reference": reference, "resumed": resumed}, out / "resume.pt")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(args[0], Path(args[1]), int(args[2]))
