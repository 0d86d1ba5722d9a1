"""`AutoModelForCausalLM.from_pretrained(path)` at ZeRO-3, unmodified user code, under whatever
`import deepspeed` resolves to (the alias here). Records the peak RSS of the load, then (with
--check) the gathered weights on rank 0 and a forward loss after deepspeed.initialize, or
(with --trainer) two Trainer steps; writes JSON (and rank 0's gathered weights as .pt).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch

p = argparse.ArgumentParser()
p.add_argument("--pretrained", required=True)
p.add_argument("--results", required=True)
p.add_argument("--trainer", action="store_true", help="TrainingArguments(deepspeed=...) then Trainer, 2 steps")
p.add_argument("--check", action="store_true", help="save rank 0's gathered weights and a forward loss")
args = p.parse_args()

import deepspeed  # noqa: E402  after argument parsing, as the user script it imitates
import torch.distributed as dist  # noqa: E402  after argument parsing, as the user script it imitates
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402  after argument parsing, as the user script it imitates
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402  after argument parsing, as the user script it imitates

rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2 * world,
      "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
if args.trainer:
    ds_auto = {**ds, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
               "gradient_accumulation_steps": "auto"}
    keep = TrainingArguments(output_dir=str(Path(args.results).parent / "out"), per_device_train_batch_size=2,
                             max_steps=2, logging_steps=1, report_to=[], deepspeed=ds_auto, use_cpu=True,
                             save_strategy="no", seed=0, learning_rate=1e-3)
else:
    keep = HfDeepSpeedConfig(ds)  # must stay alive while the model is built
deepspeed.init_distributed()
rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(args.pretrained)
load_s = time.perf_counter() - t
rss_after_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {"rank": rank, "world_size": world, "load_s": load_s, "rss_before_kib": rss_before_kib,
       "rss_peak_kib": rss_after_kib}

if args.check:
    gathered = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters(param):
            if rank == 0:
                gathered[name] = param.detach().clone()
    if rank == 0:
        torch.save(gathered, f"{args.results}.pt")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    x = torch.randint(0, model.config.vocab_size, (2 * world, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out["loss"] = float(engine(input_ids=x[2 * rank: 2 * rank + 2], labels=x[2 * rank: 2 * rank + 2]).loss)

if args.trainer:
    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.x = torch.randint(0, model.config.vocab_size, (16, 12), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.x[i], "labels": self.x[i]}

    trainer = Trainer(model=model, args=keep, train_dataset=Tokens())
    trainer.train()
    out["log"] = [h for h in trainer.state.log_history if "loss" in h]

Path(f"{args.results}.rank{rank}").write_text(json.dumps(out))
if dist.is_initialized():
    dist.barrier()
