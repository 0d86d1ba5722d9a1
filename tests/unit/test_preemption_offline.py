"""Preemption without a process group (issue 42 item 4): the config keys, when the handling is off,
the launcher's summary of the ranks' notes, and the launcher passing SIGUSR1 on as SIGTERM.
The signal-to-checkpoint path itself runs in tests/launch/test_preemption.py."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import pytest

from zeroshard.cli.launch import preemption_summary
from zeroshard.cli.launch_runners import NodeCommand, run_commands
from zeroshard.config import CheckpointConfig, load_config
from zeroshard.errors import PREEMPTED_EXIT_CODE, ConfigError
from zeroshard.runtime.preemption import Preemption


def checkpoint_config(**section: object) -> CheckpointConfig:
    return load_config({"train_micro_batch_size_per_gpu": 1, "checkpoint": section}, dp_world_size=1).checkpoint


def test_preemption_defaults_on_with_a_25_s_grace() -> None:
    section = checkpoint_config()
    assert section.preemption_save is True and section.preemption_grace_seconds == 25.0


def test_an_explicit_preemption_save_needs_a_directory() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint.preemption_save: got true, but neither checkpoint.save_dir "
                                          r"nor checkpoint.auto_resume_dir is set"):
        checkpoint_config(preemption_save=True)
    assert checkpoint_config(preemption_save=True, save_dir="ckpt").preemption_save
    assert checkpoint_config(preemption_save=True, auto_resume_dir="ckpt").preemption_save


@pytest.mark.parametrize("grace", [0, -1])
def test_the_grace_must_be_positive(grace: float) -> None:
    with pytest.raises(ConfigError, match="checkpoint.preemption_grace_seconds"):
        checkpoint_config(preemption_grace_seconds=grace, save_dir="ckpt")


@pytest.mark.parametrize("section", [{}, {"preemption_save": False, "save_dir": "ckpt"},
                                     {"preemption_save": False, "auto_resume_dir": "ckpt"}],
                         ids=["no-directory", "off-with-save-dir", "off-with-auto-resume-dir"])
def test_off_builds_nothing_and_installs_no_handler(section: dict[str, object]) -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert Preemption.from_config(checkpoint_config(**section), comm=None) is None  # type: ignore[arg-type]
    assert signal.getsignal(signal.SIGTERM) is before


def test_summary_names_the_checkpoint_and_the_slowest_rank() -> None:
    notes = [{"rank": r, "signal": "SIGTERM", "step": 7, "checkpoint": "/c/global_step7", "save_s": s,
              "since_signal_s": s + 0.5, "grace_s": 25.0} for r, s in ((0, 1.25), (1, 2.5))]
    assert preemption_summary(notes) == (
        "zeroshard launch: preempted (SIGTERM); emergency checkpoint /c/global_step7 after step 7, saved in 2.50 s "
        "(3.00 s after the signal, grace 25 s; notes from 2 rank(s)). Exit status 75: restart the job to resume "
        "(with checkpoint.auto_resume_dir it resumes by itself).")


def test_summary_names_the_ranks_without_a_checkpoint() -> None:
    notes = [{"rank": 1, "signal": "SIGUSR1", "step": None, "checkpoint": None, "save_s": None,
              "since_signal_s": 25.0, "grace_s": 25.0},
             {"rank": 0, "signal": "SIGUSR1", "step": 3, "checkpoint": "/c/global_step3", "save_s": 0.1,
              "since_signal_s": 0.2, "grace_s": 25.0}]
    assert preemption_summary(notes).startswith(
        "zeroshard launch: preempted (SIGUSR1); rank(s) 1 exited without an emergency checkpoint")
    assert f"Exit status {PREEMPTED_EXIT_CODE}: restart the job." in preemption_summary(notes)


def test_launcher_passes_sigusr1_on_as_sigterm(tmp_path: Path) -> None:
    """torchrun has no SIGUSR1 handler (it would die and leave its workers running): the launcher
    sends its children SIGTERM instead. The child exits 42 on SIGTERM only; SIGUSR1 would kill it."""
    ready = tmp_path / "ready"
    child = ("import signal, sys, time, pathlib\n"
             "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
             f"pathlib.Path({str(ready)!r}).touch()\n"
             "time.sleep(20)\n")
    got: list[int] = []

    def ours(signum: int, frame: FrameType | None) -> None:  # reached only if run_commands did not take SIGUSR1
        got.append(signum)

    def send_when_ready() -> None:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, ours)
    try:
        threading.Thread(target=send_when_ready, daemon=True).start()
        code = run_commands([NodeCommand([sys.executable, "-c", child])], poll_s=0.02)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert (code, got) == (42, [])
