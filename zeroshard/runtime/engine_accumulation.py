"""The micro-batch accumulation controls of DeepSpeed's engine: the boundary flag, `no_sync()`,
`coalesce_grad_reduction()`, and `offload_states()` / `reload_states()` (runtime/offload_states.py).

A mixin of `ZeroEngine` (runtime/engine.py), which owns the state these read and change: the
micro-batch state (`_micro`, runtime/engine_state.py), the strategy and the timers. Kept apart so
engine.py holds the training step itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.errors import UsageError
from zeroshard.runtime.engine_state import MicroBatchState, Phase
from zeroshard.runtime.offload_states import StateOffload, optimizer_state_tensors, resolve_device, resolve_include

if TYPE_CHECKING:
    from torch import nn

    from zeroshard.runtime.monitor import Timers
    from zeroshard.zero.strategy import ZeroStrategy

logger = logging.getLogger("zeroshard")


class AccumulationControl:
    """Which backward passes reduce, and the blocks that defer the reduction."""

    pipeline_parallelism = False
    """DeepSpeed's flag: True on the pipeline engine."""
    strategy: "ZeroStrategy"  # the engine's properties and attributes; gradient_accumulation_steps()
    # is EngineQueries' (a stub here would shadow it: this class comes first in ZeroEngine's bases)
    micro_steps: int
    timers: "Timers"
    optimizer: "torch.optim.Optimizer | None"
    module: "nn.Module"

    def _init_accumulation(self, managed: bool) -> None:
        """`managed`: the config's managed_gradient_accumulation."""
        self._micro = MicroBatchState(managed=managed)
        """The engine's micro-batch state (Note: [micro-batch phases] in runtime/engine_state.py)."""
        self._coalescing = False
        """Inside `coalesce_grad_reduction()` (which also sets `_micro.no_sync`)."""
        self._offloaded = StateOffload()
        """What `offload_states()` holds until `reload_states()`."""

    def managed_gradient_accumulation(self) -> bool:
        """The config's `managed_gradient_accumulation`: False when every `step()` is the boundary."""
        return self._micro.managed

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-batch is the last of its step (reduction happens).

        Follows the micro-step count, unless `set_gradient_accumulation_boundary` said otherwise.
        """
        return self._micro.is_boundary(self.micro_steps, self.gradient_accumulation_steps())

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the micro-step count: the next `backward` reduces (True) or only
        accumulates (False), and `step()` steps the optimizer only when True. Set it before each
        micro-batch's forward/backward, as in DeepSpeed::

            engine.set_gradient_accumulation_boundary(False)
            for batch in batches[:-1]:
                engine.backward(engine(batch))
            engine.set_gradient_accumulation_boundary(True)
            engine.backward(engine(batches[-1]))
            engine.step()

        Refused under `managed_gradient_accumulation: false`, where every `step()` is the boundary.
        """
        if not self._micro.managed:
            raise UsageError("set_gradient_accumulation_boundary() is not supported with "
                             "managed_gradient_accumulation=False (as in DeepSpeed): the script owns the boundary "
                             "by calling step(), which reduces and steps; drop the call")
        self._micro.boundary_override = bool(is_boundary)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without reducing them; the first
        `backward` outside reduces the sum. `step()` inside raises, as in DeepSpeed.

        Unlike DeepSpeed this also works at stages 2 and 3: their per-micro-batch
        reduce-scatters still run (they are how those stages accumulate), with the same result.
        """
        if self._coalescing:
            raise UsageError("engine.no_sync() inside engine.coalesce_grad_reduction() (DeepSpeed asserts the "
                             "same): the block already accumulates without reducing; drop the inner no_sync()")
        if self._micro.no_sync:
            raise UsageError("engine.no_sync() cannot be re-entered (DeepSpeed: no_sync context manager reentry "
                             "is unsupported): leave the outer block first")
        self._micro.no_sync = True
        try:
            yield
        finally:
            self._micro.no_sync = False

    @contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """Several `backward` calls, one gradient reduction (DeepSpeed 0.19's API): backward passes
        inside accumulate without reducing, whatever `set_gradient_accumulation_boundary` says,
        and leaving the block reduces their sum once, so `step()` can follow::

            with engine.coalesce_grad_reduction():
                for chunk in chunks:
                    engine.backward(engine(chunk))
            engine.step()

        At stages 0 and 1 that is one reduction per step instead of one per backward. At stages
        2 and 3 each backward still reduce-scatters into the gradient shards (they hold no whole
        gradient to accumulate in), with the same result. `step()` inside raises, as does nesting
        it with `no_sync()` either way; a block left by an exception reduces nothing.
        """
        if not self._micro.managed:
            raise UsageError("engine.coalesce_grad_reduction() is not supported with managed_gradient_accumulation="
                             "False (as in DeepSpeed): there every backward already only accumulates and step() "
                             "reduces once; drop the block")
        if self.pipeline_parallelism:
            raise NotImplementedError(
                "engine.coalesce_grad_reduction() is not supported with pipeline parallelism: "
                "train_batch() already reduces the gradients once per batch")
        if self._micro.no_sync:
            raise UsageError("engine.coalesce_grad_reduction() cannot be nested in no_sync() or in itself "
                             "(DeepSpeed asserts the same): leave the outer block first")
        self._micro.no_sync = self._coalescing = True
        before = self._micro.pending_backwards
        try:
            yield
        finally:
            self._micro.no_sync = self._coalescing = False
        if self._micro.pending_backwards > before:
            self._reduce_accumulated()

    def offload_states(self, include: Iterable[Any] | None = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Free the accelerator memory of the training states until `reload_states()` (DeepSpeed
        0.16+'s call, for RLHF loops that generate between training phases).

        Args:
            include: which states (DeepSpeed's `OffloadStateTypeEnum` or their names):
                "optim_states", "hp_params" (master weights), "lp_params" (the parameters and
                stage-3 shards), "lp_grads", "contiguous_grad_buffer" (the staging pool); None:
                all. A storage two states share moves only when both are included.
            device: "cpu" (DeepSpeed's `OffloadDeviceEnum.cpu`); "none" does nothing.
            pin_memory: host copies in pinned memory (with CUDA).
            non_blocking: copies on the stream, not waited for.

        Until `reload_states()`, forward, backward, step and checkpoints raise. States already
        on the host (optimizer offload, CPU training) stay where they are (Note: [offload by
        storage] in runtime/offload_states.py).
        """
        states, target = resolve_include(include), resolve_device(device)
        if target is None:
            logger.warning("offload_states(device=none): nothing was moved")
            return
        if self.optimizer is None:
            raise UsageError("offload_states() on an engine without an optimizer: there are no training states "
                             "to move (DeepSpeed asserts the same)")
        self.strategy.settle_step()  # the delayed update's step in flight writes the masters
        self._offload_with(states, pin_memory=pin_memory, non_blocking=non_blocking, move_host_storages=False)

    def _state_tensors(self) -> dict[str, list["torch.Tensor"]]:
        """The tensors of each offloadable state: the strategy's, the optimizer's state, and the
        module's parameters (frozen ones included) under "lp_params"."""
        tensors = dict(self.strategy.state_tensors())
        tensors["optim_states"] = optimizer_state_tensors(self.optimizer)
        tensors["lp_params"] = [*tensors.get("lp_params", ()), *self.module.parameters()]
        return tensors

    def _offload_with(self, states: set[str], *, pin_memory: bool, non_blocking: bool,
                      move_host_storages: bool) -> int:
        freed = self._offloaded.offload(self._state_tensors(), states, pin_memory=pin_memory, non_blocking=non_blocking,
                                        move_host_storages=move_host_storages)
        if freed and torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.info(f"offload_states: {freed / 2**20:.1f} MiB moved to the host ({', '.join(sorted(states))})")
        return freed

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what `offload_states()` moved, to where it was; without an offload, nothing."""
        if self.optimizer is None:
            raise UsageError("reload_states() on an engine without an optimizer (DeepSpeed asserts the same)")
        back = self._offloaded.reload(non_blocking=non_blocking)
        if back:
            logger.info(f"reload_states: {back / 2**20:.1f} MiB back on the accelerator")

    def _require_states(self, what: str) -> None:
        """Refuse `what` while `offload_states()` holds the states (their storages are empty)."""
        if self._offloaded.active:
            raise UsageError(f"engine.{what} while the training states are offloaded "
                             f"({', '.join(sorted(self._offloaded.states))}): call engine.reload_states() first")

    def _reduce_accumulated(self) -> None:
        """After `coalesce_grad_reduction`: reduce what its backward passes accumulated."""
        if self.strategy.reduces_at_boundary_only():
            self._micro.begin_backward(reduces=True)
            self.strategy.begin_micro_batch(True)
            self.timers.start("reduce_wait")
            self.strategy.after_backward()
            self.timers.stop("reduce_wait")
            self._micro.end_backward()
        else:  # every backward reduced into the shards already
            self._micro.phase = Phase.REDUCED
