"""The collective signature check's latency per collective, paired in one process.

    torchrun --nproc-per-node 2 bench/check_latency.py [NUMEL [MATMUL [sync|async]]]
    ZEROSHARD_COMM_CHECK_BOARD=0 torchrun ...      # the side gloo group instead of the board

16 alternating rounds of 20 all-gathers of NUMEL elements per rank, each followed by a
MATMUL x MATMUL matmul (sync: gather, then matmul; async: issue, matmul, wait), with the check
on and off (Note: [collective signature check] in zeroshard/comm/checked.py; [signature
board] in comm/board.py). Prints rank 0's median time per collective each way and the
difference. Results: bench/results.md, "The signature board".
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from zeroshard.comm import Comm, init_distributed


def main() -> None:
    torch.set_num_threads(1)
    comm = Comm(init_distributed())
    numel = int(float(sys.argv[1])) if len(sys.argv) > 1 else 1_000_000
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    mode = sys.argv[3] if len(sys.argv) > 3 else "sync"
    calls = 20
    full, mine, a = torch.zeros(numel * comm.world_size), torch.ones(numel), torch.randn(size, size)
    per_call: dict[bool, list[float]] = {True: [], False: []}
    for rnd in range(16):
        for verify in ((True, False) if rnd % 2 == 0 else (False, True)):
            comm._verify = verify  # the same on every rank, between barriers
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                if mode == "sync":
                    comm.all_gather(full, mine)
                    a @ a
                else:
                    handle = comm.all_gather(full, mine, async_op=True)
                    a @ a
                    handle.wait()
            comm.barrier()
            per_call[verify].append((time.perf_counter() - t0) / calls * 1e3)
    if comm.rank == 0:
        on, off = statistics.median(per_call[True]), statistics.median(per_call[False])
        print(f"all-gather of {numel} elements, {mode}, matmul {size}: check on {on:.3f} ms, off {off:.3f} ms "
              f"per collective; extra {on - off:+.3f} ms")


if __name__ == "__main__":
    main()
