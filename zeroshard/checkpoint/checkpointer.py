"""`ShardedCheckpointer`: the `Checkpointer` (runtime/checkpoint_state.py) initialize() gives the engine.

Saves zeroshard's format; loads zeroshard's (a pipeline's too: checkpoint/pipe_files.py) and DeepSpeed
0.19's (checkpoint/ds_import.py; its AutoTP files: checkpoint/ds_autotp.py; its universal
checkpoints: checkpoint/ds_universal.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zeroshard.checkpoint.agreed import reads_in_turn
from zeroshard.checkpoint.async_save import AsyncSaver
from zeroshard.checkpoint.ds_autotp import is_autotp, load_autotp
from zeroshard.checkpoint.ds_import import find_deepspeed, load_deepspeed
from zeroshard.checkpoint.ds_universal import find_universal, load_universal
from zeroshard.checkpoint.load import load_state
from zeroshard.checkpoint.pipe_files import find_pipeline, load_pipeline_into_plain
from zeroshard.checkpoint.recovery import write_recovery_script
from zeroshard.checkpoint.retention import Deleter, prune
from zeroshard.checkpoint.save import save_state
from zeroshard.checkpoint.verify import Resumable, newest_verified
from zeroshard.checkpoint_format import EngineState, LoadedState

if TYPE_CHECKING:
    from zeroshard.comm import Comm


class ShardedCheckpointer:
    """One file per rank plus a manifest, written crash-safely; loads at any world size.

    Args:
        comm: collectives over the data-parallel group (the save and load agree on success).
        node_leader: with `checkpoint.use_node_local_storage`, the first rank of this rank's
            node, which writes the node's directory (Note: [node-local storage] in save.py);
            None: one directory every rank shares.
        async_save: `checkpoint.async_save`: `save` snapshots the state to host memory and
            returns; a background thread writes, and the next join publishes (Note: [async
            save] in async_save.py). A join is the next `save`, `wait`, `load` or
            `newest_verified`.
        keep_last: `checkpoint.keep_last`: after each publish, keep the newest K complete tags
            of the directory saved into (checkpoint/retention.py); 0 keeps all.
        prefer_universal: `checkpoint.load_universal`: a load without a tag reads
            `latest_universal` (DeepSpeed's converter writes it) even where `latest` exists;
            without it, `latest_universal` is read only where there is no `latest`.
    """

    def __init__(self, comm: "Comm", node_leader: int | None = None, *, async_save: bool = False,
                 keep_last: int = 0, prefer_universal: bool = False) -> None:
        self._comm = comm
        self._prefer_universal = prefer_universal
        self._node_leader = node_leader
        self._async = AsyncSaver(comm, node_leader) if async_save else None
        self._keep_last = keep_last
        self._deleter = Deleter()  # retired tags are deleted off the training thread (retention.py)

    def save(self, state: EngineState, save_dir: str | os.PathLike[str], tag: str,
             client_state: Mapping[str, Any] | None, save_latest: bool, save_optimizer_states: bool = True) -> str:
        if self._async is not None:
            self._join()  # one save in flight at a time: the previous one is published (or raises) first
            self._async.start(state, save_dir, tag, client_state, save_latest, save_optimizer_states)
            return str(Path(save_dir) / tag)
        published = save_state(state, self._comm, save_dir, tag, client_state, save_latest, save_optimizer_states,
                               node_leader=self._node_leader)
        if published:
            self._after_publish(save_dir)
        return str(Path(save_dir) / tag)

    def wait(self) -> str | None:
        """Join the asynchronous save in flight, if any: wait for every rank's writer, then
        publish (collective). Returns the published checkpoint's directory, None when none was
        in flight.

        Raises:
            CheckpointError: on every rank, naming the ranks whose writer failed and why;
                nothing was published and `latest` names the previous checkpoint.
        """
        try:
            return self._join()
        finally:
            self._deleter.join()  # a script that waits sees the directory as keep_last leaves it

    def _join(self) -> str | None:
        target = self._async.join() if self._async is not None else None
        if target is None:
            return None
        if target.writer:
            self._after_publish(target.root)
        return str(target.root / target.tag)

    def _after_publish(self, save_dir: str | os.PathLike[str]) -> None:
        write_recovery_script(save_dir)  # DeepSpeed's zero_to_fp32.py, for its documented workflow
        prune(save_dir, self._keep_last, self._deleter)

    def load(self, target: EngineState, load_dir: str | os.PathLike[str], tag: str | None, *,
             load_optimizer_states: bool, load_module_only: bool, strict: bool = True) -> LoadedState | None:
        self.wait()  # a save in flight is published first: `latest` may be about to name it
        pipe = find_pipeline(load_dir, tag)
        if pipe is not None:  # a pipeline's checkpoint into this model without a pipeline (pipe_files.py)
            return load_pipeline_into_plain(target, self._comm, *pipe, load_optimizer_states=load_optimizer_states,
                                            load_module_only=load_module_only, strict=strict)
        universal = find_universal(load_dir, tag, self._prefer_universal)
        if universal is not None:  # ds_to_universal's output (ds_universal.py), at any layout
            return load_universal(target, self._comm, universal, load_optimizer_states=load_optimizer_states,
                                  load_module_only=load_module_only, strict=strict)
        # A tag directory DeepSpeed wrote (no zeroshard manifest) is read in place (ds_import.py).
        ds_ckpt = find_deepspeed(load_dir, tag)
        if ds_ckpt is not None and is_autotp(ds_ckpt):  # AutoTP: one file set per TP rank (ds_autotp.py)
            return load_autotp(target, self._comm, ds_ckpt, load_optimizer_states=load_optimizer_states,
                               load_module_only=load_module_only, strict=strict)
        if ds_ckpt is not None:
            return load_deepspeed(target, self._comm, ds_ckpt, load_optimizer_states=load_optimizer_states,
                                  load_module_only=load_module_only, strict=strict)
        return load_state(target, self._comm, load_dir, tag, load_optimizer_states=load_optimizer_states,
                          load_module_only=load_module_only, strict=strict)

    def newest_verified(self, load_dir: str | os.PathLike[str]) -> Resumable | None:
        """The newest complete, verified tag under `load_dir`, agreed by every rank (auto-resume;
        checkpoint/verify.py). Collective."""
        self.wait()
        return newest_verified(self._comm, load_dir)


class InTurnCheckpointer:
    """`zero_optimization.pipeline_loading_checkpoint`: the checkpointer it wraps, with each
    load's reads made one local rank at a time (Note: [reads in turn] in save.py), to bound a
    node's host memory while a large checkpoint loads. Saves are unchanged."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def save(self, state: EngineState, save_dir: str | os.PathLike[str], tag: str,
             client_state: Mapping[str, Any] | None, save_latest: bool, save_optimizer_states: bool = True) -> str:
        return self._inner.save(state, save_dir, tag, client_state, save_latest, save_optimizer_states)

    def load(self, target: EngineState, load_dir: str | os.PathLike[str], tag: str | None, *,
             load_optimizer_states: bool, load_module_only: bool, strict: bool = True) -> LoadedState | None:
        with reads_in_turn(True):
            return self._inner.load(target, load_dir, tag, load_optimizer_states=load_optimizer_states,
                                    load_module_only=load_module_only, strict=strict)

    def newest_verified(self, load_dir: str | os.PathLike[str]) -> Resumable | None:
        return self._inner.newest_verified(load_dir)

    def wait(self) -> str | None:
        return self._inner.wait()
