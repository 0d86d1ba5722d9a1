"""The tests/dist helpers (config builder, tiny GPT, batches), driven on the engine's device.

tests/dist feeds CPU batches because its engines live on the CPU; here every batch is moved to
`engine.device` first, as a training script on a GPU does. Nothing else differs, so a GPU test
and its gloo twin train the same model on the same data with the same config.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))

from engine_helpers import (  # tests/dist is not a package
    assert_params_close,
    gathered_snapshot,
    global_batches,
    init_engine,
    make_config,
    make_model,
    rank_micro_batches,
)

__all__ = ["assert_params_close", "gathered_snapshot", "global_batches", "init_engine",
           "make_config", "make_model", "precision_config", "train_on_device"]


def precision_config(stage: int, precision: str, offload: str, **zero: Any) -> dict[str, Any]:
    """tests/dist/test_zero12.py's config: 2 micro-batches per step, active clipping, fp16
    with a small initial scale; offload is "none", "optimizer" or "both" (stage 3)."""
    extra: dict[str, Any] = {}
    if precision == "bf16":
        extra["bf16"] = {"enabled": True}
    if precision == "fp16":
        extra["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 5}
    zero_cfg: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 300, **zero}
    if offload in ("optimizer", "both"):
        zero_cfg["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload == "both":
        zero_cfg["offload_param"] = {"device": "cpu", "pin_memory": True}
    return make_config(gradient_accumulation_steps=2, gradient_clipping=0.05,
                       zero_optimization=zero_cfg, **extra)


def train_on_device(
    engine: Any, batches: list[tuple[Tensor, Tensor]], rank: int, world: int,
    before_backward: Callable[[int, Tensor], Tensor] | None = None,
) -> tuple[list[float], list[list[Tensor]]]:
    """Per-step mean losses and (gathered, fp32, on CPU) parameter snapshots."""
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    device = engine.device
    losses, snapshots = [], []
    for step, batch in enumerate(batches):
        step_loss = torch.zeros((), device=device)
        for x, y in rank_micro_batches(batch, rank, world, micro, gas):
            loss = engine(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            if before_backward is not None:
                loss = before_backward(step, loss)
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float() / gas
        losses.append(float(step_loss))  # one sync per step, as a real loop logs
        snapshots.append([p.cpu() for p in gathered_snapshot(engine.module)])
    return losses, snapshots
