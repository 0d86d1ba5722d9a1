"""Periodic saves (`checkpoint.save_interval_steps`, `checkpoint.save_interval_minutes`): when the
engine saves at the end of an optimizer step. Imports comm/ and config/ only.

Every rank must decide alike, since a save is collective: the step count is the same everywhere,
a clock is not, so a time-based decision is rank 0's, shared by a 1-element all-reduce at each
optimizer step while `save_interval_minutes` is set.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from zeroshard.comm import Comm
from zeroshard.config import CheckpointConfig


class SaveSchedule:
    """When to save and where (`checkpoint.save_dir`); `initialize()` gives one to the engine.

    Args:
        section: the `checkpoint` config section.
        comm: a group of every rank that saves (the world: pipeline stages save together).
    """

    def __init__(self, section: CheckpointConfig, comm: Comm) -> None:
        if section.save_dir is None:
            raise AssertionError("expected checkpoint.save_dir with a periodic save (config/load.py checks it)")
        self.save_dir: Path = section.save_dir
        self._every_steps = section.save_interval_steps
        self._every_s = section.save_interval_minutes * 60.0
        self._comm = comm
        self._last_s = time.monotonic()

    @classmethod
    def from_config(cls, section: CheckpointConfig, comm: Comm) -> "SaveSchedule | None":
        """The schedule the section asks for; None when neither interval is set."""
        if not section.save_interval_steps and not section.save_interval_minutes:
            return None
        return cls(section, comm)

    def due(self, global_steps: int) -> bool:
        """Whether to save now, after optimizer step `global_steps`: the same answer on every rank.
        Collective while `save_interval_minutes` is set."""
        due = bool(self._every_steps) and global_steps % self._every_steps == 0
        if self._every_s:
            late = 1.0 if self._comm.rank == 0 and time.monotonic() - self._last_s >= self._every_s else 0.0
            flag = torch.tensor([late], device=self._comm.groups.device)
            self._comm.all_reduce(flag, "max")
            due = due or bool(flag.item())
        if due:
            self._last_s = time.monotonic()
        return due
