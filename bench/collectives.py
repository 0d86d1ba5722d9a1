"""gloo collectives on this machine: what each ZeRO stage's communication costs here.

    python bench/collectives.py         # ~30 s; rewrites the collectives section of results.md

Stage 0 / DDP all-reduce the gradients; stages 1-2 reduce-scatter them (or all-reduce and keep
a slice) and all-gather the updated parameters; FSDP2 all-gathers and reduce-scatters per unit.
This times torch.distributed's gloo all_reduce, reduce_scatter_tensor and all_gather_into_tensor
at world size 2 on the whole 25M-element gradient and in 5M-element buckets (the benchmark's
bucket size), each call between barriers, median of --repeats; and the same three through
zeroshard's Comm, which on one host runs them through shared memory (Note: [shared-memory
collectives] in zeroshard/comm/shm.py; "gloo" in the row name when ZEROSHARD_COMM_SHM=0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def worker(repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from zeroshard.comm import Comm, init_distributed

    groups = init_distributed()  # gloo on CPU; torch's own calls below use the same default group
    comm = Comm(groups)
    route = "shared memory" if comm.shares_memory() else "gloo"
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for total in (25_000_000,):
        for bucket in (total, 5_000_000):
            full = torch.randn(total)
            shard = torch.empty(total // world)
            buckets = list(full.split(bucket))
            outs = [torch.empty(b.numel() // world) for b in buckets]

            def all_reduce() -> None:
                for b in buckets:
                    dist.all_reduce(b)

            def reduce_scatter() -> None:
                for o, b in zip(outs, buckets):
                    dist.reduce_scatter_tensor(o, b)

            def all_gather() -> None:
                for o, b in zip(outs, buckets):
                    dist.all_gather_into_tensor(b, o)

            def all_gather_by_all_reduce() -> None:
                # Each rank contributes its chunk and zeros elsewhere; the sum is the gather.
                for o, b in zip(outs, buckets):
                    b.zero_()
                    b[rank * o.numel():(rank + 1) * o.numel()].copy_(o)
                    dist.all_reduce(b)

            def zs_all_reduce() -> None:
                for b in buckets:
                    comm.all_reduce(b)

            def zs_reduce_scatter() -> None:
                for o, b in zip(outs, buckets):
                    comm.reduce_scatter(o, b)

            def zs_all_gather() -> None:
                for o, b in zip(outs, buckets):
                    comm.all_gather(b, o)

            for name, fn in (("all_reduce", all_reduce), ("reduce_scatter_tensor", reduce_scatter),
                             ("all_gather_into_tensor", all_gather),
                             ("all_gather as zero-padded all_reduce", all_gather_by_all_reduce),
                             (f"zeroshard all_reduce ({route})", zs_all_reduce),
                             (f"zeroshard reduce_scatter ({route})", zs_reduce_scatter),
                             (f"zeroshard all_gather ({route})", zs_all_gather)):
                fn()  # warm-up
                ts = []
                for _ in range(repeats):
                    dist.barrier()
                    t = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t)
                rows.append({"op": name, "numel": total, "bucket": bucket, "ms": statistics.median(ts) * 1e3})
            del full, shard
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", type=Path, default=BENCH / "results.md")
    args = p.parse_args()
    if args.worker:
        worker(args.repeats)
        return 0
    sys.path.insert(0, str(BENCH))
    from run import OthersCpu, machine, versions, wait_idle, write_section

    wait_idle(30.0)
    meter = OthersCpu()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", __file__, "--worker", "--repeats", str(args.repeats)],
                         env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         check=True).stdout
    others = meter.share()
    rows = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    import datetime as dt

    L = [f"Measured {dt.datetime.now().strftime('%Y-%m-%d %H:%M')} by `python bench/collectives.py`. "
         f"{machine()}; {versions()}. World size 2, gloo, fp32, median of {args.repeats}; "
         f"others' CPU {others:.0%}. 'x all_reduce' compares with all-reducing the same buffer.", "",
         "| operation | elements | bucket | ms | GB/s of buffer | x all_reduce |",
         "|---|---:|---:|---:|---:|---:|"]
    ar = {(r["numel"], r["bucket"]): r["ms"] for r in rows if r["op"] == "all_reduce"}
    for r in rows:
        gbs = r["numel"] * 4 / (r["ms"] / 1e3) / 1e9
        bucket = "whole" if r["bucket"] == r["numel"] else f"{r['bucket']:.0e}"
        L.append(f"| {r['op']} | {r['numel']:.1e} | {bucket} | {r['ms']:.0f} | {gbs:.2f} "
                 f"| {r['ms'] / ar[(r['numel'], r['bucket'])]:.2f} |")
    body = "\n".join(L)
    write_section(args.results, "collectives", body, "gloo collectives (bench/collectives.py)")
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
