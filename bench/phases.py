"""Where a zeroshard step's time goes, per phase, at each stage (run under torchrun, 2 ranks).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 bench/phases.py --stages 0 1 2 3

Phases, per step, median over the timed steps, rank 0 (ms): forward; backward (autograd
compute plus the gradient hooks: copies into buckets, and waits when more than two staged
buckets are in flight); reduce wait (after backward: the buckets still in flight); norm + clip
(`prepare_step`: sum of squares, one all-reduce, unscale/clip); optimizer (`optimizer.step()`
on this rank's shard); after step (stages 1-2: the parameter all-gather; stage 3: refresh of
the persistent unit). The strategy's methods are wrapped with timers here, in the benchmark
only; the engine is unchanged.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from engines.common import RunSpec, build_model, ds_config

PHASES = ("forward", "backward", "reduce_wait", "norm_clip", "optimizer", "after_step")


def _timed(obj: Any, name: str, phase: str, acc: dict[str, float]) -> None:
    inner = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            acc[phase] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def run(stage: int, steps: int, warmup: int) -> dict[str, float]:
    import zeroshard

    spec = RunSpec()
    model = build_model(spec)
    engine, optimizer, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config(spec, stage, False))
    strategy = engine._strategy  # benchmark instrumentation only
    acc = dict.fromkeys(PHASES, 0.0)
    _timed(strategy, "after_backward", "reduce_wait", acc)
    _timed(strategy, "prepare_step", "norm_clip", acc)
    _timed(optimizer, "step", "optimizer", acc)
    _timed(strategy, "after_step", "after_step", acc)
    g = torch.Generator().manual_seed(engine.rank)
    rows: list[dict[str, float]] = []
    for i in range(warmup + steps):
        x = torch.randint(0, model.config.vocab_size, (spec.micro_batch, spec.seq_len), generator=g)
        for k in acc:
            acc[k] = 0.0
        t0 = time.perf_counter()
        loss = engine(x, x)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        row = dict(acc)
        row["forward"] = t1 - t0
        row["backward"] = (t2 - t1) - acc["reduce_wait"]
        row["total"] = t3 - t0
        if i >= warmup:
            rows.append(row)
    return {k: 1000 * statistics.median(r[k] for r in rows) for k in (*PHASES, "total")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", dest="zero_stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    results = {s: run(s, args.steps, args.warmup) for s in args.zero_stages}
    if torch.distributed.get_rank() == 0:
        print("| stage | " + " | ".join(PHASES) + " | total (ms) |")
        print("|---|" + "---:|" * (len(PHASES) + 1))
        for s, r in results.items():
            print(f"| {s} | " + " | ".join(f"{r[k]:.0f}" for k in PHASES) + f" | {r['total']:.0f} |")


if __name__ == "__main__":
    main()
