"""`ShardedCheckpointer`: the `Checkpointer` (runtime/checkpointing.py) initialize() gives the engine."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from zeroshard.checkpoint.load import load_state
from zeroshard.checkpoint.save import save_state
from zeroshard.checkpoint_format import EngineState, LoadedState

if TYPE_CHECKING:
    from zeroshard.comm import Comm


class ShardedCheckpointer:
    """One file per rank plus a manifest, written crash-safely; loads at any world size.

    Args:
        comm: collectives over the data-parallel group (the save and load agree on success).
    """

    def __init__(self, comm: "Comm") -> None:
        self._comm = comm

    def save(self, state: EngineState, save_dir: str | os.PathLike[str], tag: str,
             client_state: Mapping[str, Any] | None, save_latest: bool, save_optimizer_states: bool = True) -> str:
        return save_state(state, self._comm, save_dir, tag, client_state, save_latest, save_optimizer_states)

    def load(self, target: EngineState, load_dir: str | os.PathLike[str], tag: str | None, *,
             load_optimizer_states: bool, load_module_only: bool, strict: bool = True) -> LoadedState | None:
        return load_state(target, self._comm, load_dir, tag, load_optimizer_states=load_optimizer_states,
                          load_module_only=load_module_only, strict=strict)
