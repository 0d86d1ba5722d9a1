"""A Hugging Face Trainer job on a MoE model with AutoEP, as a user writes it: the ds_config given to
`TrainingArguments(deepspeed=...)` carries `"expert_parallel": {"enabled": true, "autoep_size": N}`.

Runs under whatever `import deepspeed` resolves to (zeroshard's alias). A tiny Mixtral or DeepSeek-V3
built from its config (before TrainingArguments, so outside zero.Init; with --after-args, after a
ZeRO-3 TrainingArguments through `from_config`, so inside zero.Init, as `from_pretrained` loads
a large MoE model for Trainer users), synthetic tokens, torch SGD
(constant lr, no clipping). Every rank records the batches every rank trained on (all-gathered in a
forward pre-hook), then trains the same model in one process on them (the loss the mean over ranks)
and compares: the per-step losses the Trainer logged and its own parameters (a bank: its experts'
rows) against that oracle, and `Trainer.save_model`'s files read back by `from_pretrained` (every expert).
Rank 0 writes the numbers to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

p = argparse.ArgumentParser()
p.add_argument("--model", choices=["mixtral", "deepseek_v3"], default="mixtral")
p.add_argument("--stage", type=int, default=2)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--after-args", action="store_true", help="build after TrainingArguments (zero.Init at ZeRO-3)")
p.add_argument("--out", required=True)
p.add_argument("--results", required=True)
args = p.parse_args()
LR, SEQ, VOCAB, EXPERTS = 0.2, 8, 64, 4


class Tokens(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def build(from_config: bool = False) -> torch.nn.Module:
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    if args.model == "mixtral":
        cfg = MixtralConfig(intermediate_size=24, num_key_value_heads=1, num_local_experts=EXPERTS,
                            num_experts_per_tok=2, **common)
        # from_config enters zero.Init when a ZeRO-3 TrainingArguments exists (as from_pretrained does)
        return AutoModelForCausalLM.from_config(cfg) if from_config else MixtralForCausalLM(cfg)
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        intermediate_size=24, moe_intermediate_size=8, num_key_value_heads=2, n_routed_experts=EXPERTS,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, **common))


world = int(os.environ.get("WORLD_SIZE", "1"))
model = None if args.after_args else build()  # before TrainingArguments: outside zero.Init
zero: dict = {"stage": args.stage}
if args.stage == 3:  # every parameter partitioned; save_model gathers the 16-bit weights
    zero.update(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True)
ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
      "gradient_clipping": "auto", "zero_optimization": zero, "zero_allow_untested_optimizer": True,
      "expert_parallel": {"enabled": True, "autoep_size": world, "preset_model": args.model}}
cfg_path = Path(args.out) / "ds_config.json"
cfg_path.parent.mkdir(parents=True, exist_ok=True)
cfg_path.write_text(json.dumps(ds))
targs = TrainingArguments(
    output_dir=args.out, per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=LR,
    lr_scheduler_type="constant", optim="sgd", max_grad_norm=0.0, weight_decay=0.0, max_steps=args.steps,
    logging_steps=1, save_strategy="no", report_to=[], deepspeed=str(cfg_path), use_cpu=True, seed=0, data_seed=0,
    dataloader_num_workers=0)
start: dict[str, torch.Tensor] | None = None
if args.after_args:
    model = build(from_config=True)
    assert args.stage != 3 or all(hasattr(q, "ds_id") for q in model.parameters()), "expected zero.Init"
    import deepspeed  # the alias: the oracle starts from the values zero.Init holds (gathered)

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        start = {n: q.detach().clone() for n, q in model.named_parameters()}
seen: list[torch.Tensor] = []


def record(module: torch.nn.Module, a: tuple, kw: dict) -> None:
    if not module.training:
        return
    ids = kw.get("input_ids", a[0] if a else None)
    pieces = [torch.empty_like(ids) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, ids.contiguous())
    seen.append(torch.stack(pieces))


model.register_forward_pre_hook(record, with_kwargs=True)
trainer = Trainer(model=model, args=targs, train_dataset=Tokens(64, 0))
trainer.train()
engine = trainer.model_wrapped
import deepspeed  # noqa: E402  the alias, after the Trainer started it (or zero.Init, above)

params = list(engine.module.named_parameters())
with deepspeed.zero.GatheredParameters([q for _, q in params]):
    weights = {n: q.detach().clone() for n, q in params}
banks = {n: m for n, m in engine.module.named_modules() if hasattr(m, "first_expert")}
ref = build()
if start is not None:
    ref.load_state_dict(start, strict=False)  # every parameter (buffers are the config's)
opt = torch.optim.SGD(ref.parameters(), lr=LR)
losses = []
for batch in seen:  # [world, micro, seq]
    per_rank = [ref(input_ids=x, labels=x).loss for x in batch]
    loss = torch.stack(per_rank).mean()
    opt.zero_grad()
    loss.backward()
    for q in ref.parameters():
        if q.grad is None:
            q.grad = torch.zeros_like(q)
    opt.step()
    losses.append(float(loss))
worst = 0.0
for n, q in ref.named_parameters():
    want = q.detach()
    owner = n.rsplit(".", 1)[0]
    if owner in banks:
        want = want[banks[owner].first_expert:banks[owner].first_expert + banks[owner].num_experts]
    worst = max(worst, float((weights[n] - want).abs().max() / max(float(want.abs().max()), 1e-3)))
trainer.save_model(str(Path(args.out) / "final"))  # every rank: the banks are gathered for the file
if dist.get_rank() == 0:
    # Transformers writes the hub layout (Mixtral: one tensor per expert); from_pretrained reads it
    # back into banks. Without the Trainer's ZeRO-3 config, or it would load inside zero.Init.
    unset_hf_deepspeed_config()
    saved = type(ref).from_pretrained(str(Path(args.out) / "final")).state_dict()
    ref_sd = ref.state_dict()
    assert set(saved) == set(ref_sd), sorted(set(saved) ^ set(ref_sd))
    saved_worst = max(float((saved[n] - ref_sd[n]).abs().max() / max(float(ref_sd[n].abs().max()), 1e-3))
                      for n in saved)
worst_t = torch.tensor([worst], dtype=torch.float64)
dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
out = {"log": [h["loss"] for h in trainer.state.log_history if "loss" in h], "oracle_losses": losses,
       "max_weight_rel": float(worst_t), "banks": len(banks),
       "local_experts": sorted({m.num_experts for m in banks.values()}), "world_size": world}
if dist.get_rank() == 0:
    out["saved_rel"] = saved_worst
if dist.get_rank() == 0:
    Path(args.results).write_text(json.dumps(out))
