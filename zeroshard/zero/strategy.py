"""The interface between the engine and a ZeRO stage.

The engine never asks which stage it runs; it calls these methods in this order for every
micro-batch and step (Note: [step protocol]):

    begin_micro_batch(boundary)      before the forward of each micro-batch
    ... forward, loss.backward() ...  gradient hooks fire; buckets launch at the boundary
    after_backward()                  the boundary micro-batch: all reductions finished
    prepare_step(grad_scale, max_norm) -> GradStats   norm, overflow; grads scaled and clipped
    optimizer.step()                  only when not overflowed
    after_step(applied)               copy master weights back; reset gradient state
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Protocol

from torch import nn


@dataclass(frozen=True, slots=True)
class GradStats:
    """The global gradient norm of one step.

    `norm` is the L2 norm over all parameters of the data-parallel averaged, unscaled
    gradient, before clipping (the same meaning at every stage). `overflow` is True when any
    gradient element on any rank was inf or nan; the step is then skipped everywhere.
    """

    norm: float
    overflow: bool


@dataclass(frozen=True, slots=True)
class ModelStateBytes:
    """Bytes of model states held by this rank, by category and home."""

    params: int
    grads: int
    master_params: int
    optimizer_states: int
    device: str
    """The device type where these bytes live ("cpu", "cuda")."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master_params + self.optimizer_states


class ZeroStrategy(Protocol):
    """One ZeRO stage. See Note: [step protocol] in this module's docstring."""

    @property
    def optimizer_params(self) -> list[nn.Parameter]:
        """The parameters the optimizer steps on (fp32 master weights or the model's own)."""
        ...

    def master_params_for(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """What the optimizer steps on in place of the model's `params`, on this rank.

        Stage 0: one master per parameter. Stages 1/2: the fragment of each parameter inside
        this rank's shard, skipping parameters this rank owns no part of.
        """
        ...

    def begin_micro_batch(self, boundary: bool) -> None: ...

    def after_backward(self) -> None: ...

    def prepare_step(self, grad_scale: float, max_norm: float) -> GradStats: ...

    def after_step(self, applied: bool) -> None: ...

    def model_state_bytes(self, optimizer_state_bytes: int) -> list[ModelStateBytes]: ...
