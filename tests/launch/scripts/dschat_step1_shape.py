"""DeepSpeed-Chat step 1 (supervised fine-tuning, the LLaMA walkthrough) in CI shape.

Written for zeroshard's tests, not copied: it makes the DeepSpeed calls DeepSpeed-Chat's
`training/step1_supervised_finetuning/main.py` and its `dschat.utils` make, in the same order,
with the same names and config habits (issue 39 item 5), on a tiny LlamaForCausalLM built from a
config and token rows drawn from a seeded generator, so that it needs no download and no tokenizer.
It runs unchanged under a real DeepSpeed 0.19.8 (`deepspeed --num_gpus 2 THIS ...`) and under
zeroshard (`zeroshard launch --as-deepspeed --nproc_per_node 2 THIS ...`). Each step prints
DeepSpeed-Chat's `--print_loss` line (`Epoch: 0, Step: <step>, Rank: <rank>, loss = <float>`);
with --output_dir, the final weights go to OUTPUT_DIR/pytorch_model.bin as DeepSpeed-Chat saves them.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from typing import Any

import deepspeed
import numpy as np
import torch
from deepspeed import get_accelerator
from deepspeed.compression.helper import recursive_getattr, recursive_setattr
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    SchedulerType,
    default_data_collator,
    get_scheduler,
)
from transformers.integrations.deepspeed import HfDeepSpeedConfig

VOCAB, SEQ, SAMPLES = 96, 16, 32


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DeepSpeed-Chat step 1 in CI shape")
    p.add_argument("--model_name_or_path", type=str, required=True,
                   help="a local Hugging Face model directory; made (tiny, seeded) when it has no config.json")
    p.add_argument("--per_device_train_batch_size", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--num_train_epochs", type=int, default=1)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr_scheduler_type", type=SchedulerType, default="cosine")
    p.add_argument("--num_warmup_steps", type=int, default=0)
    p.add_argument("--output_dir", type=str, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--local_rank", type=int, default=-1, help="passed by the launcher")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--offload", action="store_true")
    p.add_argument("--dtype", type=str, default="bf16", choices=["fp16", "bf16"])
    p.add_argument("--zero_stage", type=int, default=0)
    p.add_argument("--lora_dim", type=int, default=0)
    p.add_argument("--lora_module_name", type=str, default="layers.")
    p.add_argument("--only_optimize_lora", action="store_true")
    p.add_argument("--lora_learning_rate", type=float, default=5e-3)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def get_train_ds_config(offload: bool, dtype: str, stage: int = 2) -> dict[str, Any]:
    """The dict DeepSpeed-Chat's `get_train_ds_config` builds: both offload sections written at
    every stage, the stage3_* keys, the hybrid engine section disabled."""
    device = "cpu" if offload else "none"
    data_type, dtype_config = ("fp16", {"enabled": True, "loss_scale_window": 100}) if dtype == "fp16" \
        else ("bfloat16", {"enabled": True})
    return {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": stage, "overlap_comm": True,
            "offload_param": {"device": device}, "offload_optimizer": {"device": device},
            "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False,
        },
        data_type: dtype_config,
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True,
                          "tp_gather_partition_size": 8},
        "tensorboard": {"enabled": False, "output_path": "step1_tensorboard/ds_tensorboard_logs/",
                        "job_name": "step1_model_tensorboard"},
    }


def set_random_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)


class TokenRows(Dataset):
    """Prompt+answer rows as DeepSpeed-Chat's phase-1 dataset yields them (input_ids,
    attention_mask, labels = input_ids), every row full length. Each row counts from a random start
    in a random stride (drawn from a seeded generator), so that a few steps visibly lower the loss."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.rows = (start + stride * torch.arange(SEQ)) % VOCAB  # [n, SEQ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.rows[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def make_tiny_checkpoint(path: str) -> None:
    """The "pretrained" model the walkthrough downloads, here a 2-layer Llama built from its config
    with seeded weights and saved in Hugging Face format (nothing is downloaded)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * SEQ,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(path)


def create_hf_model(model_name_or_path: str, ds_config: dict[str, Any]) -> nn.Module:
    """As DeepSpeed-Chat's create_hf_model: HfDeepSpeedConfig first at stage 3 (from_pretrained then
    builds the model under zero.Init and loads each weight through a gather), then the vocab padded to
    a multiple of 8."""
    model_config = AutoConfig.from_pretrained(model_name_or_path)
    model_config._attn_implementation = "eager"
    # Kept alive while the model is built: HfDeepSpeedConfig is held by a weak reference.
    dschf = HfDeepSpeedConfig(ds_config) if ds_config["zero_optimization"]["stage"] == 3 else None  # noqa: F841  kept alive while the model is built, as DS-Chat holds it
    model = AutoModelForCausalLM.from_pretrained(model_name_or_path, config=model_config)
    model.config.end_token_id = model.config.eos_token_id
    model.config.pad_token_id = model.config.eos_token_id
    model.resize_token_embeddings(int(8 * math.ceil(VOCAB / 8.0)))
    return model


class LinearLayerLoRA(nn.Module):
    """A frozen linear weight plus a trainable low-rank update, as DeepSpeed-Chat's LoRA layer."""

    def __init__(self, weight: nn.Parameter, lora_dim: int, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        rows, columns = weight.ds_shape if hasattr(weight, "ds_shape") else weight.shape  # ZeRO-3: the full shape
        self.lora_right_weight = nn.Parameter(torch.zeros(columns, lora_dim))
        self.lora_left_weight = nn.Parameter(torch.zeros(lora_dim, rows))
        self.lora_scaling = 1.0 / lora_dim
        g = torch.Generator().manual_seed(rows * 131 + columns)  # the same adapters on every rank
        with torch.no_grad():
            self.lora_right_weight.uniform_(-1 / math.sqrt(columns), 1 / math.sqrt(columns), generator=g)
        self.weight.requires_grad = False
        self.fuse_lora = False

    def fuse_lora_weight(self) -> None:
        if not self.fuse_lora:
            self.weight.data += self.lora_scaling * torch.matmul(self.lora_left_weight.t(),
                                                                 self.lora_right_weight.t())
        self.fuse_lora = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuse_lora:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) + (x @ self.lora_right_weight @ self.lora_left_weight) \
            * self.lora_scaling


