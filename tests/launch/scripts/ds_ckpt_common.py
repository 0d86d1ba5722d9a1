"""What the DeepSpeed-checkpoint workers share: the model, the data, the config, the loss record.

Imports neither DeepSpeed nor zeroshard's runtime: both engines take the same ds_config dict.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zeroshard.examples.gpt import GPT, GPTConfig

J, STEPS, GLOBAL_BATCH = 3, 4, 6
CFG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16, tie_weights=True)
FROZEN = "wpe.weight"
"""A frozen parameter (no optimizer state in either format)."""


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(CFG)
    dict(model.named_parameters())[FROZEN].requires_grad_(False)
    return model


def model_parameters(model: GPT, case: str) -> list[Any]:
    """"-groups": two parameter groups (no weight decay on 1-D tensors), as real trainings have."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not case.endswith("-groups"):
        return params
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]


def batches(seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(J + STEPS):
        tokens = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.block_size + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def parse_case(case: str) -> tuple[int, str, bool]:
    """"s2-bf16-offload" -> (2, "bf16", True); a "-acc32" suffix accumulates gradients in fp32."""
    parts = case.split("-")
    return int(parts[0][1:]), parts[1], "offload" in parts


def ds_config(case: str, world: int, stage: int | None = None) -> dict[str, Any]:
    """The config of `case` at `world` ranks (`stage`: override the ZeRO stage, for zeroshard)."""
    saved_stage, precision, offload = parse_case(case)
    stage = saved_stage if stage is None else stage
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 2000}
    if stage in (1, 2):
        zero["allgather_bucket_size"] = 2000
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 100
    if offload and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": GLOBAL_BATCH // world,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                     "warmup_num_steps": 5}},
        "zero_optimization": zero,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        # No scale growth within the run: on a growth step DeepSpeed halves the update, which
        # zeroshard deliberately does not (docs/deepspeed-differences.md); the scaler's state
        # (scale, iteration, last overflow) is still restored and used.
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
    if "-sub" in case:  # stage 3: several optimizer sub-groups per parameter group
        zero["sub_group_size"] = 1000
    if case.endswith("-acc32"):  # stage 1 with bf16: DeepSpeed's BF16_Optimizer (another file layout)
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def _mean_over_ranks(value: float, world: int) -> float:
    if world == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / world


def step_losses(engine: Any, data: list[tuple[Tensor, Tensor]], rank: int, world: int, gas: int) -> list[float]:
    """Train over `data` (global batches); the global-mean loss of each step."""
    out = []
    for x, y in data:
        total = 0.0
        for m in range(gas):
            i = m * world + rank
            loss = engine(x[i : i + 1], y[i : i + 1])
            engine.backward(loss)
            engine.step()
            total += float(loss.float().item()) / gas
        out.append(_mean_over_ranks(total, world))
    return out
