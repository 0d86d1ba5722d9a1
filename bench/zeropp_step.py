"""Worker for bench/two_node.py (or torchrun): stage-3 step time, loss and bytes on the wire of
the "small" GPT with any of ZeRO++'s qwZ (`--qwz`), hpZ (`--hpz`), qgZ (`--qgz`). Rank 0 prints
one `ZEROPP_STEP` line.

    sudo python bench/two_node.py --rate 100mbit -- bench/zeropp_step.py [--qwz] [--hpz] [--qgz]
    ZEROSHARD_NODE_SIZE=2 torchrun --standalone --nproc-per-node 4 bench/zeropp_step.py --qgz

Bytes: the comm log of the last step, each rank's records turned into the bytes it sends
(zeroshard/comm/wire.py: ring / all-to-all, node-major ranks), summed over the ranks, split
intra- and inter-node and by purpose: parameter gathers (all_gather) and gradient reduction
(all_reduce / reduce_scatter / all_to_all). Nodes: the launcher's LOCAL_WORLD_SIZE (2 on the
two-node cluster) or ZEROSHARD_NODE_SIZE.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.comm.groups import init_distributed, node_size
from zeroshard.comm.wire import NodeLayout, split
from zeroshard.examples.gpt import GPT, GPTConfig

GATHER_OPS = ("all_gather",)
GRAD_OPS = ("all_reduce", "reduce_scatter", "all_to_all")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--qwz", action="store_true")
    parser.add_argument("--hpz", action="store_true")
    parser.add_argument("--qgz", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--local_rank", type=int, default=-1, help="given by zeroshard launch, as DeepSpeed's launcher")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig.preset(args.preset)
    # Persistence threshold 1000: the small GPT's matrices (<= 1e5 elements, DeepSpeed's default
    # threshold) would all stay gathered, and ZeRO++ leaves persistent parameters alone.
    zero = {"stage": 3, "stage3_param_persistence_threshold": 1000,
            "zero_quantized_gradients": args.qgz, "zero_quantized_weights": args.qwz}
    groups = init_distributed()
    node = node_size(groups)
    if args.hpz:
        zero["zero_hpz_partition_size"] = node
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "bf16": {"enabled": True},
              "communication_data_type": "bf16", "steps_per_print": 10_000,
              "comms_logger": {"enabled": True}, "zero_optimization": zero}
    engine, *_ = zeroshard.initialize(model=GPT(cfg), config=config)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]  # one batch, memorised: the loss must fall
    log = engine._comm.log  # the bench reads the engine's comm log
    times, loss = [], float("nan")
    for _step in range(args.steps):
        log.reset()  # what remains after the loop is the last step's calls
        start = time.perf_counter()
        out = engine(x, y)
        engine.backward(out)
        engine.step()
        loss = float(out.item())
        times.append(time.perf_counter() - start)
    layout = NodeLayout(groups.rank, groups.world_size, node)
    gathers, grads = split(log.records, layout, GATHER_OPS), split(log.records, layout, GRAD_OPS)
    # Inter-node gather bytes by group: "world" (plain gathers, the persistent unit's refresh),
    # "cross" (hpZ's post-step refresh), "node" (hpZ's forward/backward gathers: always 0).
    by_group = [split([r for r in log.records if r.group == grp], layout, GATHER_OPS).inter
                for grp in ("world", "cross", "node")]
    total = torch.tensor([gathers.intra, gathers.inter, grads.intra, grads.inter, *by_group], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(total)
    if engine.rank == 0:
        steady = times[2:] or times
        mb = [f"{v / 1e6:.3f}" for v in total.tolist()]
        print(f"ZEROPP_STEP qwz={args.qwz} hpz={args.hpz} qgz={args.qgz} world={groups.world_size} node={node} "
              f"steps={args.steps} mean_step_s={sum(steady) / len(steady):.3f} final_loss={loss:.4f} "
              f"gather_MB_intra={mb[0]} gather_MB_inter={mb[1]} grad_MB_intra={mb[2]} grad_MB_inter={mb[3]} "
              f"gather_MB_inter_world={mb[4]} gather_MB_inter_cross={mb[5]} gather_MB_inter_node={mb[6]}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
