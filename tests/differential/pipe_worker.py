"""One torchrun job running pipeline cases under DeepSpeed 0.19 (`--engine ds`) or zeroshard (`zs`).

Every rank writes nothing; the last stage's dp-rank-0 process of each case records the per-step
losses `train_batch` returned into OUT (JSON: case -> list of floats). Same PipelineModule specs,
data and config on both sides; a client torch AdamW (no JIT-built DeepSpeed op).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "dist"))
from tiny_layers import Block, Embed, Head

VOCAB, DIM, SEQ, MICRO, GAS, STEPS = 16, 8, 6, 2, 4, 4

CASES: dict[str, dict[str, Any]] = {
    # name: stages, zero stage, tied, partition method, activation checkpoint interval, clip; world = runner's
    "pp2-z0-untied-parameters": {"stages": 2, "zero": 0, "tied": False, "method": "parameters"},
    "pp2-z1-tied-parameters": {"stages": 2, "zero": 1, "tied": True, "method": "parameters"},
    "pp2-z0-tied-uniform": {"stages": 2, "zero": 0, "tied": True, "method": "uniform"},
    "pp2-z1-untied-type:block": {"stages": 2, "zero": 1, "tied": False, "method": "type:block"},
    "pp2-z0-tied-ckpt1-nonreentrant": {"stages": 2, "zero": 0, "tied": True, "method": "parameters", "ckpt": 1},
    "pp2-z0-tied-clip0.05": {"stages": 2, "zero": 0, "tied": True, "method": "parameters", "clip": 0.05},
    "pp2xdp2-z0-tied": {"stages": 2, "zero": 0, "tied": True, "method": "parameters"},
    "pp2xdp2-z1-tied": {"stages": 2, "zero": 1, "tied": True, "method": "parameters"},
    "pp4-z0-tied": {"stages": 4, "zero": 0, "tied": True, "method": "parameters"},
    "pp4-z1-untied-uniform": {"stages": 4, "zero": 1, "tied": False, "method": "uniform"},
}
RESUME_CASES: dict[str, dict[str, Any]] = {
    # saved by DeepSpeed after SAVE_AT steps (`--save`), loaded by either engine (`--load`, at `--stages`)
    "resume-pp2-z0": {"stages": 2, "zero": 0, "tied": True, "method": "parameters"},
    "resume-pp2-z1": {"stages": 2, "zero": 1, "tied": True, "method": "parameters"},
}
SAVE_AT, TOTAL_MICRO = 2, 4
"""Resume cases: the save's step, and micro-batches per global batch (the same at every DP degree)."""


def tied_head(embed: Embed, x: Tensor) -> Tensor:
    return F.layer_norm(x, (DIM,)) @ embed.weight.t()


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def seed_fn(seed: Any) -> None:
    # DeepSpeed's own seeding (set_random_seed) raises on the numpy integers its "parameters" and
    # "type:" partitions produce (random.seed refuses numpy.int64 on Python 3.11): both sides seed so.
    torch.manual_seed(int(seed))


def run_case(engine: str, name: str, world: int, rank: int, save: str | None = None, load: str | None = None,
             stages: int | None = None) -> list[float] | None:
    case = dict({**CASES, **RESUME_CASES}[name])
    resume = name in RESUME_CASES
    if stages is not None:
        case["stages"] = stages
    if engine == "ds":
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
        from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint
        init = deepspeed.initialize
    else:
        import zeroshard
        from zeroshard.checkpointing import non_reentrant_checkpoint
        from zeroshard.pipe import LayerSpec, PipelineModule, TiedLayerSpec
        init = zeroshard.initialize
    blocks = 2 * case["stages"]
    tied = case["tied"]
    first = TiedLayerSpec("embed", Embed, VOCAB, DIM) if tied else LayerSpec(Embed, VOCAB, DIM)
    last = TiedLayerSpec("embed", Embed, VOCAB, DIM, forward_fn=tied_head) if tied else LayerSpec(Head, DIM, VOCAB)
    extra: dict[str, Any] = {}
    if case.get("ckpt"):
        extra = {"activation_checkpoint_interval": case["ckpt"], "activation_checkpoint_func": non_reentrant_checkpoint}
    if resume:
        blocks = 4  # the same layers whatever the stage count of the load
    net = PipelineModule([first, *[LayerSpec(Block, DIM) for _ in range(blocks)], last], num_stages=case["stages"],
                         loss_fn=loss_fn, seed_layers=True, seed_fn=seed_fn, base_seed=1234,
                         partition_method=case["method"], **extra)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    dp = world // case["stages"]
    gas = TOTAL_MICRO // dp if resume else GAS
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "gradient_clipping": case.get("clip", 0.0), "steps_per_print": 1000,
           "zero_optimization": {"stage": case["zero"]}, "zero_allow_untested_optimizer": True}
    if case.get("ckpt"):
        cfg["pipeline"] = {"use_reentrant": False}
    eng, *_ = init(model=net, optimizer=opt, config=cfg)
    dp_rank = rank % dp
    g = torch.Generator().manual_seed(7)
    losses = []
    if load is not None:
        eng.load_checkpoint(os.path.join(load, name))
    for step in range(STEPS):
        if resume:  # one global batch per step, dp rank d its micro-batches [d * gas, (d + 1) * gas)
            tokens = torch.randint(0, VOCAB, (TOTAL_MICRO, MICRO, SEQ + 1), generator=g)
            batches = [(t[:, :-1], t[:, 1:]) for t in tokens[dp_rank * gas : (dp_rank + 1) * gas]]
            if load is not None and step < SAVE_AT:
                continue
        else:
            tokens = torch.randint(0, VOCAB, (dp, GAS, MICRO, SEQ + 1), generator=g)
            batches = [(tokens[dp_rank, m, :, :-1], tokens[dp_rank, m, :, 1:]) for m in range(GAS)]
        losses.append(float(eng.train_batch(iter(batches))))
        if save is not None and step + 1 == SAVE_AT:
            eng.save_checkpoint(os.path.join(save, name))
    return losses


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["ds", "zs"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", nargs="+", required=True)
    ap.add_argument("--save", help=f"resume cases: save into SAVE/<case> after {SAVE_AT} steps")
    ap.add_argument("--load", help="resume cases: load LOAD/<case>, then train the remaining steps")
    ap.add_argument("--stages", type=int, help="resume cases: the pipeline stages of this run")
    args = ap.parse_args()
    if args.engine == "ds":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        from zeroshard.comm import init_distributed

        init_distributed()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out: dict[str, Any] = {}
    for name in args.cases:
        try:
            out[name] = run_case(args.engine, name, world, rank, args.save, args.load, args.stages)
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"[:500]
            print(f"rank {rank} case {name}: {out[name]}", file=sys.stderr, flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
