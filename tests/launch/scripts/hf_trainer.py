"""A Hugging Face Trainer job with `deepspeed=<config>`, as the seeds' guides write it.

Runs under whatever `import deepspeed` resolves to: zeroshard's alias (ZEROSHARD_AS_DEEPSPEED=1)
or a real DeepSpeed (the differential tests). Tiny Llama built from its config, synthetic tokens,
CPU. Writes what it saw (per-step loss, grad norm, lr, eval loss, checkpoint files) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--stage", type=int, default=2)
p.add_argument("--optim", choices=["ds", "hf"], default="ds", help="optimizer+scheduler from the ds_config or HF's own")
p.add_argument("--gas", type=int, default=2)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--save-steps", type=int, default=0)
p.add_argument("--resume", action="store_true")
p.add_argument("--offload", action="store_true")
p.add_argument("--gather16", action="store_true", help="stage3_gather_16bit_weights_on_model_save")
p.add_argument("--bf16", action="store_true")
p.add_argument("--eval", action="store_true")
p.add_argument("--save-on-each-node", action="store_true", help="TrainingArguments(save_on_each_node=True)")
p.add_argument("--save-model", default="")
p.add_argument("--autotp", type=int, default=0, help='the ds_config\'s "tensor_parallel": {"autotp_size": N}')
p.add_argument("--out", required=True)
p.add_argument("--results", required=True)
args = p.parse_args()


class Tokens(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.x = torch.randint(0, 128, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


zero: dict = {"stage": args.stage}
if args.offload:
    zero["offload_optimizer"] = {"device": "cpu"}
if args.stage == 3:
    zero["stage3_gather_16bit_weights_on_model_save"] = args.gather16
ds: dict = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
            "bf16": {"enabled": "auto"}}
if args.autotp:
    ds["tensor_parallel"] = {"autotp_size": args.autotp}
if args.optim == "ds":
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto"}}
    ds["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto", "total_num_steps": "auto"}}
else:
    ds["zero_allow_untested_optimizer"] = True
cfg_path = Path(args.out) / "ds_config.json"
cfg_path.parent.mkdir(parents=True, exist_ok=True)
cfg_path.write_text(json.dumps(ds))

targs = TrainingArguments(
    output_dir=args.out, per_device_train_batch_size=2, per_device_eval_batch_size=2,
    gradient_accumulation_steps=args.gas, learning_rate=1e-3, warmup_steps=1, weight_decay=0.01,
    max_steps=args.steps, logging_steps=1, save_strategy="steps" if args.save_steps else "no",
    save_steps=args.save_steps or 10**6, report_to=[], deepspeed=str(cfg_path), use_cpu=True,
    bf16=args.bf16, seed=0, data_seed=0, dataloader_num_workers=0, save_on_each_node=args.save_on_each_node)
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg)  # under zero.Init at stage 3 (TrainingArguments first)
trainer = Trainer(model=model, args=targs, train_dataset=Tokens(64, 0), eval_dataset=Tokens(8, 1))
trainer.train(resume_from_checkpoint=True if args.resume else None)
out = {"log": [h for h in trainer.state.log_history if "loss" in h],
       "global_step": trainer.state.global_step,
       "world_size": int(os.environ.get("WORLD_SIZE", "1")),
       "node_local": trainer.model_wrapped.config.get("checkpoint", {}).get("use_node_local_storage", False)
       if hasattr(trainer.model_wrapped, "config") and isinstance(trainer.model_wrapped.config, dict) else None}
if args.eval:
    out["eval_loss"] = trainer.evaluate()["eval_loss"]
if args.save_model:
    trainer.save_model(args.save_model)
    out["saved"] = sorted(os.listdir(args.save_model)) if trainer.is_world_process_zero() else []
if trainer.is_world_process_zero():
    Path(args.results).write_text(json.dumps(out))
