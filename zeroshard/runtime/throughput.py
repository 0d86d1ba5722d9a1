"""`engine.tput_timer`: DeepSpeed's throughput timer, fed by the engine's own step counting.

DeepSpeed's engine starts its `ThroughputTimer` at every forward and stops it at every
`engine.step()`; scripts read it after training (DeepSpeed-Chat's step 1 calls
`engine.tput_timer.update_epoch_count()` after each epoch, others log `avg_samples_per_sec()`).
zeroshard's `EngineProgress` (runtime/engine_progress.py) already sees every forward and step and
counts the samples each optimizer step consumed; it drives this timer from those calls and hands
it that count, so the samples are counted once (the engine's `global_samples` bookkeeping, which
also covers `managed_gradient_accumulation: false`) and the engine's progress line stays the one
report every `steps_per_print` (the engine's timer has `steps_per_output=None`).

The timer measures what DeepSpeed's does: time from the start of a micro-batch's forward to the
end of its `step()`, skipping the first `start_step` optimizer steps (warm-up); data loading and
evaluation between steps are not counted. Imports nothing of zeroshard but `accelerator`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from zeroshard.accelerator import get_accelerator

logger = logging.getLogger("zeroshard")

_clock = time.perf_counter
"""The timer's clock (a name of this module, so a test can drive it)."""

_EPSILON_S = 1e-6
"""Keeps the current-step rate finite for a step that took no measurable time (DeepSpeed's TIME_EPSILON)."""


class ThroughputTimer:
    """Samples per second over optimizer steps, with DeepSpeed's `ThroughputTimer` interface.

    Args:
        config: DeepSpeed's `timers.throughput` section (an object with `enabled` and
            `synchronized`), or None: enabled, not synchronized.
        batch_size: samples one optimizer step consumes (train_batch_size); `stop(samples=...)`
            overrides it per step.
        start_step: optimizer steps left untimed at the start (compilation, allocator warm-up).
        steps_per_output: log a line every this many optimizer steps; None never.
        monitor_memory: also log host memory and swap use (needs psutil).
        logging_fn: where lines go; default the zeroshard logger's `info`.
    """

    def __init__(self, config: Any = None, batch_size: int | None = 1, start_step: int = 2,
                 steps_per_output: int | None = None, monitor_memory: bool = False,
                 logging_fn: Callable[[str], Any] | None = None) -> None:
        if steps_per_output is not None and steps_per_output <= 0:
            raise ValueError(f"steps_per_output must be a positive integer or None, got {steps_per_output}")
        self.config = config
        self.enabled = bool(getattr(config, "enabled", True))
        self.synchronized = bool(getattr(config, "synchronized", False))
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step, self.steps_per_output = start_step, steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn or logger.info
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.initialized = False
        self.epoch_count = 0
        self.micro_step_count = 0
        """Micro-batches stopped in this epoch (reset by `update_epoch_count`)."""
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        """Seconds timed over the steps after `start_step`."""
        self.step_elapsed_time = 0.0
        """Seconds timed in the current optimizer step so far."""
        self.timed_samples = 0
        """Samples of the timed optimizer steps (the numerator of `avg_samples_per_sec`)."""

    def update_epoch_count(self) -> None:
        """An epoch ended: count it and restart the per-epoch micro-step count."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def _now(self) -> float:
        if self.synchronized:
            get_accelerator().synchronize()  # the device's queued work belongs to the interval
        return _clock()

    def start(self) -> None:
        """A micro-batch begins (its forward). Past the warm-up steps its clock starts; a second
        start before `stop` (an evaluation forward) restarts it, as DeepSpeed's does."""
        if not self.enabled:
            return
        self.initialized = self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = self._now()

    def stop(self, global_step: bool = False, report_speed: bool = True, *, samples: int | None = None) -> None:
        """A micro-batch's `step()` ended; `global_step`: it was an optimizer step, of `samples`
        samples (default `batch_size`). `report_speed`: log at a `steps_per_output` boundary."""
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = self._now()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
        if not global_step:
            return
        step_samples = self.batch_size if samples is None else samples
        if self.step_elapsed_time > 0:
            self.timed_samples += step_samples
        if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
            self._report(step_samples / (self.step_elapsed_time + _EPSILON_S))
        self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed optimizer steps; -inf before any was timed (DeepSpeed
        returns -inf before the first step)."""
        if self.total_elapsed_time <= 0 or self.timed_samples == 0:
            return float("-inf")
        return self.timed_samples / self.total_elapsed_time

    def _report(self, current: float) -> None:
        self.logging(f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                     f"global_step={self.global_step_count}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                     f"CurrSamplesPerSec={current}")
        if self.monitor_memory:
            import psutil  # optional: only for monitor_memory, as in DeepSpeed

            self.logging(f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                         f"global_step={self.global_step_count}, vm %: {psutil.virtual_memory().percent}, "
                         f"swap %: {psutil.swap_memory().percent}")
