"""An Accelerate loop under `accelerate launch --use_deepspeed` whose ds_config carries zeroshard's `fp8`
section (tests/launch/test_fp8_accelerate.py). Writes the engine, the linear layers' classes and the
per-step losses as JSON. Runs under whatever `import deepspeed` resolves to."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, LlamaConfig

p = argparse.ArgumentParser()
p.add_argument("--results", required=True)
args = p.parse_args()

acc = Accelerator()
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.randint(0, 128, (6 * 2 * acc.num_processes, 16), generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2)
model, opt, loader = acc.prepare(model, opt, loader)
losses = []
for (x,) in loader:
    loss = model(input_ids=x, labels=x).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(float(acc.reduce(loss.detach(), "mean")))
inner = getattr(model, "module", model)
classes = {name: f"{type(m).__module__}.{type(m).__name__}" for name, m in inner.named_modules()
           if isinstance(m, torch.nn.Linear)}
if acc.is_main_process:
    Path(args.results).write_text(json.dumps({
        "engine": f"{type(model).__module__}.{type(model).__name__}", "mixed_precision": acc.state.mixed_precision,
        "bf16": acc.state.deepspeed_plugin.deepspeed_config.get("bf16"), "classes": classes, "losses": losses}))
