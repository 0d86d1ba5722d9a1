"""In the style of DeepSpeedExamples' bf16 master-weights demo (training/bf16_master_weight/train.py),
written anew: a small transformer (attention + LayerNorm + MLP blocks) on random tokens, ZeRO stage 3,
bf16, optionally `torch_autocast`; memory read through `get_accelerator()`; save, then a new process
loads and continues.

    torchrun --nproc-per-node=2 bf16_master_demo.py --deepspeed_config ds.json --out DIR --phase save|resume
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn as nn
from common import check_framework, import_deepspeed, record_losses

deepspeed = import_deepspeed()
get_accelerator = deepspeed.accelerator.get_accelerator


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.norm1 = nn.LayerNorm(hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.ff = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn, _ = self.attention(x, x, x)
        x = self.norm1(x + attn)
        return self.norm2(x + self.ff(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.pos_embedding = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.output_proj = nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        x = self.embedding(input_ids) + self.pos_embedding(pos)
        for layer in self.layers:
            x = layer(x)
        return self.output_proj(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", choices=("save", "resume"), required=True)
    parser.add_argument("--num_steps", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=128)
    parser.add_argument("--seq_length", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    deepspeed.init_distributed()
    rank = deepspeed.comm.get_rank()
    local_rank = args.local_rank if args.local_rank != -1 else rank
    device = get_accelerator().device_name(local_rank)
    get_accelerator().set_device(local_rank)
    torch.manual_seed(args.seed)
    get_accelerator().manual_seed_all(args.seed)
    get_accelerator().reset_peak_memory_stats()

    model = TinyTransformer(args.vocab_size, hidden=32, layers=2, heads=4, seq=args.seq_length)
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    autocast = ds_config.get("torch_autocast", {})
    use_autocast = autocast.get("enabled", False)
    autocast_dtype = torch.bfloat16 if "bfloat16" in autocast.get("dtype", "torch.bfloat16") else torch.float16
    model_engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                         config=args.deepspeed_config)
    allocated = get_accelerator().memory_allocated()
    ckpt = f"{args.out}/ckpt"
    if args.phase == "resume":
        model_engine.load_checkpoint(ckpt)
    model_engine.train()
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(args.seed + rank)  # the demo's random tokens, per rank
    losses = []
    for _step in range(args.num_steps):
        input_ids = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_length), generator=g).to(device)
        labels = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_length), generator=g).to(device)
        if use_autocast:
            with torch.autocast(device_type=get_accelerator().device_name(), dtype=autocast_dtype):
                logits = model_engine(input_ids)
                loss = loss_fn(logits.view(-1, args.vocab_size), labels.view(-1))
        else:
            logits = model_engine(input_ids)
            loss = loss_fn(logits.view(-1, args.vocab_size), labels.view(-1))
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
    peak = get_accelerator().max_memory_allocated()
    if args.phase == "save":
        model_engine.save_checkpoint(ckpt)
    check_framework(deepspeed)
    record_losses(args.out, args.phase, rank, losses)
    print(f"rank {rank} {args.phase} losses {losses} allocated {allocated} peak {peak}", flush=True)
    model_engine.destroy()


if __name__ == "__main__":
    main()
