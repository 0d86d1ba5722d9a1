"""The engine's checkpoint API: DeepSpeed's `save_checkpoint` / `load_checkpoint`, and zeroshard's
`state()`, `apply_state()`, `wait_for_checkpoint()`, `auto_resume()` (docs/checkpoints.md).

A mixin of `ZeroEngine` (runtime/engine.py): the argument checks, the checkpointer calls and the
log lines. The checkpointer (a `Checkpointer` protocol from checkpoint_format, set by `initialize`)
writes and reads the files; runtime/checkpoint_state.py turns the engine into an `EngineState` and
back. What a checkpoint needs of the micro-batch state (offloaded states, backward passes of an
unfinished step, the reset after a load) the engine answers through three hooks declared here.
Imports neither checkpoint/ nor runtime/engine.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from zeroshard.checkpoint_format import AsyncCheckpointer, Checkpointer, EngineState, LoadedState
from zeroshard.errors import CheckpointArgumentError, CheckpointError
from zeroshard.runtime.auto_resume import auto_resume as resume_newest
from zeroshard.runtime.checkpoint_state import apply_state, collect_state
from zeroshard.runtime.param_access import whole_weights
from zeroshard.runtime.periodic_save import SaveSchedule
from zeroshard.runtime.preemption import Preemption
from zeroshard.zero.init import GatheredParameters
from zeroshard.zero.units import ZeroParameter

if TYPE_CHECKING:
    from torch import nn

    from zeroshard.zero.strategy import ZeroStrategy

logger = logging.getLogger("zeroshard")


class EngineCheckpoints:
    """Saving and loading an engine's state, every rank together."""

    # Provided by ZeroEngine: the wrapped model, its strategy (a property) and the step counter.
    module: "nn.Module"
    strategy: "ZeroStrategy"
    global_steps: int

    checkpointer: Checkpointer | None = None
    """Writes and reads checkpoints; set by `zeroshard.initialize` (a ShardedCheckpointer)."""
    save_schedule: SaveSchedule | None = None
    """Periodic saves (checkpoint.save_interval_steps / save_interval_minutes); set by `initialize`."""
    preemption: Preemption | None = None
    """The emergency save on SIGTERM / SIGUSR1 (checkpoint.preemption_save); set by `initialize`."""

    def state(self, *, include_frozen: bool = False) -> EngineState:
        """This rank's state for a checkpoint: views of the live tensors plus the Manifest.
        Collective: an optimizer step still running late (the delayed update) finishes and is
        published first, so masters, optimizer state and weights are one step's."""
        self.strategy.settle_step()
        return collect_state(self, self.strategy, include_frozen=include_frozen)

    def apply_state(self, loaded: LoadedState, *, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, load_rng_state: bool = False) -> None:
        """Copy what a checkpointer read (for the `EngineState` of `state()`) into this engine.
        RNG states and the data loader's position only with `load_rng_state` (DeepSpeed's rule)."""
        apply_state(self, self.strategy, loaded, load_lr_scheduler_states=load_lr_scheduler_states,
                    load_module_only=load_module_only, load_rng_state=load_rng_state)

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None,
                        client_state: Mapping[str, Any] | None = {},  # DeepSpeed's; never mutated
                        save_latest: bool = True,
                        exclude_frozen_parameters: bool = False, *, save_optimizer_states: bool = True) -> str:
        """Save a checkpoint; every rank must call it (like DeepSpeed's `save_checkpoint`).

        Args:
            save_dir: the checkpoint root; the checkpoint goes to `save_dir/tag/`.
            tag: the checkpoint's name; default `global_step{N}`.
            client_state: any picklable dict, returned by `load_checkpoint`.
            save_latest: point `save_dir/latest` at this tag (after it is complete).
            exclude_frozen_parameters: leave out parameters with requires_grad=False (a frozen
                LoRA base); a load then keeps the model's own values for them. Default False,
                as in DeepSpeed: every parameter is saved.
            save_optimizer_states: False writes weights only (no master weights, no optimizer
                state); such a checkpoint loads with `load_optimizer_states=False`.

        With `checkpoint.async_save` the call returns once this rank's state is copied to host
        memory; the files are written in the background and published at the next save or
        `wait_for_checkpoint()` (docs/checkpoints.md, "Asynchronous and periodic saves").

        Returns:
            The checkpoint's directory.

        Raises:
            CheckpointError: `save_dir` is None or empty (CheckpointArgumentError, also a
                ValueError, as in DeepSpeed), `save_dir` or `tag` differs across
                ranks (refused on every rank before anything is written, whatever
                checkpoint.tag_validation says), the call is in the middle of gradient
                accumulation, or a rank could not write (every rank raises; the previous
                checkpoint and `latest` are untouched).

        Example::

            engine.save_checkpoint("ckpt", client_state={"epoch": 3})
        """
        self._check_states_present("save_checkpoint()")
        if save_dir is None or str(save_dir) == "":
            raise CheckpointArgumentError(f"save_checkpoint: save_dir must name a directory, got {save_dir!r} "
                                          "(nothing was written)")
        if self.checkpointer is None:
            raise CheckpointError("this engine has no checkpointer; build it with zeroshard.initialize()")
        pending = self._pending_backwards()
        if pending:
            raise CheckpointError(
                f"save_checkpoint after {pending} backward pass(es) of an unfinished "
                f"optimizer step (gradient accumulation): accumulated gradients are not saved. "
                "Save right after the engine.step() that ends an optimizer step.")
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        path = self.checkpointer.save(self.state(include_frozen=not exclude_frozen_parameters), str(save_dir),
                                      tag, client_state, save_latest, save_optimizer_states)
        logger.info(f"saved checkpoint {path}")
        return path

    def wait_for_checkpoint(self) -> str | None:
        """Finish the asynchronous save in flight (`checkpoint.async_save`): wait until every
        rank's files are on disk, then write the manifest and switch `latest`. Collective: every
        rank calls it; a no-op without a save in flight. Call it (or `destroy()`) before the
        script exits, or the last asynchronous save stays unpublished.

        Returns:
            The published checkpoint's directory, or None when no save was in flight.

        Raises:
            CheckpointError: on every rank, naming the ranks whose background writer failed and
                why; nothing was published, `latest` names the previous checkpoint.
        """
        return self.checkpointer.wait() if isinstance(self.checkpointer, AsyncCheckpointer) else None

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Callable[..., Any] | None = None, *,
                        load_rng_state: bool = False) -> tuple[str | None, dict[str, Any] | None]:
        """Load a checkpoint saved at any world size and ZeRO stage; every rank must call it.

        DeepSpeed 0.19's signature; every argument is honoured.

        Args:
            load_dir: the checkpoint root given to `save_checkpoint`.
            tag: which checkpoint; default: the one `load_dir/latest` names.
            load_module_strict: False lets parameter names differ between the checkpoint and
                the model: parameters the checkpoint lacks keep their values, extra ones are
                ignored (shapes must still match).
            load_optimizer_states: load fp32 master weights and optimizer state (exact resume);
                False loads the saved low-precision weights only (never opens optimizer files).
            load_lr_scheduler_states: restore the lr scheduler.
            load_module_only: the module's weights only: no optimizer, scheduler, counters,
                random generators or data loader position.
            custom_load_fn: called as `custom_load_fn(src=state_dict, dst=engine.module)` in
                place of the weight copy, on every rank, with the checkpoint's whole
                low-precision state_dict (gathered from the shards at stage 3). The masters
                are then re-initialised from the module's values.
            load_rng_state: also restore what an exact resume needs beyond the model states:
                the Python, NumPy and torch random generators and the position of the data
                loader `initialize` returned, as saved. Off by default, as in DeepSpeed, whose
                load leaves the script's generators (seeded before the load) alone;
                `zeroshard train`-style loops that want the uninterrupted run's samples and
                dropout masks pass True (zeroshard's own keyword; DeepSpeed has none).

        Returns:
            `(checkpoint directory, client_state)`, or `(None, None)` when `load_dir` exists
            but has no `latest` file and no tag was given (nothing saved yet).

        Raises:
            CheckpointError: the tag or a file is missing, truncated or foreign, or the
                checkpoint does not match the model (names, shapes); nothing was changed.
        """
        self._check_states_present("load_checkpoint()")
        if self.checkpointer is None:
            raise CheckpointError("this engine has no checkpointer; build it with zeroshard.initialize()")
        if custom_load_fn is not None:
            return self._load_with_custom_fn(load_dir, tag, custom_load_fn)
        # The target lists frozen parameters too: at stage 3 its pieces must align one to one
        # with the strategy's (a frozen piece the checkpoint lacks keeps its values).
        loaded = self.checkpointer.load(self.state(include_frozen=True), str(load_dir), tag,
                                        load_optimizer_states=load_optimizer_states,
                                        load_module_only=load_module_only, strict=load_module_strict)
        if loaded is None:
            logger.warning(f"{load_dir} has no 'latest' file: no checkpoint loaded")
            return None, None
        self.apply_state(loaded, load_lr_scheduler_states=load_lr_scheduler_states,
                         load_module_only=load_module_only, load_rng_state=load_rng_state)
        self._after_load()
        logger.info(f"loaded checkpoint {loaded.path} (step {self.global_steps})")
        return loaded.path, loaded.client_state if loaded.client_state is not None else {}

    def auto_resume(self, load_dir: str | os.PathLike[str]) -> tuple[str | None, dict[str, Any] | None]:
        """Load the newest complete, verified checkpoint under `load_dir` for an exact resume
        (also the RNG streams and data position); every rank must call it. Damaged or half-written
        tags are skipped with a warning; see docs/checkpoints.md and runtime/auto_resume.py.

        Returns:
            As `load_checkpoint`; `(None, None)` when there is nothing to resume from.

        Raises:
            CheckpointError: the checkpoint's train_batch_size differs from this engine's.

        Example::

            engine.auto_resume("ckpt")  # then train; save_checkpoint("ckpt") every N steps
        """
        return resume_newest(self, load_dir)

    def _load_with_custom_fn(self, load_dir: str | os.PathLike[str], tag: str | None,
                             custom_load_fn: Callable[..., Any]) -> tuple[str | None, dict[str, Any] | None]:
        # The checkpoint is read whole into a scratch copy of the engine's state, then handed to
        # the user's function, as DeepSpeed hands it `state_dict["module"]`.
        target = self.state()
        loaded = self.checkpointer.load(target, str(load_dir), tag,  # type: ignore[union-attr]
                                        load_optimizer_states=False, load_module_only=True)
        if loaded is None:
            logger.warning(f"{load_dir} has no 'latest' file: no checkpoint loaded")
            return None, None
        src = whole_weights(self, loaded)
        with GatheredParameters([p for p in self.module.parameters() if isinstance(p, ZeroParameter)],
                                modifier_rank=0):
            custom_load_fn(src=src, dst=self.module)
        self.strategy.sync_master_from_params()
        logger.info(f"loaded checkpoint {loaded.path} through custom_load_fn")
        return loaded.path, {}

    # -- hooks: the engine's micro-batch state, answered by runtime/engine.py ---------------

    def _check_states_present(self, what: str) -> None:
        """Raise if `what` (a save or a load) cannot run now: the states are offloaded."""
        raise NotImplementedError

    def _pending_backwards(self) -> int:
        """Backward passes of the unfinished optimizer step (gradient accumulation)."""
        raise NotImplementedError

    def _after_load(self) -> None:
        """A load replaced the states: start a fresh optimizer step, no overflow reported."""
        raise NotImplementedError
