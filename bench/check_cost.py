"""What the collective signature check costs a training step, measured paired in one process.

    python bench/check_cost.py                  # stages 1-3, 2 gloo ranks, the 25M GPT, fp32
    python bench/check_cost.py --stages 3 --rounds 20 --steps 3
    python bench/check_cost.py --instrumented   # the check's own time, counted inside the board

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
from typing import Any

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


def _gathered(t: Any, world: int) -> list[Any]:
    import torch.distributed as dist

    out = [t.clone() for _ in range(world)]
    dist.all_gather(out, t)
    return out


def _instrumented(stage: int, args: argparse.Namespace) -> dict:
    """The check's own time on the critical path, counted inside the board (no on/off pairing).

    Every check c is a `_Check` made and submitted to the board on every rank. Without the
    check, collective c could start once the last rank reached it (made the check); with it,
    it starts once every rank has decided the check (then each rank issues its data). So its
    extra latency is the latest decision minus the latest entry over the ranks, on the host's
    one monotonic clock: the last rank's own work plus an earlier rank's wake-up from its wait.
    The cost per step is the sum of that over the step's checks, plus the poller thread's CPU
    time (it decides the asynchronous collectives' checks not decided at once; on a 2-core
    machine its CPU is the ranks')."""
    import threading

    import torch
    import torch.distributed as dist
    from engines.common import Batches, RunSpec
    from engines.zeroshard_engine import build

    from zeroshard.comm.board import Board
    from zeroshard.comm.checked import _Check

    spec = RunSpec()
    stepper = build(spec, stage)
    engine = stepper.engine
    batches, count = Batches(spec, engine.rank, engine.world_size), [0]
    poller_cpu, poller_checks = [0.0], [0]
    real_submit, real_wait, real_conclude, real_init = Board.submit, Board._wait, _Check.conclude, _Check.__init__
    entered: list[float] = []  # time.monotonic(): one clock for every process of the host
    decided: list[float] = []

    def timed_init(self: _Check, *a: object, **kw: object) -> None:
        entered.append(time.monotonic())  # before the signature is folded: the whole check
        real_init(self, *a, **kw)

    def timed_submit(self: Board, *a: object, **kw: object) -> None:
        n = len(decided)
        try:
            return real_submit(self, *a, **kw)
        finally:
            if len(decided) == n:  # handed to the poller: decided (for this thread) on return
                decided.append(time.monotonic())

    def timed_conclude(self: _Check, verdict: object) -> None:
        if threading.current_thread() is threading.main_thread():
            decided.append(time.monotonic())  # what follows issues the data collective itself
        return real_conclude(self, verdict)

    def timed_wait(self: Board, *a: object, **kw: object) -> object:
        if threading.current_thread() is threading.main_thread():
            return real_wait(self, *a, **kw)
        t0 = time.thread_time()
        try:
            return real_wait(self, *a, **kw)
        finally:
            poller_cpu[0] += time.thread_time() - t0
            poller_checks[0] += 1

    def steps(n: int) -> None:
        for _ in range(n):
            count[0] += 1
            stepper.step(*batches(count[0]))

    steps(args.warmup)
    engine.comm.barrier()
    Board.submit, Board._wait = timed_submit, timed_wait  # type: ignore[method-assign]
    _Check.conclude, _Check.__init__ = timed_conclude, timed_init  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        n = args.rounds * args.steps
        steps(n)
        engine.comm.barrier()
        wall = (time.perf_counter() - t0) / n
    finally:
        Board.submit, Board._wait = real_submit, real_wait  # type: ignore[method-assign]
        _Check.conclude, _Check.__init__ = real_conclude, real_init  # type: ignore[method-assign]
    mine = torch.tensor([entered, decided], dtype=torch.float64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(engine.world_size)]
    dist.all_gather(lengths, torch.tensor([len(entered)]))
    if len({int(x) for x in lengths}) != 1 or len(entered) != len(decided):
        raise RuntimeError(f"ranks made different numbers of checks: {[int(x) for x in lengths]}")
    every = torch.stack(_gathered(mine, engine.world_size))  # rank, (entered, decided), check
    # Without the check a collective starts once the last rank issues it (the last entry);
    # with it, once the last rank has decided: the difference is the check's latency.
    late = every[:, 1].max(dim=0).values - every[:, 0].max(dim=0).values
    critical = late.clamp(min=0).sum().item() / n
    cpu = torch.tensor([poller_cpu[0] / n], dtype=torch.float64)
    dist.all_reduce(cpu)
    handed = torch.tensor([poller_checks[0] / n], dtype=torch.float64)
    dist.all_reduce(handed)
    return {"checks_per_step": len(entered) / n, "critical_ms": 1e3 * critical,
            "poller_cpu_ms": 1e3 * cpu.item() / engine.world_size, "step_s": wall,
            "poller_checks_per_step": handed.item() / engine.world_size,
            "share": (critical + cpu.item() / engine.world_size) / wall, "steps": n}


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    out = {}
    for stage in args.zero_stages:
        out[stage] = _instrumented(stage, args) if args.instrumented else _measure(stage, args)
        gc.collect()
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(out), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", dest="zero_stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=2, help="steps per half-round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--instrumented", action="store_true",
                   help="count the check's time inside the board instead of pairing on/off steps")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(Path(__file__).resolve()), "--worker", "--stages", *map(str, args.zero_stages), "--rounds",
           str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup),
           *(["--instrumented"] if args.instrumented else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        return 1
    result = json.loads(lines[-1][len("RESULT "):])
    if args.instrumented:
        print(f"collective check, counted inside the board, {args.nproc} gloo ranks, 25M GPT fp32, "
              f"{args.rounds * args.steps} steps:")
        print("| stage | checks / step | critical path (ms / step) | poller: checks, CPU (ms) / step "
              "| step (s) | share |")
        print("|---|---:|---:|---:|---:|---:|")
        for stage, r in result.items():
            print(f"| {stage} | {r['checks_per_step']:.0f} | {r['critical_ms']:.2f} | "
                  f"{r['poller_checks_per_step']:.1f}, {r['poller_cpu_ms']:.2f} | {r['step_s']:.3f} | "
                  f"{100 * r['share']:.2f}% |")
        return 0
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
