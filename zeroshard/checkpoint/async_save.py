"""Asynchronous saves (`checkpoint.async_save`): snapshot this rank's state to host memory, write
its files on a background thread, publish at the next join. Imports comm/ (types only),
checkpoint/ and checkpoint_format only.

Note: [async save] A save is split at the points where ranks must agree (checkpoint/save.py):

    at save_checkpoint (caller's thread, collective)   join the previous save (below); check the
                                                        target; prepare `.TAG.partial/`; copy the
                                                        state to host memory; start the writer
    writer thread (no collectives)                      this rank's files: temp, fsync, rename;
                                                        fsync the directory
    at the next join (caller's thread, collective)      agree every rank's files are durable,
                                                        gather sizes and checksums, then the
                                                        manifest, the rename and `latest`

A join is the next `save_checkpoint`, `engine.wait_for_checkpoint()`, a load, or `engine.destroy()`:
points every rank reaches in the same order, so the agreement is an ordinary collective on the
training group. The writer thread never issues one: a second thread's collectives on the same
group would interleave with training's in a different order on each rank (a mismatch or a hang),
and a group of its own would be one more communicator per job for three small messages per save.
Until the join, `latest` names the previous checkpoint; a process killed anywhere in between
leaves that one as the newest complete one (no manifest, no rename: the staging directory is
not a tag).

Why a thread, not a process: the snapshot would have to be copied again into shared memory (or
pickled through a pipe), and a forked child of a process holding a process group or a CUDA
context is unsafe. The writer's work -- the bytes through `torch.save`, crc32, `write`, `fsync`
-- runs with the GIL released for the large buffers, so the training thread keeps running.
Why not `torch.distributed.checkpoint.async_save`: it writes DCP's format (`.distcp` files and
a `.metadata` plan) through its planner, and its background stage runs collectives (on a gloo
group it creates). zeroshard's format is torch.save files with DeepSpeed's names, a manifest
with layouts and crc32s computed while writing, and a crash-safe publish; DCP's machinery would
replace the format, not write it.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from zeroshard.checkpoint.save import SaveTarget, begin_save_state, end_save_state, write_rank_files
from zeroshard.checkpoint_format import EngineState, pickle_bytes

if TYPE_CHECKING:
    from zeroshard.comm import Comm

logger = logging.getLogger("zeroshard")


class HostSnapshot:
    """Copies of a state's tensors in host memory, reusing the previous save's buffers.

    A joined save's buffers are free (its files are written), so the next snapshot copies into
    them when the tensors line up (same order, shapes and dtypes: the usual case, the same model
    saved again), and allocation and first-touch page faults are paid once per run, not per save.
    CUDA tensors go to pinned buffers with non-blocking copies and one synchronize at the end.
    """

    def __init__(self) -> None:
        self._pool: list[Tensor] = []  # host buffers, in the order `take` walks a state

    def take(self, state: EngineState, client_state: Mapping[str, Any] | None) -> tuple[EngineState, bytes | None]:
        """`state` with every tensor copied (every other value deep-copied), and `client_state`
        pickled now: what the script passes may change after save_checkpoint returns."""
        used: list[Tensor] = []
        cuda = [False]

        copies: dict[int, Tensor] = {}  # one copy per tensor object: a tensor listed twice stays shared

        def copy_of(t: Tensor) -> Tensor:
            if id(t) in copies:
                return copies[id(t)]
            i = len(used)
            reuse = i < len(self._pool) and self._pool[i].shape == t.shape and self._pool[i].dtype == t.dtype
            if reuse:
                out = self._pool[i]
            else:
                out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            out.copy_(t.detach(), non_blocking=t.is_cuda)
            cuda[0] |= t.is_cuda
            used.append(out)
            copies[id(t)] = out
            return out

        def walk(value: Any) -> Any:
            if isinstance(value, Tensor):
                return copy_of(value)
            if isinstance(value, dict):
                return {k: walk(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                items = [walk(v) for v in value]
                return items if isinstance(value, list) else tuple(items)
            return copy.deepcopy(value)

        snap = replace(state, masters=walk(state.masters), optimizer_states=walk(state.optimizer_states),
                       param_groups=walk(state.param_groups), module=walk(state.module),
                       weight_pieces=walk(state.weight_pieces), run_state=walk(state.run_state), rng=walk(state.rng))
        if cuda[0]:
            torch.cuda.synchronize()
        self._pool = used
        return snap, pickle_bytes(dict(client_state)) if client_state is not None else None


@dataclass
class InFlightSave:
    """One save between its start and its join: the target, the snapshot, the writer's result."""

    target: SaveTarget
    state: EngineState
    save_latest: bool
    save_optimizer_states: bool
    started_s: float = field(default_factory=time.monotonic)
    sizes: list[int] = field(default_factory=lambda: [0] * 8)
    error: str | None = None
    thread: threading.Thread | None = None

    def write(self, client_blob: bytes | None) -> None:
        """The writer thread's body: this rank's files, durable; every failure is kept for the join."""
        try:
            self.sizes, self.error = write_rank_files(self.target, self.state, client_blob, self.save_optimizer_states)
        except Exception as e:  # a thread's exception would otherwise be lost
            self.error = f"writing to {self.target.staging}: {type(e).__name__}: {e}"


