"""One rank of the AutoTP checkpoint comparison (test_autotp_checkpoint.py) on the tiny Llama.

    torchrun --nproc-per-node=N autotp_ckpt_worker.py --engine ds --tp 2 --ckpt DIR --out FILE
    torchrun --nproc-per-node=N autotp_ckpt_worker.py --engine zs --tp T --ckpt DIR --out FILE

`ds`: DeepSpeed 0.19 trains `SAVE_AT` steps with `tensor_parallel.autotp_size` = tp at ZeRO 0/1/2,
saves to DIR/s<stage>, then continues for the remaining steps. `zs`: zeroshard (at tp T, the
rest data parallel) loads DIR/s<stage> and runs the same remaining steps. Both see the same data
per step: the global batch of the save's data-parallel ranks (`SAVE_DP`), each rank taking its
dp share. Rank 0 writes `{stage: [per-step mean loss]}` to FILE.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
from tp_helpers import MICRO, batches, lm_loss, tiny_llama, tp_config

STEPS, SAVE_AT, LR, CLIP = 4, 2, 1e-3, 0.5


def _engine(name: str, stage: int, tp: int, dp: int, micro: int):
    cfg = tp_config(tp, stage, dp, clip=CLIP, lr=LR)
    cfg["optimizer"]["params"]["torch_adam"] = True
    cfg["zero_allow_untested_optimizer"] = True
    del cfg["train_batch_size"]  # DeepSpeed solves the triad before AutoTP (autotp_worker.py)
    cfg["gradient_accumulation_steps"] = 1
    cfg["train_micro_batch_size_per_gpu"] = micro
    if tp == 1:
        del cfg["tensor_parallel"]
    model = tiny_llama()
    if name == "ds":
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        import zeroshard

        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _mean_loss(loss: float, tp: int) -> float:
    t = torch.tensor([loss / tp / (dist.get_world_size() // tp)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("ds", "zs"), required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--save-dp", type=int, default=1)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stages", type=int, nargs="*", default=[0, 1, 2])
    args = ap.parse_args()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, dp = args.tp, world // args.tp
    # One global batch per step: save_dp shards of MICRO rows, re-cut into dp shards here.
    whole = [torch.cat(step) for step in batches(STEPS, args.save_dp)]
    micro = MICRO * args.save_dp // dp
    mine = [step[(rank // tp) * micro : (rank // tp + 1) * micro] for step in whole]
    out: dict[str, list[float]] = {}
    for stage in args.stages:
        engine = _engine(args.engine, stage, tp, dp, micro)
        if args.engine == "ds":
            for step in range(SAVE_AT):
                loss = lm_loss(engine, mine[step])
                engine.backward(loss)
                engine.step()
            engine.save_checkpoint(str(args.ckpt), tag=f"s{stage}")
        else:
            engine.load_checkpoint(str(args.ckpt), tag=f"s{stage}")
        rows = []
        for step in range(SAVE_AT, STEPS):
            loss = lm_loss(engine, mine[step])
            engine.backward(loss)
            engine.step()
            rows.append(_mean_loss(loss.item(), tp))
        out[str(stage)] = rows
        dist.barrier()
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
