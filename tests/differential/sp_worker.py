"""One rank of a sequence-parallel run (DeepSpeed 0.19.8 or zeroshard): a tiny causal LM whose
attention is DeepSpeed-Ulysses' `DistributedAttention`, SP = world size (2), ZeRO 0-3, the sequence
groups from DeepSpeed's `parallel_state_sp` (ALST's mpu, passed as `mpu=`), masked labels.

    torchrun --nproc-per-node=2 sp_worker.py --engine ds|zs --out DIR

Each rank feeds its slice of the same samples and backpropagates its share of the token-weighted
loss (Transformers' formula: the shares add up to the sample's loss). Torch SGD with momentum as a
client optimizer, no clipping, so a gradient off by a factor shows in the weights. Rank 0 writes
`{case: {"loss": [...], "norm": [...]}}` to DIR/<engine>.json; every rank writes its final
parameters to DIR/<engine>_<case>_rank<r>.pt (ZeRO-3 gathered). A case an engine cannot run is
recorded as {"error": "..."}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, HEADS, HEAD_DIM, LOCAL, MICRO, GAS, STEPS, LR = 29, 4, 4, 3, 2, 2, 3, 0.5
HIDDEN = HEADS * HEAD_DIM


class CausalSDPA(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def build(attention_cls: Any, group: Any) -> nn.Module:
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(HIDDEN)
            self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
            self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
            self.attn = attention_cls(CausalSDPA(), group)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(self.ln(x)).unflatten(-1, (3, HEADS, HEAD_DIM)).unbind(2)
            x = x + self.proj(self.attn(q, k, v, 0).flatten(2))
            return x + self.mlp(x)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(64, HIDDEN)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(HIDDEN, VOCAB)

        def forward(self, ids: torch.Tensor, labels: torch.Tensor, offset: int) -> torch.Tensor:
            x = self.emb(ids) + self.pos(torch.arange(offset, offset + ids.shape[1]))
            for block in self.blocks:
                x = block(x)
            count = (labels != -100).sum()
            local = F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(), ignore_index=-100,
                                    reduction="sum") / count.clamp(min=1)
            # Transformers' token-weighted share: value = the whole sample's mean, gradient = this share
            local_sum = local * count
            totals = torch.stack((local_sum.detach(), count.float()))
            dist.all_reduce(totals, group=group)
            return (local_sum + (totals[0] - local_sum.detach())) / totals[1].clamp(min=1)

    return LM()


def samples(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n, seq = STEPS * GAS * MICRO, LOCAL * dist.get_world_size()
    ids = torch.randint(0, VOCAB, (n, seq), generator=gen)
    labels = torch.cat((ids[:, 1:], torch.full((n, 1), -100)), dim=1)
    labels[torch.rand(n, seq, generator=gen) < 0.3] = -100
    labels[0, :LOCAL] = -100
    return ids, labels


def run_case(name: str, stage: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    sp = dist.get_world_size()
    if name == "ds":
        import deepspeed
        from deepspeed.runtime.sequence_parallel import parallel_state_sp as state
        from deepspeed.sequence.layer import DistributedAttention
    else:
        import zeroshard as deepspeed
        from zeroshard.sequence import DistributedAttention
        from zeroshard.sequence import parallel_state as state
    deepspeed.init_distributed()  # as ALST scripts do: DeepSpeed's comm must know the group
    if name == "ds":
        state._release_sequence_parallel_groups()  # DeepSpeed refuses a second initialization
    state.initialize_sequence_parallel(sp)
    model = build(DistributedAttention, state.get_sequence_parallel_group())
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 1000,
           "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}}
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, mpu=state)
    ids, labels = samples()
    rank = dist.get_rank()
    cut = slice(rank * LOCAL, (rank + 1) * LOCAL)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(GAS):
            i = (step * GAS + micro) * MICRO
            loss = engine(ids[i:i + MICRO, cut], labels[i:i + MICRO, cut], rank * LOCAL)
            engine.backward(loss)
            engine.step()
            total += loss.item() / GAS
        losses.append(total)
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else None)
    params = list(engine.module.named_parameters())
    if stage == 3:
        gather = deepspeed.zero.GatheredParameters([p for _, p in params])
        with gather:
            weights = {n: p.detach().clone() for n, p in params}
    else:
        weights = {n: p.detach().clone() for n, p in params}
    return {"loss": losses, "norm": norms}, weights


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("ds", "zs"), required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    for stage in (0, 1, 2, 3):
        key = f"sp{dist.get_world_size()}-zero{stage}"
        try:
            out[key], weights = run_case(args.engine, stage)
            torch.save(weights, args.out / f"{args.engine}_{key}_rank{rank}.pt")
        except Exception as e:
            import traceback
            where = traceback.extract_tb(e.__traceback__)[-1]
            first = (str(e).splitlines() or [""])[0][:300]
            out[key] = {"error": f"{type(e).__name__}: {first} ({Path(where.filename).name}:{where.lineno})"}
        dist.barrier()
    if rank == 0:
        (args.out / f"{args.engine}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