def convert_linear_layer_to_lora(model: nn.Module, part_module_name: str, lora_dim: int) -> nn.Module:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and part_module_name in n]
    for name in names:
        module = recursive_getattr(model, name)
        # DeepSpeed-Chat's moves: on ZeRO-3 partitioned weights, device and dtype of the placeholder.
        lora = LinearLayerLoRA(module.weight, lora_dim, module.bias).to(module.weight.device).to(module.weight.dtype)
        recursive_setattr(model, name, lora)
    return model


def z3_params_to_fetch(params: list[Any]) -> list[nn.Parameter]:
    return [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def convert_lora_to_linear_layer(model: nn.Module) -> nn.Module:
    for name in [n for n, m in model.named_modules() if isinstance(m, LinearLayerLoRA)]:
        module = recursive_getattr(model, name)
        zero_stage_3 = hasattr(module.weight, "ds_id")
        with deepspeed.zero.GatheredParameters(
                z3_params_to_fetch([module.weight, module.bias, module.lora_left_weight, module.lora_right_weight]),
                modifier_rank=0, enabled=zero_stage_3):
            module.fuse_lora_weight()
    return model


def only_optimize_lora_parameters(model: nn.Module) -> nn.Module:
    for name, param in model.named_parameters():
        param.requires_grad = "lora_right_weight" in name or "lora_left_weight" in name
    return model


def get_optimizer_grouped_parameters(model: nn.Module, weight_decay: float, lora_lr: float) -> list[dict[str, Any]]:
    no_decay, lora = ("bias", "norm.weight"), ("lora_right_weight", "lora_left_weight")
    named = [(n.lower(), p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if not any(k in n for k in no_decay + lora)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not any(k in n for k in no_decay) and any(k in n for k in lora)],
         "weight_decay": weight_decay, "lr": lora_lr},
        {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def save_hf_format(model: Any, args: argparse.Namespace) -> None:
    """state_dict() without the LoRA keys, at every stage (placeholders at stage 3, which
    save_zero_three_model then overwrites with the gathered weights)."""
    module = model.module if hasattr(model, "module") else model
    os.makedirs(args.output_dir, exist_ok=True)
    state = {k: v for k, v in module.state_dict().items() if "lora" not in k}
    torch.save(state, os.path.join(args.output_dir, "pytorch_model.bin"))
    module.config.to_json_file(os.path.join(args.output_dir, "config.json"))


def save_zero_three_model(model: Any, global_rank: int, save_dir: str, zero_stage: int) -> None:
    """DeepSpeed-Chat's save: stage 3 gathers each parameter that has `ds_id`; below, state_dict()."""
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, "pytorch_model.bin")
    module = model.module if hasattr(model, "module") else model
    if zero_stage != 3:
        if global_rank == 0:
            torch.save(module.state_dict(), path)
        return
    out = {}
    for k, v in module.named_parameters():
        if hasattr(v, "ds_id"):
            with deepspeed.zero.GatheredParameters(z3_params_to_fetch([v]), enabled=True):
                v_p = v.data.cpu()
        else:
            v_p = v.cpu()
        if global_rank == 0 and "lora" not in k:
            out[k] = v_p
    if global_rank == 0:
        torch.save(out, path)


def main() -> None:
    args = parse_args()
    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()

    ds_config = get_train_ds_config(offload=args.offload, dtype=args.dtype, stage=args.zero_stage)
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = (args.per_device_train_batch_size * torch.distributed.get_world_size()
                                     * args.gradient_accumulation_steps)
    set_random_seed(args.seed)
    if args.global_rank == 0 and not os.path.exists(os.path.join(args.model_name_or_path, "config.json")):
        make_tiny_checkpoint(args.model_name_or_path)
    torch.distributed.barrier()

    model = create_hf_model(args.model_name_or_path, ds_config)
    if args.lora_dim > 0:
        model = convert_linear_layer_to_lora(model, args.lora_module_name, args.lora_dim)
        if args.only_optimize_lora:
            model = only_optimize_lora_parameters(model)
            model.enable_input_require_grads()  # make_model_gradient_checkpointing_compatible

    train_dataset = TokenRows(SAMPLES, args.seed)
    sampler = RandomSampler(train_dataset) if args.local_rank == -1 else DistributedSampler(train_dataset)
    train_dataloader = DataLoader(train_dataset, collate_fn=default_data_collator, sampler=sampler,
                                  batch_size=args.per_device_train_batch_size)

    groups = get_optimizer_grouped_parameters(model, args.weight_decay, args.lora_learning_rate)
    AdamOptimizer = DeepSpeedCPUAdam if args.offload else FusedAdam  # noqa: N806 (DeepSpeed-Chat's name)
    optimizer = AdamOptimizer(groups, lr=args.learning_rate, betas=(0.9, 0.95))
    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=args.num_train_epochs * steps_per_epoch)

    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()

    for epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            start = time.time()
            batch = {k: v.to(device) for k, v in batch.items()}
            outputs = model(**batch, use_cache=False)
            loss = outputs.loss
            # One write per line (text and newline together): the ranks share the launcher's stdout.
            print(f"Epoch: {epoch}, Step: {step}, Rank: {torch.distributed.get_rank()}, loss = {loss.item()!r}\n",
                  end="", flush=True)
            model.backward(loss)
            model.step()
            if torch.distributed.get_rank() == 0:  # print_throughput(model.model, ...)
                hf_model = model.model
                n_params = sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in hf_model.parameters())
                print(f"Model Parameters: {n_params}, Latency: {time.time() - start:.3f}s", flush=True)
        model.tput_timer.update_epoch_count()

    if args.output_dir is not None:
        model = convert_lora_to_linear_layer(model)
        if args.global_rank == 0:
            save_hf_format(model, args)
        if args.zero_stage == 3:  # each rank holds a part of the model: DeepSpeed-Chat's own gather
            save_zero_three_model(model, args.global_rank, args.output_dir, zero_stage=args.zero_stage)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
