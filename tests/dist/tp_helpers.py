"""A tiny LlamaForCausalLM and its plain-torch reference run, for the tensor-parallel tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB, SEQ, MICRO = 96, 8, 2  # 96: the head splits over 2, 3 and 4 ranks


def tiny_llama(seed: int = 0, heads: int = 4, kv_heads: int = 2, hidden: int = 32) -> nn.Module:
    """A 2-layer Llama built from its config (no download), the same on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4 * SEQ,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def batches(steps: int, dp: int, seed: int = 1) -> list[list[torch.Tensor]]:
    """Per step, one [MICRO, SEQ] token batch per data-parallel rank."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(dp)] for _ in range(steps)]


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def reference_run(model: nn.Module, data: list[list[torch.Tensor]], *, lr: float, clip: float,
                  weight_decay: float = 0.0) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Plain torch in one process: per step, each dp shard's loss and the mean of their
    gradients, clipped by the global norm, one AdamW step. Returns the losses and the final weights."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for step in data:
        opt.zero_grad()
        row = []
        for ids in step:
            loss = lm_loss(model, ids)
            (loss / len(step)).backward()
            row.append(loss.item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(row)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def tp_config(tp: int, stage: int, dp: int, *, clip: float = 0.5, lr: float = 1e-3, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": MICRO * dp, "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "gradient_clipping": clip, "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": tp}, "steps_per_print": 1000,
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg
