"""One rank of one benchmark run: build one engine, train warm-up + timed steps, write JSON.

Started by bench/run.py as
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/runner.py \
        --engine zs0 --steps 8 --warmup 3 --spec '{...}' --out-dir bench/out/run-xyz
Each rank writes <out-dir>/rank<R>.json. A config the engine refuses as "not supported yet"
is recorded (status "unsupported"), not raised, so the table always regenerates in full.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything can import deepspeed

import torch
from engines import ENGINES
from engines.common import Batches, RunSpec, tensor_census


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def classify(exc: BaseException) -> str:
    names = {c.__name__ for c in type(exc).__mro__}
    if "NotSupportedError" in names or "not supported yet" in str(exc):
        return "unsupported"
    return "error"


def run(args: argparse.Namespace, rank: int, world_size: int) -> dict:
    spec = RunSpec(**{k: tuple(v) if k == "betas" else v for k, v in json.loads(args.spec).items()})
    engine = ENGINES[args.engine]
    out: dict = {"engine": args.engine, "rank": rank, "world_size": world_size,
                 "rss_before_build_bytes": current_rss_bytes(), "num_threads": torch.get_num_threads()}
    batches = Batches(spec, rank, world_size)
    t0 = time.perf_counter()
    try:
        stepper = engine.build(spec)
    except Exception as e:  # recorded in the table, then the run ends
        out.update(status=classify(e), message=f"{type(e).__name__}: {e}",
                   traceback=traceback.format_exc(limit=8))
        return out
    out["init_s"] = time.perf_counter() - t0
    out["rss_after_build_bytes"] = current_rss_bytes()
    out["optimizer"] = stepper.optimizer_name
    step_s, phase_losses = [], []
    prof = None
    try:
        for s in range(args.warmup + args.steps):
            if s == args.warmup:
                ru0 = resource.getrusage(resource.RUSAGE_SELF)
            if s == args.warmup and args.profile:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                prof.__enter__()
            x, y = batches(s)
            t = time.perf_counter()
            loss = stepper.step(x, y)
            dt = time.perf_counter() - t
            phase_losses.append(float(loss))
            if s >= args.warmup:
                step_s.append(dt)
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
        sys_s = ru1.ru_stime - ru0.ru_stime
        if prof is not None:
            prof.__exit__(None, None, None)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            (args.out_dir / f"profile_rank{rank}.txt").write_text(table)
            prof.export_chrome_trace(str(args.out_dir / f"trace_rank{rank}.json"))
    except Exception as e:
        out.update(status="error", message=f"{type(e).__name__}: {e} (step {len(phase_losses)})",
                   traceback=traceback.format_exc(limit=8))
        return out
    out.update(
        status="ok",
        step_s=step_s,
        losses=phase_losses,
        cpu_s_per_step=cpu_s / max(args.steps, 1),  # all threads: compute, gloo, allocator
        sys_s_per_step=sys_s / max(args.steps, 1),
        minor_faults=ru1.ru_minflt - ru0.ru_minflt,
        peak_rss_bytes=peak_rss_bytes(),
        census_bytes=tensor_census(stepper.census_roots()),
        reported_state_bytes=stepper.reported_state_bytes(),
        num_threads_after=torch.get_num_threads(),
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", required=True, choices=sorted(ENGINES))
    p.add_argument("--steps", type=int, required=True, help="timed steps")
    p.add_argument("--warmup", type=int, required=True, help="untimed steps first")
    p.add_argument("--spec", required=True, help="RunSpec as JSON")
    p.add_argument("--out-dir", required=True, type=Path)
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over the timed steps: <out-dir>/profile_rank<R>.txt and a trace")
    args = p.parse_args()
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = run(args, rank, world_size)
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    if out["status"] == "error":
        print(f"[bench rank {rank}] {args.engine}: {out['message']}\n{out['traceback']}", file=sys.stderr)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            if out["status"] == "ok":
                dist.barrier()
            dist.destroy_process_group()
    except Exception:  # teardown noise must not hide the result
        pass
    # A rank that failed exits non-zero so torchrun stops its peers instead of letting them
    # wait in a collective; "unsupported" is raised at initialize on every rank alike.
    return 1 if out["status"] == "error" else 0


if __name__ == "__main__":
    sys.exit(main())
