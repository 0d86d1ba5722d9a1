"""The non-Trainer Hugging Face flow of the seeds' guide: HfDeepSpeedConfig kept alive before the
model is built (so from_config / from_pretrained partition under zero.Init at stage 3), then
deepspeed.initialize, a few steps, and generate(synced_gpus=True) with a different number of new
tokens on each rank. Runs under whatever `import deepspeed` resolves to; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import deepspeed
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.integrations import HfDeepSpeedConfig

p = argparse.ArgumentParser()
p.add_argument("--stage", type=int, default=3)
p.add_argument("--pretrained", default="", help="a save_pretrained directory to load instead of from_config")
p.add_argument("--results", required=True)
args = p.parse_args()

world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
      "zero_optimization": {"stage": args.stage},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}
dschf = HfDeepSpeedConfig(ds)  # must stay alive while the model is built
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
torch.manual_seed(0)
model = (AutoModelForCausalLM.from_pretrained(args.pretrained) if args.pretrained
         else AutoModelForCausalLM.from_config(cfg))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
g = torch.Generator().manual_seed(0)
data = torch.randint(0, 128, (3, 2 * world, 16), generator=g)
losses = []
for step in range(3):
    x = data[step, rank * 2:(rank + 1) * 2]
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    losses.append(float(loss))
engine.eval()
prompt = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(1))
new = 2 + 3 * rank  # ranks ask for different lengths: synced_gpus keeps the forwards paired
with torch.no_grad():
    out = engine.module.generate(input_ids=prompt, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, synced_gpus=world > 1)
result = {"losses": losses, "generated": out[0].tolist(), "new_tokens": out.shape[1] - 4, "rank": rank}
Path(f"{args.results}.rank{rank}").write_text(json.dumps(result))
