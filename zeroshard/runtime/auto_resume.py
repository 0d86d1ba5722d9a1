"""Auto-resume: at start, load the newest complete and verified checkpoint with everything an
exact resume needs, keeping the global batch at another data-parallel size.

Two entry points (docs/checkpoints.md, "Verification and auto-resume"): the config's
`checkpoint.auto_resume_dir`, acted on by `initialize()` (which can still recompute
gradient_accumulation_steps before the engine is built), and `engine.auto_resume(load_dir)` for
a script that builds its engine first. Imports runtime/ and config/ only; the engine's
checkpointer (STYLE §1) picks the tag with its `newest_verified`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from zeroshard.config import Config
from zeroshard.errors import CheckpointError, ConfigError, NotSupportedError

if TYPE_CHECKING:
    from zeroshard.runtime.engine_api import EngineView

logger = logging.getLogger("zeroshard")


@runtime_checkable
class ResumeFinder(Protocol):
    """A checkpointer that can pick the tag to resume from (`ShardedCheckpointer`)."""

    def newest_verified(self, load_dir: str | os.PathLike[str]) -> Any:
        """A `Resumable` (`tag`, `path`, `manifest`) agreed by every rank, or None. Collective."""
        ...


def find_resumable(checkpointer: Any, load_dir: str | os.PathLike[str]) -> Any:
    """The newest complete, verified checkpoint under `load_dir` (collective), or None with a note.

    Raises:
        NotSupportedError: the engine's checkpointer cannot choose one (Megatron-style pieces a
            script split itself with an mpu).
    """
    if not isinstance(checkpointer, ResumeFinder):
        raise NotSupportedError(
            "not supported yet: auto-resume (checkpoint.auto_resume_dir) with an mpu (tensor-parallel pieces the "
            "script split itself, issue 42); call engine.load_checkpoint(dir, tag=..., load_rng_state=True)")
    found = checkpointer.newest_verified(load_dir)
    if found is None:
        logger.info(f"auto-resume: no complete, verified checkpoint in {load_dir}; training starts fresh")
    return found


def _fits(batch: int, micro: int, dp: int) -> str:
    """The sizes that keep `batch` samples per step: the micro-batch sizes at `dp` ranks, and the
    data-parallel sizes at micro-batch size `micro`."""
    options = []
    if batch % dp == 0:
        micros = [m for m in range(1, batch // dp + 1) if (batch // dp) % m == 0]
        options.append(f"train_micro_batch_size_per_gpu one of {micros} at data-parallel size {dp}")
    sizes = [d for d in range(1, batch // micro + 1) if batch % (micro * d) == 0]
    if sizes:
        options.append(f"data-parallel size one of {sizes} at train_micro_batch_size_per_gpu {micro}")
    return " or ".join(options) if options else "none with these sizes"


def keep_global_batch(cfg: Config, found: Any) -> Config:
    """`cfg` with gradient_accumulation_steps recomputed so that train_batch_size equals the
    checkpoint's (the same samples per optimizer step at this data-parallel size).

    Raises:
        ConfigError: no whole number of micro-batches gives the saved batch at this size; names
            the sizes that would.
    """
    saved = None if found is None else found.manifest.train_batch_size
    if saved is None or saved == cfg.train_batch_size:
        return cfg
    micro, dp = cfg.train_micro_batch_size_per_gpu, cfg.dp_world_size
    if saved % (micro * dp):
        raise ConfigError(
            f"checkpoint.auto_resume_dir: checkpoint {found.path} was trained with train_batch_size {saved}, which "
            f"is not train_micro_batch_size_per_gpu ({micro}) * gradient_accumulation_steps * data-parallel size "
            f"({dp}) for any whole gradient_accumulation_steps. Sizes that keep it: {_fits(saved, micro, dp)}.")
    gas = saved // (micro * dp)
    logger.warning(f"auto-resume: keeping the global batch of {found.path} ({saved} samples per step): "
                   f"gradient_accumulation_steps {cfg.gradient_accumulation_steps} -> {gas} at data-parallel "
                   f"size {dp} (train_batch_size {cfg.train_batch_size} -> {saved})")
    return dataclasses.replace(cfg, train_batch_size=saved, gradient_accumulation_steps=gas)


def load_resumable(engine: "EngineView", found: Any) -> tuple[str | None, dict[str, Any] | None]:
    """Load `found` into `engine` as an exact resume: model, optimizer, scheduler, loss scaler,
    counters, every random generator and the built-in data loader's position."""
    if found is None:
        return None, None
    saved, ours = found.manifest.train_batch_size, engine.train_batch_size()
    if saved is not None and saved != ours:
        micro, dp = engine.train_micro_batch_size_per_gpu(), engine.zs_config.dp_world_size
        fix = (f"set gradient_accumulation_steps to {saved // (micro * dp)}" if saved % (micro * dp) == 0
               else f"sizes that keep it: {_fits(saved, micro, dp)}")
        raise CheckpointError(
            f"auto-resume: checkpoint {found.path} was trained with train_batch_size {saved}, this engine's is "
            f"{ours}; resuming would change the training maths. {fix[0].upper()}{fix[1:]} (the config's "
            "checkpoint.auto_resume_dir does this at initialize), or load it with engine.load_checkpoint(...) "
            "to change the batch on purpose.")
    path, client = engine.load_checkpoint(Path(found.path).parent, tag=found.tag, load_rng_state=True)
    logger.info(f"auto-resume: resumed from {path} at step {engine.global_steps}")
    return path, client


def auto_resume(engine: "EngineView", load_dir: str | os.PathLike[str]) -> tuple[str | None, dict[str, Any] | None]:
    """`engine.auto_resume(load_dir)`: find (collective) and load the newest verified checkpoint."""
    return load_resumable(engine, find_resumable(engine.checkpointer, load_dir))
