"""Two-node link-drop worker (tests/launch/test_two_node_netns.py): every rank all-reduces every
0.2 s under a 120 s collective timeout, printing one READY line after the first; the test then
takes node 1's link down. ZEROSHARD_PEER_SILENCE_S comes from the environment."""

from __future__ import annotations

import time

import torch

from zeroshard.comm import Comm, init_distributed


def main() -> None:
    groups = init_distributed(timeout_s=120)
    comm = Comm(groups, timeout_s=120)
    comm.all_reduce(torch.ones(4))
    print(f"READY rank {groups.rank}", flush=True)
    deadline = time.monotonic() + 110
    while time.monotonic() < deadline:
        comm.all_reduce(torch.ones(4))  # the link drops while the ranks are in here
        time.sleep(0.2)
    raise SystemExit(f"rank {groups.rank}: all-reduces kept completing for 110 s after READY")


if __name__ == "__main__":
    main()
