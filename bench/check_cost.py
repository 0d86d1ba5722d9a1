"""What the collective signature check costs a training step, measured paired in one process.

    python bench/check_cost.py                  # stages 1-3, 2 gloo ranks, the 25M GPT, fp32
    python bench/check_cost.py --stages 3 --rounds 20 --steps 3

bench/run.py compares engines in separate processes; on a busy 2-core host a run's own
variance (DDP's rounds differ by 20-35%) hides a cost of a few percent. Here one engine per
stage trains the same model, and every round times `--steps` steps with the check on and
`--steps` with it off, in alternating order (on/off, then off/on), the switch made on every
rank at the same step boundary. The cost is the median over rounds of (on / off - 1), with
the 25th-75th percentile range; a negative value is noise. `ZEROSHARD_COMM_CHECK_BOARD=0`
measures the side gloo group instead of the shared-memory board (Note: [signature board]).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))


def _set_check(on: bool) -> None:
    """Every Comm of this process checks (on) or not; the same switch on every rank."""
    from zeroshard.comm import Comm

    for comm in (o for o in gc.get_objects() if isinstance(o, Comm)):
        if comm._tracker is not None and comm.groups.device.type == "cpu":
            comm._verify = on


def _measure(stage: int, args: argparse.Namespace) -> dict:
    from engines.common import Batches, RunSpec
    from engines.zeroshard_engine import build

    spec = RunSpec()
    stepper = build(spec, stage)
    engine = stepper.engine
    batches, count = Batches(spec, engine.rank, engine.world_size), [0]

    def steps(n: int) -> None:
        for _ in range(n):
            count[0] += 1
            stepper.step(*batches(count[0]))

    def timed(on: bool) -> float:
        _set_check(on)
        engine.comm.barrier()
        t0 = time.perf_counter()
        steps(args.steps)
        engine.comm.barrier()
        return (time.perf_counter() - t0) / args.steps

    steps(args.warmup)
    ratios, on_s, off_s = [], [], []
    for r in range(args.rounds):
        first = r % 2 == 0
        a = timed(first)
        b = timed(not first)
        on, off = (a, b) if first else (b, a)
        on_s.append(on)
        off_s.append(off)
        ratios.append(on / off - 1.0)
    _set_check(True)
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {"cost_median": statistics.median(ratios), "cost_q1": q[0], "cost_q3": q[2],
            "step_on_s": statistics.median(on_s), "step_off_s": statistics.median(off_s),
            "rounds": args.rounds, "steps": args.steps, "world": engine.world_size}


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    out = {}
    for stage in args.stages:
        out[stage] = _measure(stage, args)
        gc.collect()
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(out), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=2, help="steps per half-round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(Path(__file__).resolve()), "--worker", "--stages", *map(str, args.stages), "--rounds",
           str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        return 1
    result = json.loads(lines[-1][len("RESULT "):])
    route = "side group" if os.environ.get("ZEROSHARD_COMM_CHECK_BOARD") == "0" else "board"
    print(f"collective check cost per step ({route}), {args.nproc} gloo ranks, 25M GPT fp32, "
          f"{args.rounds} paired rounds of {args.steps}+{args.steps} steps:")
    print("| stage | step, check on (s) | step, check off (s) | cost: median (25th-75th pct) |")
    print("|---|---|---|---|")
    for stage, r in result.items():
        print(f"| {stage} | {r['step_on_s']:.3f} | {r['step_off_s']:.3f} | {100 * r['cost_median']:+.1f}% "
              f"({100 * r['cost_q1']:+.1f}% to {100 * r['cost_q3']:+.1f}%) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
