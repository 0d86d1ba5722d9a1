"""A 2-rank training script that issues its own torch.distributed collectives between steps;
run by tests/launch/test_user_collectives.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 user_collective.py MODE

Written as a user would: a tiny model, ``zeroshard.initialize`` with a ZeRO config, gloo on the
CPU, and plain ``torch.distributed`` calls after step 2 (Note: [script collectives] in
comm/user_collectives.py).
MODE "extra": ZeRO-2; rank 0 alone all-reduces a 1-element tensor. Every rank must fail at once,
naming rank 0's all_reduce and this file's line, and what rank 1 issued instead.
MODE "same-size": ZeRO-0; rank 0 alone all-reduces a tensor of the gradient bucket's size and
dtype, alike in everything to rank 1's next (zeroshard) all-reduce: gloo alone would pair the two
and train on with wrong numbers. It must be reported as "extra" is.
MODE "both": ZeRO-2; both ranks issue the same collectives (all_reduce, barrier, broadcast,
all_gather_object): training completes, with the sums right.
Each rank prints "rank R: done" at the end and the all_reduce's result when it returns.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import zeroshard


def main(mode: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 0 if mode == "same-size" else 2}}
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = dist.get_rank()
    numel = sum(p.numel() for p in model.parameters())  # stage 0: one bucket, all-reduced per step
    for step in range(1, 5):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if step != 2:
            continue
        if mode == "extra" and rank == 0:
            t = torch.ones(1)
            dist.all_reduce(t)  # rank 0 only, 1 element
            print(f"rank {rank}: extra all_reduce returned {t.item()}", flush=True)
        if mode == "same-size" and rank == 0:
            t = torch.ones(numel)
            dist.all_reduce(t)  # rank 0 only, the size of the other rank's next all_reduce
            print(f"rank {rank}: same-size all_reduce returned {t[0].item()}", flush=True)
        if mode == "both":
            t = torch.full((3,), float(rank + 1))
            dist.all_reduce(t)  # both ranks
            dist.barrier()
            b = torch.full((2,), float(rank))
            dist.broadcast(b, src=1)
            objects: list[object] = [None, None]
            dist.all_gather_object(objects, {"rank": rank})
            print(f"rank {rank}: all_reduce {t.tolist()} broadcast {b.tolist()} objects {objects}", flush=True)
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
