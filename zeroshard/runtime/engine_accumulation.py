"""The micro-batch accumulation controls of DeepSpeed's engine: the boundary flag, `no_sync()`,
`coalesce_grad_reduction()`, and the refused `offload_states()` / `reload_states()`.

A mixin of `ZeroEngine` (runtime/engine.py), which owns the state these read and change: the
micro-batch state (`_micro`, runtime/engine_state.py), the strategy and the timers. Kept apart so
engine.py holds the training step itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from zeroshard.errors import NotSupportedError, UsageError
from zeroshard.runtime.engine_state import MicroBatchState, Phase

if TYPE_CHECKING:
    from zeroshard.runtime.monitor import Timers
    from zeroshard.zero.strategy import ZeroStrategy


class AccumulationControl:
    """Which backward passes reduce, and the blocks that defer the reduction."""

    pipeline_parallelism = False
    """DeepSpeed's flag: True on the pipeline engine."""
    strategy: "ZeroStrategy"  # the engine's properties and attributes; gradient_accumulation_steps()
    # is EngineQueries' (a stub here would shadow it: this class comes first in ZeroEngine's bases)
    micro_steps: int
    timers: "Timers"

    def _init_accumulation(self, managed: bool) -> None:
        """`managed`: the config's managed_gradient_accumulation."""
        self._micro = MicroBatchState(managed=managed)
        """The engine's micro-batch state (Note: [micro-batch phases] in runtime/engine_state.py)."""
        self._coalescing = False
        """Inside `coalesce_grad_reduction()` (which also sets `_micro.no_sync`)."""

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

    def offload_states(self, *args: Any, **kwargs: Any) -> None:
        """DeepSpeed's `offload_states`: not built (refused by name)."""
        raise NotSupportedError(
            "engine.offload_states() (DeepSpeed 0.16+) is not implemented in zeroshard: the optimizer "
            "states, master weights and gradients stay where the config puts them. To keep them off the "
            'accelerator, set "zero_optimization": {"offload_optimizer": {"device": "cpu"}} (and '
            '"offload_param" at stage 3).')

    def reload_states(self, *args: Any, **kwargs: Any) -> None:
        """DeepSpeed's `reload_states`: not built (refused by name)."""
        raise NotSupportedError("engine.reload_states() is not implemented in zeroshard (nor is offload_states()): "
                                "there is nothing offloaded to bring back.")

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
