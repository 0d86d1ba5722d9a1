"""One rank of an AutoTP run (DeepSpeed 0.19 or zeroshard) on the tiny Llama of tests/dist/tp_helpers.py.

    torchrun --nproc-per-node=N autotp_worker.py --engine ds|zs --tp 2 --out DIR

Runs ZeRO stages 0, 1 and 2 with `tensor_parallel.autotp_size` = tp, gradient clipping and a
torch AdamW (`torch_adam`: no DeepSpeed op build), a save after step 2 and a resume into a fresh
engine for the remaining steps; rank 0 writes `{stage: [per-step losses of every dp rank]}` to
DIR/<engine>_tp<tp>_w<world>.json. Both engines see the same data: dp rank = rank // tp.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
from tp_helpers import batches, lm_loss, tiny_llama, tp_config

STEPS, SAVE_AT, LR, CLIP = 6, 3, 1e-3, 0.5


def _engine(name: str, stage: int, tp: int, dp: int):
    cfg = tp_config(tp, stage, dp, clip=CLIP, lr=LR)
    cfg["optimizer"]["params"]["torch_adam"] = True
    cfg["zero_allow_untested_optimizer"] = True
    # DeepSpeed 0.19.8 solves the batch triad with the whole world as its data-parallel size before
    # AutoTP builds its groups (train_batch_size = micro x dp fails there): give micro and accumulation.
    del cfg["train_batch_size"]
    cfg["gradient_accumulation_steps"] = 1
    model = tiny_llama()
    if name == "ds":
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        import zeroshard

        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _all_losses(loss: float, world: int) -> list[float]:
    t = torch.zeros(world, dtype=torch.float64)
    t[dist.get_rank()] = loss
    dist.all_reduce(t)
    return t.tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("ds", "zs"), required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stages", type=int, nargs="*", default=[0, 1, 2])
    args = ap.parse_args()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, dp = args.tp, world // args.tp
    data = batches(STEPS, dp)
    out: dict[str, list] = {}
    ckpt = Path(tempfile.gettempdir()) / f"autotp-{args.engine}-{os.environ.get('MASTER_PORT', '0')}"
    for stage in args.stages:
        engine = _engine(args.engine, stage, tp, dp)
        q = engine.module.model.layers[0].self_attn.q_proj.weight  # evidence that the engine split the model
        out[f"layout{stage}"] = [list(q.shape) if q.numel() else list(getattr(q, "ds_shape", q.shape)),
                                 engine.dp_world_size]
        rows = []
        for step, per_dp in enumerate(data):
            if step == SAVE_AT:  # save, and resume into a fresh engine
                engine.save_checkpoint(str(ckpt), tag=f"s{stage}")
                engine = _engine(args.engine, stage, tp, dp)
                engine.load_checkpoint(str(ckpt), tag=f"s{stage}")
            loss = lm_loss(engine, per_dp[rank // tp])
            engine.backward(loss)
            engine.step()
            rows.append(_all_losses(loss.item(), world))
        out[str(stage)] = rows
        dist.barrier()
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.engine}_tp{tp}_w{world}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
