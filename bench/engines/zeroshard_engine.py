"""zeroshard at stages 0-3, with and without CPU offload, driven by the shared ds_config."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from engines.common import RunSpec, build_model, ds_config


class ZeroshardStepper:
    def __init__(self, spec: RunSpec, stage: int, offload: bool | str) -> None:
        import zeroshard

        model = build_model(spec)
        self.engine, self.optimizer, _, _ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(spec, stage, offload))
        self.model = model
        self.optimizer_name = type(self.optimizer).__name__
        self.device = self.engine.device

    def step(self, x: Tensor, y: Tensor) -> Tensor:
        loss = self.engine(x.to(self.device), y.to(self.device))
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def census_roots(self) -> Iterable[Any]:
        return [self.model, self.optimizer, getattr(self.engine, "_strategy", None)]

    def reported_state_bytes(self) -> int | None:
        return sum(s.total for s in self.engine.model_state_bytes())


def build(spec: RunSpec, stage: int, offload: bool | str = False) -> ZeroshardStepper:
    return ZeroshardStepper(spec, stage, offload)
