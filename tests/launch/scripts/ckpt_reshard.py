"""Launch-test worker: save at one world size, load at another (run under torchrun, or plain
python for world size 1).

    ckpt_reshard.py save DIR    stages 1 and 2: J steps, then save_checkpoint(DIR/s<stage>)
    ckpt_reshard.py check DIR   at this world size: an uninterrupted J + STEPS run per stage (the
                                reference), and each checkpoint loaded into stages 0, 1 and 2,
                                continued STEPS steps, compared step by step with the reference

The global batch (6 samples) is the same at every world size: micro-batch 1, 6 / world
micro-batches of accumulation, so runs at world 1, 2 and 3 are the same computation up to the
order of fp32 sums.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))

from engine_helpers import global_batches, init_engine, make_config, make_model, train_engine

import zeroshard

J, STEPS, GLOBAL_BATCH = 4, 10, 6
TOL = 1e-5
PAIRS = [(1, 1), (1, 0), (2, 2), (2, 1), (3, 3), (3, 1)]
"""(saved stage, loaded stage): same stage, and across stages."""


def config(stage: int, world: int) -> dict[str, Any]:
    return make_config(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=GLOBAL_BATCH // world,
                       zero_optimization={"stage": stage, "reduce_bucket_size": 200,
                                          **({"stage3_param_persistence_threshold": 100} if stage == 3 else {})})


def max_rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(got, want, strict=True))


def main(mode: str, out: Path) -> None:
    groups = zeroshard.init_distributed()
    rank, world = groups.rank, groups.world_size
    batches = global_batches(J + STEPS, GLOBAL_BATCH)
    if mode == "save":
        for saved in sorted({s for s, _ in PAIRS}):
            engine = init_engine(make_model(), config(saved, world))
            train_engine(engine, batches[:J], rank, world)
            engine.save_checkpoint(out / f"s{saved}")
        return
    # One reference: stages 0-3 agree step by step at a given world size (test_zero12, test_zero3).
    _, want = train_engine(init_engine(make_model(), config(2, world)), batches, rank, world)
    for saved, stage in PAIRS:
        engine = init_engine(make_model(seed=9), config(stage, world))
        engine.load_checkpoint(out / f"s{saved}", load_rng_state=True)
        if engine.global_steps != J:
            raise AssertionError(f"loaded global_steps {engine.global_steps}, expected {J}")
        _, got = train_engine(engine, batches[J:], rank, world)
        errors = [max_rel(got[s], want[J + s]) for s in range(STEPS)]
        if not max(errors) <= TOL:
            raise AssertionError(f"world {world}: saved stage {saved}, loaded stage {stage}: "
                                 f"relative errors per step {errors} > {TOL}")
        print(f"RESHARD OK world {world} rank {rank}: saved stage {saved} at world 2, loaded stage "
              f"{stage}: {STEPS} steps, max relative error {max(errors):.2e}", flush=True)

if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
