"""Launch-test worker: a job killed after a save resumes by itself at another world size (issue 42).

    ckpt_auto_resume.py train DIR       2 ranks, checkpoint.auto_resume_dir=DIR/ckpt; saves at steps 2
                                        and 4; rank 1 SIGKILLs itself during step 5. Also records the
                                        uninterrupted losses in DIR/uninterrupted.pt when ZS_NO_KILL=1.
    ckpt_auto_resume.py resume DIR      1 rank, the same config (gradient_accumulation_steps 1): auto-
                                        resume keeps the global batch (accumulation 1 -> 2), trains to STEPS
    ckpt_auto_resume.py reference DIR   1 rank, gradient_accumulation_steps 2, load_checkpoint(tag=
                                        "global_step4", load_rng_state=True): the uninterrupted world-1 run
                                        from the same state
    ckpt_auto_resume.py reference DIR STAGE TAG GAS   the same from DIR/ckpt/TAG with GAS micro-batches
                                        per step, at the world size torchrun gives (elastic tests)

Per-step losses (the mean of the step's micro-batch losses over every rank) go to DIR/<mode>.pt.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))

from engine_helpers import TINY, make_config

import zeroshard
from zeroshard.examples.gpt import GPT, GPTConfig

STEPS, KILL_AT = 8, 5


def config(stage: int, gas: int, resume_dir: Path | None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 300}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 100
    extra = {"checkpoint": {"auto_resume_dir": str(resume_dir)}} if resume_dir is not None else {}
    return make_config(gradient_accumulation_steps=gas, gradient_clipping=0.5, zero_optimization=zero, **extra)


def dataset() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TINY.vocab_size, (48, TINY.block_size + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main(mode: str, out: Path, stage: int, tag: str = "global_step4", reference_gas: int = 2) -> None:
    groups = zeroshard.init_distributed()
    rank, world = groups.rank, groups.world_size
    ckpt = out / "ckpt"
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY.__dict__))  # no dropout: the world-2 run's per-rank masks do not exist at world 1
    cfg = config(stage, reference_gas if mode == "reference" else 1, None if mode == "reference" else ckpt)
    engine, _, loader, _ = zeroshard.initialize(model=model, training_data=dataset(), config=cfg)
    if mode == "reference":
        engine.load_checkpoint(ckpt, tag=tag, load_rng_state=True)
    print(f"START {mode} rank {rank}/{world} step {engine.global_steps} "
          f"gas {engine.gradient_accumulation_steps()}", flush=True)
    kill = mode == "train" and os.environ.get("ZS_NO_KILL") != "1"
    losses, it = [], iter(loader)
    while engine.global_steps < STEPS:
        total = torch.zeros(1)
        for _ in range(engine.gradient_accumulation_steps()):
            if kill and rank == 1 and engine.global_steps + 1 == KILL_AT:
                os.kill(os.getpid(), signal.SIGKILL)  # a node lost mid-step, after the step-4 save
            x, y = next(it)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / engine.gradient_accumulation_steps()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append((engine.global_steps, total.item() / world))
        if mode == "train" and engine.global_steps in (2, 4):
            engine.save_checkpoint(ckpt)
    name = "uninterrupted" if mode == "train" else mode
    if rank == 0:
        torch.save(losses, out / f"{name}.pt")
    print(f"DONE {mode} rank {rank}: {losses}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5], *map(int, sys.argv[5:6]))