class AsyncSaver:
    """The asynchronous half of `ShardedCheckpointer` (Note: [async save]).

    Args:
        comm: the group every rank of the checkpoint belongs to (the joins' collectives).
        node_leader: as for `save_state` (node-local storage).
    """

    def __init__(self, comm: "Comm", node_leader: int | None = None) -> None:
        self._comm = comm
        self._node_leader = node_leader
        self._snapshot = HostSnapshot()
        self._in_flight: InFlightSave | None = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def start(self, state: EngineState, save_dir: str | os.PathLike[str], tag: str,
              client_state: Mapping[str, Any] | None, save_latest: bool, save_optimizer_states: bool) -> None:
        """Prepare the directories (collective), snapshot `state`, start the writer; returns
        while the files are written. The caller has joined any previous save."""
        if self._in_flight is not None:
            raise AssertionError("expected the previous asynchronous save to be joined before the next starts")
        target = begin_save_state(state, self._comm, save_dir, tag, self._node_leader)
        started = time.monotonic()
        try:
            snap, client_blob = self._snapshot.take(state, client_state)
        except Exception as e:  # e.g. out of host memory: kept for the join, which every rank reaches
            save = InFlightSave(target, state, save_latest, save_optimizer_states,
                                error=f"copying the state to host memory: {type(e).__name__}: {e}")
        else:
            save = InFlightSave(target, snap, save_latest, save_optimizer_states)
            save.thread = threading.Thread(target=save.write, args=(client_blob,), daemon=True,
                                           name=f"zeroshard-save-{tag}")
            save.thread.start()
        self._in_flight = save
        logger.debug(f"save {tag}: snapshot in {time.monotonic() - started:.3f}s; writing in the background")

    def join(self) -> SaveTarget | None:
        """Wait for the writer, then agree and publish (collective: every rank calls it, in the
        same order as its other collectives). Returns the published save's target, or None when
        none was in flight.

        Raises:
            CheckpointError: on every rank, when any rank's writer failed (naming the ranks and
                their errors) or publishing failed; nothing is published and `latest` still names
                the previous checkpoint. The failed save's staging directory is removed.
        """
        save, self._in_flight = self._in_flight, None
        if save is None:
            return None
        if save.thread is not None:
            save.thread.join()
        target = save.target
        try:
            end_save_state(target, save.state, self._comm, save.sizes, save.error, save.save_latest,
                           save.save_optimizer_states, what=f"writing checkpoint {target.tag} in the background")
        except Exception:
            if target.writer:
                shutil.rmtree(target.staging, ignore_errors=True)
            raise
        logger.info(f"saved checkpoint {target.root / target.tag} (written in the background, "
                    f"{time.monotonic() - save.started_s:.2f}s after the save call)")
        return target

