"""PEFT LoRA on a tiny Llama through `import deepspeed`, as a LoRA fine-tuning script writes it.

    torchrun --nproc-per-node 2 hf_peft_lora.py --stage 3 --results out.json

Only the adapters train; the base weights are frozen. With stage3_param_persistence_threshold 0
every base weight is partitioned at stage 3, so each LoRA layer's frozen matmul reads its weight
in backward after the adapter's gradients arrived (Note: [frozen parameters in backward] in
zeroshard/zero/frozen_reads.py). Writes the per-step losses (rank 0)."""

from __future__ import annotations

import argparse
import json
import os

import deepspeed
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=3)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--results", required=True)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = get_peft_model(LlamaForCausalLM(config),
                       LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                  target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
ds_config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
             "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                  config=ds_config)
rank = int(os.environ.get("RANK", 0))
losses = []
for step in range(args.steps):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    engine.step()
    loss = out.loss.detach().clone()
    torch.distributed.all_reduce(loss)
    losses.append(loss.item() / torch.distributed.get_world_size())
trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
if rank == 0:
    with open(args.results, "w") as f:
        json.dump({"losses": losses, "trainable": trainable}, f)
