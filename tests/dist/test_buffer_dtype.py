"""Buffers under bf16/fp16 at 1/2/3 ranks (DeepSpeed 0.19's rule): parameters take the training
dtype, floating-point buffers keep their own (a rotary embedding's fp32 `inv_freq`) unless
`data_types.buffer_dtype` names one; under fp32 every tensor keeps its dtype."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.zero.init import Init


class Rotary(nn.Module):
    """A linear layer scaled by an fp32 table computed from a buffer, as rotary embeddings are."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(8, dtype=torch.float32) / 8)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.cos(self.inv_freq * 3.0)  # computed in the buffer's dtype
        return (self.proj(x) * table.to(x.dtype)).float().pow(2).mean()


def build(stage: int, precision: str, buffer_dtype: str | None = None, zero_init: bool = False) -> Any:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                           "zero_optimization": {"stage": stage},
                           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    if buffer_dtype is not None:
        cfg["data_types"] = {"buffer_dtype": buffer_dtype}
    torch.manual_seed(0)
    if zero_init:
        with Init():
            model = Rotary()
    else:
        model = Rotary()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_buffers_keep_their_dtype_unless_buffer_dtype_says(groups: Any, stage: int, precision: str) -> None:
    engine = build(stage, precision)
    assert engine.module.proj.weight.dtype == DTYPES[precision]
    assert engine.module.inv_freq.dtype == torch.float32, "the fp32 buffer is kept"
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(groups.rank)).to(DTYPES[precision])
    engine.backward(engine(x))
    engine.step()
    assert engine.global_steps == 1 and engine.module.inv_freq.dtype == torch.float32
    cast = build(stage, precision, buffer_dtype="bf16")
    want = torch.bfloat16 if precision != "fp32" else torch.float32  # unused under fp32, as in DeepSpeed
    assert cast.module.inv_freq.dtype == want
    assert torch.equal(cast.module.inv_freq, engine.module.inv_freq.to(want))


def test_zero_init_model_keeps_its_buffers_and_they_survive_a_checkpoint(groups: Any, shared_dir: Path) -> None:
    engine = build(3, "bf16", zero_init=True)
    assert engine.module.inv_freq.dtype == torch.float32
    want = engine.module.inv_freq.clone()
    engine.save_checkpoint(shared_dir)
    again = build(3, "bf16")
    again.load_checkpoint(shared_dir)
    assert again.module.inv_freq.dtype == torch.float32 and torch.equal(again.module.inv_freq, want)
