"""Launch-test worker: SIGKILL one rank of a 2-rank job inside save_checkpoint (torchrun).

    ckpt_kill_rank.py save DIR K RANK   2 steps, save global_step2, step 3, save again with
                                        rank RANK killing itself at its K-th file event
    ckpt_kill_rank.py resume DIR        fresh processes: latest must be global_step2 with its
                                        weights, and one step must reproduce step 3
    ckpt_kill_rank.py save DIR K RANK async
                                        the same with checkpoint.async_save: the kill lands in
                                        rank RANK's writer thread while step 4 trains, before
                                        the join (wait_for_checkpoint) that would publish
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))

from engine_helpers import global_batches, init_engine, make_config, make_model, train_engine

import zeroshard
from zeroshard.checkpoint.files import FAULT_ENV

CONFIG = make_config(zero_optimization={"stage": 1, "reduce_bucket_size": 300})
ASYNC_CONFIG = make_config(zero_optimization={"stage": 1, "reduce_bucket_size": 300}, checkpoint={"async_save": True})


def main(mode: str, out: Path, args: list[str]) -> None:
    rank = zeroshard.init_distributed().rank
    batches = global_batches(4, 4)
    if mode == "save":
        is_async = args[2:] == ["async"]
        engine = init_engine(make_model(), ASYNC_CONFIG if is_async else CONFIG)
        train_engine(engine, batches[:2], rank, 2)
        engine.save_checkpoint(out)
        _, step3 = train_engine(engine, batches[2:3], rank, 2)
        torch.save(step3[0], out / f"step3-{rank}.pt")
        os.environ[FAULT_ENV] = f"{args[0]}:{args[1]}"
        engine.save_checkpoint(out)
        if is_async:
            train_engine(engine, batches[3:], rank, 2)
            engine.wait_for_checkpoint()
        print("SAVE COMPLETED (the kill did not happen)", flush=True)
        return
    engine = init_engine(make_model(seed=5), CONFIG)
    path, _ = engine.load_checkpoint(out, load_rng_state=True)
    if Path(str(path)).name != "global_step2" or engine.global_steps != 2:
        raise AssertionError(f"loaded {path} at step {engine.global_steps}")
    _, got = train_engine(engine, batches[2:3], rank, 2)
    want = torch.load(out / f"step3-{rank}.pt", weights_only=True)
    if not all(torch.equal(a, b) for a, b in zip(got[0], want, strict=True)):
        raise AssertionError("resuming from global_step2 does not reproduce step 3")
    print(f"KILL RESUME OK rank {rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
