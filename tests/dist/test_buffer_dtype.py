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


class Router(nn.Module):
    """An MoE router as DeepSeek-V3's: a bias buffer whose close values bf16 cannot tell apart."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.register_buffer("e_score_correction_bias", 10.0 + torch.arange(4, dtype=torch.float32) * 1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x).float() + self.e_score_correction_bias.float()


class MoeModel(nn.Module):
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]
    _keep_in_fp32_modules = ["scale"]  # fp32 under fp16 only (Transformers' rule)

    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.rope = Rotary()
        self.register_buffer("scale", torch.tensor(1.0 + 2**-12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.router(x).pow(2).mean() + self.rope(x)) * self.scale.float()


def build_moe(stage: int, precision: str, data_types: dict[str, Any], arrive_low: bool = False) -> Any:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, precision: {"enabled": True},
                           "zero_optimization": {"stage": stage}, "data_types": data_types,
                           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    torch.manual_seed(0)
    model = MoeModel()
    if arrive_low:  # a script that cast the whole model itself before initialize
        model.to(DTYPES[precision])
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("setting, kept", [
    ("auto", {"router.e_score_correction_bias"}),             # the model's strict list
    (None, {"router.e_score_correction_bias"}),               # null is "auto" too
    (["inv_*"], {"rope.inv_freq"}),                           # the config's own patterns replace the lists
    ([], set()),                                              # nothing kept
])
def test_keep_in_fp32_modules_keeps_the_named_buffers(groups: Any, stage: int, precision: str, setting: Any,
                                                      kept: set[str]) -> None:
    """With buffer_dtype set, every other floating buffer takes it; the kept ones are fp32, also
    when the script had cast them down before initialize (upcast; the values are what they were)."""
    if setting in ("auto", None) and precision == "fp16":
        kept = kept | {"scale"}                               # _keep_in_fp32_modules: fp16 only
    engine = build_moe(stage, precision, {"buffer_dtype": precision, "keep_in_fp32_modules": setting})
    low = build_moe(stage, precision, {"buffer_dtype": precision, "keep_in_fp32_modules": setting},
                    arrive_low=True)
    fresh = dict(MoeModel().named_buffers())
    for e in (engine, low):
        for name, buf in e.module.named_buffers():
            assert buf.dtype == (torch.float32 if name in kept else DTYPES[precision]), (name, buf.dtype)
    for name in kept:
        got = dict(engine.module.named_buffers())[name]
        assert torch.equal(got, fresh[name]), name  # never rounded on the way
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(groups.rank)).to(DTYPES[precision])
    engine.backward(engine(x))
    engine.step()
    assert engine.global_steps == 1


def test_keep_in_fp32_modules_has_no_effect_under_fp32(groups: Any) -> None:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
                           "data_types": {"keep_in_fp32_modules": ["*"]},
                           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    model = MoeModel().to(torch.float64)  # a script's own dtype stays as it is, as in DeepSpeed
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert {b.dtype for b in engine.module.buffers()} == {torch.float64}
