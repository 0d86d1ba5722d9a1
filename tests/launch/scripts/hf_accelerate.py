"""An Accelerate training loop under `accelerate launch --use_deepspeed`, as the seeds' guide writes it.

DummyOptim/DummyScheduler when the ds_config (or accelerate's flags) define them, else a torch
AdamW; `accumulate`, save_state/load_state, get_state_dict + unwrap_model(...).save_pretrained,
and engine.save_checkpoint for zero_to_fp32. Runs under whatever `import deepspeed` resolves to.
Writes per-step loss and lr as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DummyOptim, DummyScheduler
from transformers import AutoModelForCausalLM, LlamaConfig

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--results", required=True)
p.add_argument("--steps", type=int, default=8, help="micro-batches")
args = p.parse_args()
out = Path(args.out)

acc = Accelerator()
dsc = acc.state.deepspeed_plugin.deepspeed_config
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg)
data = torch.randint(0, 128, (args.steps * 2 * acc.num_processes, 16), generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2)
if "optimizer" in dsc:
    opt = DummyOptim(model.parameters(), lr=1e-3, weight_decay=0.01)
else:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
if "scheduler" in dsc:
    sched = DummyScheduler(opt, total_num_steps=args.steps, warmup_num_steps=1)
else:
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
losses, lrs = [], []
for (x,) in loader:
    with acc.accumulate(model):
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    losses.append(float(acc.reduce(loss.detach(), "mean")))
    lrs.append(float(sched.get_last_lr()[0]))
acc.save_state(str(out / "state"))
acc.load_state(str(out / "state"))
state = acc.get_state_dict(model)
n_keys = len(state) if state is not None else 0  # save_pretrained may consume the dict
acc.unwrap_model(model).save_pretrained(str(out / "pretrained"), state_dict=state,
                                         save_function=acc.save, is_main_process=acc.is_main_process)
model.save_checkpoint(str(out / "ckpt"))  # the DeepSpeed engine's own save, for zero_to_fp32
acc.wait_for_everyone()
if acc.is_main_process:
    Path(args.results).write_text(json.dumps({
        "losses": losses, "lrs": lrs, "world_size": acc.num_processes,
        "engine": type(model).__module__ + "." + type(model).__name__,
        "state_files": sorted(os.listdir(out / "state")),
        "pretrained": sorted(os.listdir(out / "pretrained")),
        "state_dict_keys": n_keys}))
