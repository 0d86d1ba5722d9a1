"""DeepSpeed's `optimizer.parameter_offload` at stage 3: the handles of the strategy's module hooks.

Generation loops (TRL's `unwrap_model_for_generation`, DeepSpeed's own of that name) gather every
parameter, remove these hooks, generate, and register them again. This module only holds the
handles and the names clients call; the hooks themselves are zero/stage3.py's. Imports nothing
of ours but ``errors``.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Protocol

from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroshard.errors import UsageError


class ModuleHookOwner(Protocol):
    """The stage-3 strategy as `ParameterOffload` sees it."""

    def install_module_hooks(self) -> tuple[list[RemovableHandle], list[RemovableHandle]]:
        """Register the gather/release hooks on the units' modules; returns (forward, backward)
        handles: the units' pre/post-forward hooks, and the frozen-read hooks backward needs."""
        ...

    def forget_order(self) -> None:
        """Drop the recorded unit order; the next training forward records it again."""
        ...

    def order_recorded(self) -> bool:
        """Whether any unit order is recorded (False: the next training forward records one)."""
        ...


class ParamCoordinator:
    """DeepSpeed's `PartitionedParameterCoordinator` trace queries over the strategy's recorded
    unit order (zero/schedule.py's `ExecutionOrder`): "invalid" = nothing recorded yet."""

    def __init__(self, owner: ModuleHookOwner) -> None:
        self._owner = owner

    def is_invalid_trace(self) -> bool:
        return not self._owner.order_recorded()

    def _invalidate_trace(self) -> None:
        """Record the unit order again on the next training forward (TRL calls this after
        generation). DeepSpeed raises on an already invalid trace; so does this (a RuntimeError)."""
        if self.is_invalid_trace():
            raise UsageError("parameter_offload.param_coordinator._invalidate_trace(): attempted to invalidate "
                             "already invalid trace (nothing is recorded; check is_invalid_trace() first, as TRL does)")
        self._owner.forget_order()


def _no_external_parameters(self: nn.Module) -> tuple[tuple[str, nn.Parameter], ...]:
    # zeroshard gathers a parameter used outside its module on demand (zero/init.py's
    # register_external_parameter records nothing), so no module has external parameters.
    return ()


class ParameterOffload:
    """`engine.optimizer.parameter_offload` (DeepSpeed's `DeepSpeedZeRoOffload`), at stage 3 only.

    Attributes:
        module: the model whose units the hooks gather and release.
        forward_hooks: handles of the units' pre- and post-forward hooks (gather / release).
        backward_hooks: handles of the hooks that prepare backward (frozen-weight reads).
        param_coordinator: the recorded-order queries (`is_invalid_trace`, `_invalidate_trace`).

    TRL removes and re-adds the hooks around generation, inside `GatheredParameters`::

        offload = engine.optimizer.parameter_offload
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        ...  # generate: every parameter is gathered, no hook runs
        offload._register_deepspeed_module(offload.module)

    With the hooks removed, a forward outside a gather raises PartitionedParameterError.
    """

    def __init__(self, owner: ModuleHookOwner, module: nn.Module,
                 handles: tuple[list[RemovableHandle], list[RemovableHandle]],
                 persistent_parameters: Iterable[nn.Parameter]) -> None:
        self._owner = owner
        self.module = module
        self.forward_hooks, self.backward_hooks = handles
        self.param_coordinator = ParamCoordinator(owner)
        self.persistent_parameters = list(persistent_parameters)
        for m in module.modules():  # DeepSpeed gives every module this method (TRL calls it)
            if not hasattr(m, "ds_external_parameters"):
                m.ds_external_parameters = types.MethodType(_no_external_parameters, m)

    def get_param_coordinator(self) -> ParamCoordinator:
        return self.param_coordinator

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """Register the hooks again (DeepSpeed's name; TRL's `add_hooks` calls it with `module`).

        Handles still held are removed first, so calling it twice never doubles a hook. The
        recorded unit order is dropped (as DeepSpeed invalidates its trace) and recorded again by
        the next training forward; the numbers of training do not depend on it.

        Raises:
            UsageError: `module` is not the engine's model (`self.module`): zeroshard's
                hooks are installed for the whole model at once.
        """
        if module is not self.module:
            raise UsageError(
                f"parameter_offload._register_deepspeed_module({type(module).__name__}): zeroshard registers "
                "the stage-3 hooks of the whole model at once; pass parameter_offload.module")
        for hook in self.forward_hooks + self.backward_hooks:
            hook.remove()
        self.forward_hooks, self.backward_hooks = self._owner.install_module_hooks()
        if not self.param_coordinator.is_invalid_trace():
            self.param_coordinator._invalidate_trace()
