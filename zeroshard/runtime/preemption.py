"""Preemption (`checkpoint.preemption_save`): on SIGTERM or SIGUSR1, save an emergency checkpoint
after the same optimizer step on every rank and exit with `PREEMPTED_EXIT_CODE`, within
`checkpoint.preemption_grace_seconds`. Imports comm, config and errors only.

Note: [preemption]. A scheduler that preempts (SLURM, Kubernetes) sends SIGTERM and kills about
30 s later; SLURM's `--signal=USR1@T` warns T seconds before a time limit. The handler only
records the first signal: it runs between two bytecodes of the main thread, possibly inside a
collective or a backward, where nothing can be saved. At the end of each optimizer step the
ranks all-reduce (MAX) [signal number, seconds since it arrived], so all of them act after the
same step even when only some got the signal, and every rank's deadline counts from the earliest
signal. The engine then saves synchronously (joining an asynchronous save in flight), logs the
seconds it took and raises SystemExit(75). A watchdog thread, armed when a rank learns of the
signal, ends the process with 75 at the deadline whatever the main thread is doing (a step that
never ends, a save too slow, a peer gone); the save is crash-safe (Note: [save order] in
checkpoint/save.py), so `latest` keeps naming the last complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import NoReturn, Protocol

import torch

from zeroshard.comm import Comm
from zeroshard.config import CheckpointConfig
from zeroshard.errors import PREEMPTED_EXIT_CODE, PREEMPTION_NOTES_ENV, CheckpointError

logger = logging.getLogger("zeroshard")

PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)
"""SIGTERM: what SLURM, Kubernetes and torchrun send before they kill; SIGUSR1: what SLURM's
`--signal=USR1@T` sends T seconds before a time limit (and `zeroshard launch` turns into SIGTERM
for torchrun, which would die of it)."""


class _Saver(Protocol):
    """What the emergency save calls on the engine (`ZeroEngine`, the pipeline engine)."""

    global_steps: int

    def save_checkpoint(self, save_dir: str | os.PathLike[str]) -> str: ...

    def wait_for_checkpoint(self) -> str | None: ...


class _Latch:
    """The first preemption signal this process got: a signal goes to a process, not to an
    engine, so one latch serves every engine (handlers installed once, from the main thread)."""

    def __init__(self) -> None:
        self.signum = 0
        self.at_s = 0.0  # time.monotonic() of the signal
        self.arrived = threading.Event()
        self.exiting = threading.Event()  # the emergency save is over (done or failed): SystemExit is on its way
        self._previous: dict[int, object] = {}

    def install(self) -> bool:
        """Install the handlers (once); False where that is impossible (not the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for s in PREEMPTION_SIGNALS:
            if s not in self._previous:
                self._previous[s] = signal.signal(s, self._on_signal)
        return True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.record(signum, time.monotonic())

    def record(self, signum: int, at_s: float) -> None:
        """Keep the earliest signal: from the handler, or from the ranks' agreement (another
        rank got it first)."""
        if not self.signum or at_s < self.at_s:
            self.signum, self.at_s = signum, at_s
        self.arrived.set()


_LATCH = _Latch()


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Preemption:
    """What an engine does when the job is preempted; `from_config` builds it at initialize.

    Args:
        save_dir: where the emergency checkpoint goes (tag `global_step{N}`, `latest` switched).
        grace_s: the most seconds from the earliest signal to this process's exit.
        comm: a group of every rank that saves (the world: pipeline stages save together).

    Example::

        engine.preemption = Preemption.from_config(cfg.checkpoint, world_comm)  # initialize()
        # engine.step(), after a SIGTERM on any rank: every rank saves, then exits with 75
    """

    def __init__(self, save_dir: Path, grace_s: float, comm: Comm) -> None:
        self.save_dir = save_dir
        self.grace_s = grace_s
        self._comm = comm
        threading.Thread(target=self._watchdog, name="zeroshard-preemption", daemon=True).start()

    @classmethod
    def from_config(cls, section: CheckpointConfig, comm: Comm) -> "Preemption | None":
        """The section's preemption handling, with the signal handlers installed; None when it is
        off (`preemption_save` false, or neither `save_dir` nor `auto_resume_dir` to save into)."""
        save_dir = section.save_dir if section.save_dir is not None else section.auto_resume_dir
        if not section.preemption_save or save_dir is None:
            return None
        if not _LATCH.install():
            logger.warning("checkpoint.preemption_save: initialize() ran outside the main thread, where signal "
                           "handlers cannot be installed; SIGTERM keeps its default action (no emergency checkpoint)")
            return None
        return cls(Path(save_dir), section.preemption_grace_seconds, comm)

    def requested(self) -> bool:
        """Whether any rank got a preemption signal: the same answer on every rank. Collective
        (a 2-element all-reduce); call it at the end of every optimizer step."""
        signum, at_s = _LATCH.signum, _LATCH.at_s  # read once: the handler may run between two lines
        age_s = time.monotonic() - at_s if signum else 0.0
        flag = torch.tensor([float(signum), age_s], dtype=torch.float64, device=self._comm.groups.device)
        self._comm.all_reduce(flag, "max")
        signum, age_s = int(flag[0].item()), float(flag[1].item())
        if signum:
            _LATCH.record(signum, time.monotonic() - age_s)
        return signum != 0

    def save_and_exit(self, engine: _Saver, *, saved: bool) -> NoReturn:
        """Save the emergency checkpoint (`saved`: this step's periodic save already did), join any
        asynchronous save, and exit with `PREEMPTED_EXIT_CODE`. Collective. A failed save exits
        with the same code: the restart resumes from the checkpoint `latest` still names."""
        step, name = engine.global_steps, _signal_name(_LATCH.signum)
        start_s = time.monotonic()
        path, error = str(self.save_dir / f"global_step{step}"), None
        try:
            if not saved:
                path = engine.save_checkpoint(self.save_dir)
            engine.wait_for_checkpoint()
        except CheckpointError as e:
            error = str(e)
        save_s, since_s = time.monotonic() - start_s, time.monotonic() - _LATCH.at_s
        _LATCH.exiting.set()
        if error is None:
            self._report(f"{name}: emergency checkpoint {path} saved after step {step} in {save_s:.2f} s "
                         f"({since_s:.2f} s after the signal, grace {self.grace_s:g} s); exiting with "
                         f"{PREEMPTED_EXIT_CODE} (preempted: restart to resume)", step=step, checkpoint=path,
                         save_s=save_s, since_signal_s=since_s, rank0_only=True)
        else:
            self._report(f"{name}: the emergency checkpoint after step {step} failed ({error}); `latest` still "
                         f"names the last complete checkpoint. Exiting with {PREEMPTED_EXIT_CODE} (preempted)",
                         step=step, checkpoint=None, save_s=save_s, since_signal_s=since_s)
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def _watchdog(self) -> None:
        """End the process at the deadline (Note: [preemption]), saved or not."""
        _LATCH.arrived.wait()
        if _LATCH.exiting.wait(timeout=max(_LATCH.at_s + self.grace_s - time.monotonic(), 0.0)):
            # Saved (or failed and said so) in time: SystemExit is on its way; only a teardown
            # that hangs past the deadline (a collective with a peer already gone) is cut short.
            time.sleep(max(_LATCH.at_s + self.grace_s - time.monotonic(), 0.0))
            os._exit(PREEMPTED_EXIT_CODE)
        self._report(f"{_signal_name(_LATCH.signum)}: no emergency checkpoint within the grace of {self.grace_s:g} s "
                     "(checkpoint.preemption_grace_seconds); exiting without one. `latest` names the last "
                     f"complete checkpoint. Exit status {PREEMPTED_EXIT_CODE} (preempted)",
                     step=None, checkpoint=None, save_s=None, since_signal_s=time.monotonic() - _LATCH.at_s)
        for h in logger.handlers:
            h.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(PREEMPTED_EXIT_CODE)

    def _report(self, message: str, *, step: int | None, checkpoint: str | None, save_s: float | None,
                since_signal_s: float, rank0_only: bool = False) -> None:
        """Log `message` (rank 0 only for a success, every rank otherwise) and leave a note for
        `zeroshard launch` (PREEMPTION_NOTES_ENV), which summarizes the ranks' notes."""
        rank = self._comm.rank
        if rank == 0 or not rank0_only:
            (logger.warning if rank0_only else logger.error)(f"preemption: rank {rank}: {message}")
        notes = os.environ.get(PREEMPTION_NOTES_ENV)
        if not notes:
            return
        note = {"rank": rank, "signal": _signal_name(_LATCH.signum), "step": step, "checkpoint": checkpoint,
                "save_s": save_s, "since_signal_s": since_signal_s, "grace_s": self.grace_s}
        try:
            tmp = Path(notes) / f".rank{rank}.json.tmp"
            tmp.write_text(json.dumps(note))
            os.replace(tmp, Path(notes) / f"rank{rank}.json")
        except OSError as e:  # the launcher's summary is a convenience; the exit status is the contract
            logger.warning(f"preemption: rank {rank}: cannot leave a note in {notes}: {e}")
