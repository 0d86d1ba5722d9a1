"""DeepSpeed 0.19.x with the same ds_config, on its CPU accelerator over gloo.

DS_ACCELERATOR=cpu must be set before deepspeed is imported (the runner sets it). The CPU
accelerator picks "ccl" when oneccl_bindings_for_pytorch is importable and "gloo" otherwise;
we call `deepspeed.init_distributed(dist_backend="gloo")` so the backend never depends on that.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from engines.common import RunSpec, build_model, ds_config


class DeepSpeedStepper:
    def __init__(self, spec: RunSpec, stage: int, offload: bool | str) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        model = build_model(spec)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(spec, stage, offload))
        self.model = model
        base = getattr(self.optimizer, "optimizer", self.optimizer)  # ZeRO wraps the basic one
        self.optimizer_name = f"{type(base).__name__} (in {type(self.optimizer).__name__})"
        self.device = self.engine.device

    def step(self, x: Tensor, y: Tensor) -> Tensor:
        loss = self.engine(x.to(self.device), y.to(self.device))
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def census_roots(self) -> Iterable[Any]:
        return [self.model, self.optimizer]

    def reported_state_bytes(self) -> int | None:
        return None


def build(spec: RunSpec, stage: int, offload: bool | str = False) -> DeepSpeedStepper:
    return DeepSpeedStepper(spec, stage, offload)
