"""A tiny LlamaForCausalLM and its plain-torch reference run, for the tensor-parallel tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
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
                  weight_decay: float = 0.0,
                  per_row: bool = False) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Plain torch in one process: per step, each dp shard's loss and the mean of their
    gradients, clipped by the global norm, one AdamW step. Returns the losses and the final weights.
    per_row: each shard's rows go through forward and backward one at a time (every row has the same
    token count, so the mean of the row losses is the shard's loss): another summation order only."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for step in data:
        opt.zero_grad()
        row = []
        for ids in step:
            parts = ids.split(1) if per_row else (ids,)
            total = 0.0
            for part in parts:
                loss = lm_loss(model, part)
                (loss / (len(step) * len(parts))).backward()
                total += loss.item() / len(parts)
            row.append(total if per_row else loss.item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(row)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# Note: [tolerances from measured round-off] A tensor-parallel run computes the reference's maths in
# another association: a row-parallel layer sums its input dimension in tp pieces and all-reduces
# them, and the data-parallel ranks add their gradients in another order. Those differences are fp32
# round-off, but Adam amplifies them: an element whose gradient nearly cancels takes a step of up to
# lr of either sign, so after a few steps at lr 1e-3 weights can differ by ~1e-5 (measured: 1.09e-5
# on down_proj with transformers 5.25, under the old fixed 1e-5). So each test's tolerance is derived
# from this run: the reference is computed two more legitimate ways (every nn.Linear summing its input
# dimension in two halves, as TP 2's row split does; each row of a micro-batch back-propagated on its
# own), and the bound is ROUNDOFF_MARGIN x the largest difference either shows, in the losses (per
# run) and in the weights. A real defect (a wrong shard, a missed all-reduce, a skipped clip) moves
# weights by ~lr = 1e-3 after one step; the bounds are checked against that in tests/dist.
ROUNDOFF_MARGIN = 10.0


@contextmanager
def split_reduction_linear() -> Iterator[None]:
    """Every nn.Linear (HF models call F.linear through it) sums its input dimension in two halves."""
    plain = F.linear

    def split(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        k = w.shape[1] // 2
        if k == 0:
            return plain(x, w, b)
        y = plain(x[..., :k], w[:, :k]) + plain(x[..., k:], w[:, k:])
        return y if b is None else y + b

    F.linear = split
    try:
        yield
    finally:
        F.linear = plain


@dataclass(frozen=True)
class Reference:
    """The one-process run and how far round-off alone moves it (Note: [tolerances from measured round-off])."""

    losses: list[list[float]]
    weights: dict[str, torch.Tensor]
    loss_tol: float
    weight_tol: float


def reference(make_model: Callable[[], nn.Module], data: list[list[torch.Tensor]], *, lr: float,
              clip: float) -> Reference:
    losses, weights = reference_run(make_model(), data, lr=lr, clip=clip)
    loss_spread = weight_spread = 0.0
    for per_row, split in ((False, True), (True, False)):
        with split_reduction_linear() if split else _nothing():
            other_losses, other = reference_run(make_model(), data, lr=lr, clip=clip, per_row=per_row)
        loss_spread = max([loss_spread] + [abs(a - b) for x, y in zip(losses, other_losses) for a, b in zip(x, y)])
        weight_spread = max([weight_spread] + [(weights[k] - other[k]).abs().max().item() for k in weights])
    # One fp32 ulp of the largest value: the floor where both other ways happen to round identically.
    eps = torch.finfo(torch.float32).eps
    loss_floor = eps * max(abs(v) for row in losses for v in row)
    weight_floor = eps * max(w.abs().max().item() for w in weights.values())
    ref = Reference(losses, weights, ROUNDOFF_MARGIN * max(loss_spread, loss_floor),
                    ROUNDOFF_MARGIN * max(weight_spread, weight_floor))
    assert ref.weight_tol < lr / 10, f"round-off bound {ref.weight_tol:.2e} is no longer below lr / 10: a test " \
        "could not tell a defect (an lr-sized step) from round-off"
    return ref


@contextmanager
def _nothing() -> Iterator[None]:
    yield


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
