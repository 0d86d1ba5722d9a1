"""One rank of a legacy-MoE run (DeepSpeed 0.19.8 or zeroshard): `deepspeed.moe.layer.MoE` with
4 experts at EP 1 and EP 2 (2 ranks), ZeRO 0/1/2, top-1 with dropping and top-2 residual.

    torchrun --nproc-per-node=2 moe_worker.py --engine ds|zs --out DIR

Each case trains 4 steps of 2 micro-batches (torch AdamW through `torch_adam`; clipping, where
DeepSpeed's fp32 ZeRO 0 norm differs from its ZeRO 1/2 norm: zero/expert_split.py), saves after
step 2 and resumes in a fresh engine. Rank 0 writes
`{case: [per-step losses of every rank]}` to DIR/<engine>.json; every rank writes its final
parameters to DIR/<engine>_<case>_rank<r>.pt. Routing draws no random numbers (no RTS, no
sampled second expert), so both engines see the same data and the same routes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN, TOKENS, MICRO, GAS, STEPS, SAVE_AT, EXPERTS = 8, 6, 2, 2, 4, 2, 4
CASES = {
    "top1_drop": dict(k=1, capacity_factor=0.5, min_capacity=0, use_rts=False),
    "top2_residual": dict(k=2, capacity_factor=1.0, min_capacity=2, use_residual=True, top2_2nd_expert_sampling=False),
}


def build(moe_cls: Any, ep: int, case: str) -> nn.Module:
    """The same model on both engines; expert e (global id) is perturbed by seed 100 + e."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(HIDDEN, HIDDEN)
            expert = nn.Sequential(nn.Linear(HIDDEN, 12), nn.GELU(), nn.Linear(12, HIDDEN))
            self.moe = moe_cls(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep, **CASES[case])
            self.out = nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
            return F.mse_loss(self.out(h), y) + 0.1 * l_aux

    net = Net()
    local = EXPERTS // ep
    first = (dist.get_rank() % ep) * local
    with torch.no_grad():
        for j, module in enumerate(net.moe.deepspeed_moe.experts.deepspeed_experts):
            g = torch.Generator().manual_seed(100 + first + j)
            for p in module.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return net


def engine_for(name: str, ep: int, case: str, stage: int) -> Any:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
           "zero_allow_untested_optimizer": True, "gradient_clipping": 0.05,
           "steps_per_print": 1000, "zero_optimization": {"stage": stage}}
    if name == "ds":
        import deepspeed
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
    else:
        import zeroshard as deepspeed
        from zeroshard.moe.layer import MoE
        from zeroshard.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
    model = build(MoE, ep, case)
    groups = split({"params": list(model.parameters()), "name": "parameters"})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    return engine


def data(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 100 * step + 10 * micro + rank)
    return torch.randn(MICRO, TOKENS, HIDDEN, generator=g), torch.randn(MICRO, TOKENS, HIDDEN, generator=g)


def all_losses(loss: float) -> list[float]:
    t = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    t[dist.get_rank()] = loss
    dist.all_reduce(t)
    return t.tolist()


def run_case(name: str, ep: int, case: str, stage: int, ckpt: Path) -> tuple[list[list[float]], dict]:
    rank = dist.get_rank()
    engine = engine_for(name, ep, case, stage)
    rows = []
    for step in range(STEPS):
        if step == SAVE_AT:
            engine.save_checkpoint(str(ckpt), tag=f"{case}-ep{ep}-s{stage}")
            engine = engine_for(name, ep, case, stage)
            engine.load_checkpoint(str(ckpt), tag=f"{case}-ep{ep}-s{stage}")
        total = 0.0
        for micro in range(GAS):
            loss = engine(*data(step, micro, rank))
            engine.backward(loss)
            engine.step()
            total += loss.item() / GAS
        rows.append(all_losses(total))
    return rows, {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("ds", "zs"), required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt = Path(tempfile.gettempdir()) / f"moe-{args.engine}-{os.environ.get('MASTER_PORT', '0')}"
    out: dict[str, list] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    for ep in (1, dist.get_world_size()):
        for case in CASES:
            for stage in (0, 1, 2):
                key = f"{case}-ep{ep}-zero{stage}"
                out[key], weights = run_case(args.engine, ep, case, stage, ckpt)
                torch.save(weights, args.out / f"{args.engine}_{key}_rank{rank}.pt")
                dist.barrier()
    if rank == 0:
        (args.out / f"{args.engine}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
