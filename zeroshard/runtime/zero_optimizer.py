"""`engine.optimizer`: DeepSpeed's ZeRO optimizer surface over the torch optimizer the engine steps.

Clients read DeepSpeed's names off `engine.optimizer` (TRL: `parameter_offload`; Accelerate:
`overflow`; DeepSpeed's tests: `loss_scaler`, `cur_scale`). The object answers them from the
engine's collaborators (the loss scaler, the strategy's hook handles) and leaves the torch
optimizer's state where it was. Imports `runtime.loss_scaler` and `zero` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.runtime.loss_scaler import LossScaler, StaticLossScaler

if TYPE_CHECKING:
    from zeroshard.zero.parameter_offload import ParameterOffload


class ZeroOptimizer(torch.optim.Optimizer):
    """The optimizer a ZeRO engine exposes, as DeepSpeed's `DeepSpeedZeroOptimizer` does.

    `param_groups`, `state` and `defaults` are the wrapped optimizer's own objects (an lr
    scheduler built on either sees the same groups); `step`, `zero_grad`, `state_dict` and
    `load_state_dict` are the wrapped optimizer's. Any other public name is looked up on the
    wrapped optimizer. The engine calls `step()` after the strategy reduced, unscaled and
    clipped the gradients; a script calling it itself steps the master weights with whatever
    gradients they hold, as before.

    Args:
        optimizer: the torch optimizer stepping on the master parameters (`.optimizer`).
        loss_scaler: the engine's fp16 loss scaler; None (bf16, fp32) reads as a static 1.0,
            as DeepSpeed's ZeRO optimizers carry a `LossScaler(scale=1.0)` there.
        parameter_offload: the stage-3 hook handles (zero/parameter_offload.py); None below
            stage 3, where, as in DeepSpeed, the attribute does not exist.
        states: the engine's `offload_states` and `reload_states` (DeepSpeed's ZeRO optimizers
            carry both; OpenRLHF calls them on `engine.optimizer`); None: the names are absent.

    Attributes:
        optimizer: the wrapped torch optimizer (DeepSpeed's name).
        overflow: whether the last optimizer step was skipped for an fp16 overflow.

    Example::

        engine, optimizer, _, _ = zeroshard.initialize(model=model, config=cfg)
        optimizer is engine.optimizer               # True, as in DeepSpeed
        optimizer.cur_scale                         # the fp16 loss scale (1.0 under bf16/fp32)
        offload = optimizer.parameter_offload       # stage 3: TRL's generation hooks
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, loss_scaler: LossScaler | None,
                 parameter_offload: "ParameterOffload | None",
                 states: "tuple[Callable[..., None], Callable[..., None]] | None" = None) -> None:
        # torch.optim.Optimizer.__init__ is not called: the groups and state stay the wrapped
        # optimizer's objects, not copies (an lr scheduler built on either must see the same).
        self.optimizer = optimizer
        self._loss_scaler = loss_scaler if loss_scaler is not None else StaticLossScaler(1.0)
        self._parameter_offload = parameter_offload
        self._states = states
        self.overflow = False

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this object lacks: the wrapped optimizer's own (an NVMe
        # optimizer's `swap`, a 1-bit optimizer's settings). Private names are never forwarded.
        if name.startswith("_") or name == "optimizer":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.optimizer, name)

    # -- the torch optimizer's state, shared --------------------------------------------------

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self.optimizer!r})"

    # -- DeepSpeed's ZeRO optimizer names ------------------------------------------------------

    @property
    def loss_scaler(self) -> LossScaler:
        """The loss scaler: the fp16 dynamic (or static) one, or a static 1.0 under bf16/fp32."""
        return self._loss_scaler

    @property
    def cur_scale(self) -> float:
        """The current loss scale (DeepSpeed's name; 1.0 under bf16/fp32)."""
        return self._loss_scaler.loss_scale

    @property
    def loss_scale(self) -> float:
        return self._loss_scaler.loss_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        return self._loss_scaler.dynamic

    @property
    def parameter_offload(self) -> "ParameterOffload":
        """Stage 3's hook handles (zero/parameter_offload.py). Below stage 3 there is none and
        the attribute is absent (`hasattr` is False), as in DeepSpeed."""
        if self._parameter_offload is None:
            raise AttributeError("'ZeroOptimizer' object has no attribute 'parameter_offload' "
                                 "(it exists at ZeRO stage 3 only, as in DeepSpeed)")
        return self._parameter_offload

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """The engine's `offload_states` (DeepSpeed's ZeRO optimizers have the same call)."""
        self._engine_states("offload_states")[0](include=include, device=device, pin_memory=pin_memory,
                                                  non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """The engine's `reload_states`."""
        self._engine_states("reload_states")[1](non_blocking=non_blocking)

    def _engine_states(self, name: str) -> "tuple[Callable[..., None], Callable[..., None]]":
        if self._states is None:
            raise AttributeError(f"'ZeroOptimizer' object has no attribute {name!r} (this optimizer was built "
                                 f"without an engine; call engine.{name}() instead)")
        return self._states
