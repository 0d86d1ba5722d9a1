"""What counting and checking the script's own torch.distributed collectives costs per call.

    torchrun --nproc-per-node 2 bench/user_collective_cost.py [CALLS]

Note: [script collectives] in zeroshard/comm/user_collectives.py. Paired in one process: 16
alternating rounds of CALLS (default 200) ``dist.all_reduce`` of one element, with the wrappers
installed and not, on the default group (tracked: recorded and signature-checked) and on a group
zeroshard does not track (the wrapper passes the call straight to torch). Then, without gloo, the
wrapper's own dispatch around a no-op function. Prints rank 0's medians. Results:
bench/results.md, "The script's own collectives".
"""

from __future__ import annotations

import statistics
import sys
import time
import timeit

import torch
import torch.distributed as dist

from zeroshard.comm import init_distributed, user_collectives


def _per_call_ms(calls: int, group: dist.ProcessGroup | None) -> float:
    t = torch.ones(1)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(t, group=group)
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    torch.set_num_threads(1)
    groups = init_distributed()
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    untracked = dist.new_group(list(range(groups.world_size)))
    assert user_collectives.installed(), "set ZEROSHARD_COMM_VERIFY=1 (the default)"
    runs: dict[tuple[str, bool], list[float]] = {}
    for rnd in range(16):
        for wrapped in ((True, False) if rnd % 2 == 0 else (False, True)):
            if wrapped:
                user_collectives.install(groups.timeout_s)
            else:
                user_collectives.uninstall()
            for name, group in (("default group (tracked)", None), ("untracked group", untracked)):
                runs.setdefault((name, wrapped), []).append(_per_call_ms(calls, group))
    user_collectives.install(groups.timeout_s)
    if groups.rank != 0:
        return
    for name in ("default group (tracked)", "untracked group"):
        on, off = statistics.median(runs[name, True]), statistics.median(runs[name, False])
        print(f"dist.all_reduce(1 element), {name}: wrapped {on:.3f} ms, torch's own {off:.3f} ms per call; "
              f"extra {on - off:+.3f} ms")
    def noop(tensor: torch.Tensor, op: object = None, group: object = None, async_op: bool = False) -> None:
        return None

    wrapper = user_collectives._wrap("all_reduce", noop, user_collectives._arguments(noop, "tensor", "numel"))
    t, n = torch.ones(1), 200_000
    direct = min(timeit.repeat(lambda: noop(t, group=untracked), number=n, repeat=5)) / n * 1e9
    through = min(timeit.repeat(lambda: wrapper(t, group=untracked), number=n, repeat=5)) / n * 1e9
    print(f"wrapper dispatch on an untracked group: {through - direct:.0f} ns per call "
          f"({through:.0f} ns through it, {direct:.0f} ns direct)")


if __name__ == "__main__":
    main()
