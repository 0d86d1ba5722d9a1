"""A Hugging Face Trainer job with DeepSpeed sequence parallelism (ALST), as Accelerate's guide writes
it: `TrainingArguments(deepspeed=..., parallelism_config=ParallelismConfig(sp_size=N, sp_backend="deepspeed"))`.

Runs under whatever `import deepspeed` resolves to (zeroshard's alias, or a real DeepSpeed). Tiny
Llama built from its config (sdpa), synthetic tokens with position ids and masked labels, torch SGD
(no momentum, constant lr, no clipping: a gradient off by a factor shows in the weights). Every rank
records the whole samples its sequence-parallel group trained on, in order (gathered from the
slices in a forward pre-hook); rank 0 writes them, the per-step losses and the final weights'
norms and a checksum to JSON, and with --oracle trains the same model in one process on those
samples, whole, and writes its weights' numbers too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

p = argparse.ArgumentParser()
p.add_argument("--stage", type=int, default=2)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--oracle", action="store_true")
p.add_argument("--out", required=True)
p.add_argument("--results", required=True)
args = p.parse_args()
LR, SEQ, VOCAB = 0.5, 8, 64


class Tokens(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
        self.labels = self.x.clone()
        self.labels[torch.rand(n, SEQ, generator=gen) < 0.25] = -100

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.labels[i], "position_ids": torch.arange(SEQ)}


def build() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


zero: dict = {"stage": args.stage}
if args.stage == 3:
    zero["stage3_param_persistence_threshold"] = 0
ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
      "gradient_clipping": "auto", "zero_optimization": zero, "zero_allow_untested_optimizer": True}
cfg_path = Path(args.out) / "ds_config.json"
cfg_path.parent.mkdir(parents=True, exist_ok=True)
cfg_path.write_text(json.dumps(ds))
world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
pc = ParallelismConfig(sp_size=world, sp_backend="deepspeed",
                       sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                                                  sp_attn_implementation="sdpa"))
targs = TrainingArguments(
    output_dir=args.out, per_device_train_batch_size=1, gradient_accumulation_steps=1, learning_rate=LR,
    lr_scheduler_type="constant", optim="sgd", max_grad_norm=0.0, weight_decay=0.0, max_steps=args.steps,
    logging_steps=1, save_strategy="no", report_to=[], deepspeed=str(cfg_path), use_cpu=True, seed=0, data_seed=0,
    dataloader_num_workers=0, remove_unused_columns=False, parallelism_config=pc)
import deepspeed  # noqa: E402  resolved after the arguments: the alias or a real DeepSpeed

# DeepSpeed 0.19.8 on CPU: Accelerate's CPU state never calls deepspeed.init_distributed, and
# parallel_state_sp asserts deepspeed.comm is initialized; the alias adopts torch's group either way.
deepspeed.init_distributed()
model = build()
seen: list[torch.Tensor] = []


def record(module: torch.nn.Module, a: tuple, kw: dict) -> None:
    """The whole sample this micro-step trains on: the group's slices, gathered in rank order."""
    ids = kw.get("input_ids", a[0] if a else None)
    labels = kw.get("shift_labels", kw.get("labels"))
    pieces = [torch.empty_like(ids) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, ids.contiguous())
    lab = [torch.empty_like(labels) for _ in range(dist.get_world_size())]
    dist.all_gather(lab, labels.contiguous())
    seen.append(torch.stack((torch.cat(pieces, 1), torch.cat(lab, 1))))


model.register_forward_pre_hook(record, with_kwargs=True)
sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]  # the Ulysses wrapper replaces it; the oracle needs it back
trainer = Trainer(model=model, args=targs, train_dataset=Tokens(16, 0))
trainer.train()
engine = trainer.model_wrapped
params = list(engine.module.named_parameters())
if args.stage == 3:
    with deepspeed.zero.GatheredParameters([q for _, q in params]):
        weights = {n: q.detach().clone() for n, q in params}
else:
    weights = {n: q.detach().clone() for n, q in params}
out = {"log": [h for h in trainer.state.log_history if "loss" in h], "world_size": world,
       "norms": {n: float(w.norm()) for n, w in weights.items()},
       "samples": [s.tolist() for s in seen]}
if args.oracle and dist.get_rank() == 0:
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    ref = build()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for sample in seen:
        ids, shift = sample[0], sample[1]
        logits = ref(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), shift.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    ref_w = dict(ref.named_parameters())
    out["oracle_losses"] = losses
    out["max_weight_rel"] = max(float((weights[n] - ref_w[n].detach()).norm() / ref_w[n].detach().norm())
                                for n in weights)
if dist.get_rank() == 0:
    Path(args.results).write_text(json.dumps(out))
