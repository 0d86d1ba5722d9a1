"""Progress lines, monitor events and the end-of-run summary of `ZeroEngine` (a mixin).

Every method here is collective: each rank reaches it on the same step (the loss and the
memory figures are reduced or gathered over the data-parallel group).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.runtime import activation_checkpointing
from zeroshard.runtime.monitor import format_bytes, peak_memory_bytes

if TYPE_CHECKING:
    from zeroshard.comm import Comm, ProcessGroups
    from zeroshard.config import Config
    from zeroshard.runtime.monitor import MetricSink, Timers

logger = logging.getLogger("zeroshard")


class EngineProgress:
    """The engine's progress report (every `steps_per_print` steps) and `summary()`.

    Also uses, from ZeroEngine: the loss/sample counters, `model_state_bytes()`, `get_lr()`,
    `get_global_grad_norm()`, `get_loss_scale()`.
    """

    _config: "Config"
    _groups: "ProcessGroups"
    _comm: "Comm"
    _sinks: "list[MetricSink]"
    timers: "Timers"
    device: torch.device

    def _mean_loss_over_ranks(self) -> float | None:
        if self._loss_count == 0 or self._loss_sum is None:
            return None
        t = (self._loss_sum / self._loss_count).reshape(1).to(self.device, torch.float64)
        self._comm.all_reduce(t, op="avg")
        return float(t.item())

    def _memory_per_rank(self) -> tuple[list[int], list[int]]:
        """(model-state bytes on this rank's device, peak memory) of every rank; collective."""
        on_device = sum(m.params + m.grads + m.master_params + m.optimizer_states
                        for m in self.model_state_bytes() if not m.device.endswith("(offload)"))
        mine = torch.tensor([on_device, peak_memory_bytes(self.device)], dtype=torch.int64, device=self.device)
        every = torch.zeros(2 * self._groups.world_size, dtype=torch.int64, device=self.device)
        self._comm.all_gather(every, mine)
        values = [int(v) for v in every.tolist()]
        return values[0::2], values[1::2]

    def _report(self) -> None:
        """Progress line and monitor events; collective (every rank reaches it on the same step).

        Every sink gets the same metrics (Note: [monitor events] in runtime/monitor.py)."""
        now = time.perf_counter()
        self.last_loss = self._mean_loss_over_ranks()
        self.last_samples_per_s = self._window_samples / max(now - self._window_start, 1e-9)
        model_states, peaks = self._memory_per_rank()
        lr = self.get_lr()[0] if self.get_lr() else 0.0
        norm = self.get_global_grad_norm()
        metrics = {
            "loss": self.last_loss if self.last_loss is not None else float("nan"),
            "lr": lr,
            "loss_scale": self.get_loss_scale(),
            "skipped_steps": float(self.skipped_steps),
            "grad_norm": norm if norm is not None else float("nan"),
            "samples_per_s": self.last_samples_per_s,
            "samples": float(self.global_samples),
        }
        for r, (m, p) in enumerate(zip(model_states, peaks)):
            metrics[f"model_state_bytes_rank{r}"] = float(m)
            metrics[f"peak_memory_bytes_rank{r}"] = float(p)
        logger.info(
            f"step {self.global_steps} | loss {metrics['loss']:.4f} | lr {lr:.3e} | "
            f"scale {metrics['loss_scale']:g} | grad norm {metrics['grad_norm']:.3f} | "
            f"{self.last_samples_per_s:.1f} samples/s | "
            f"peak mem {format_bytes(peak_memory_bytes(self.device))}"
        )
        steps = self._config.steps_per_print or 1
        phases = self.timers.means_ms_and_reset(steps) if self.timers.enabled else {}
        if activation_checkpointing.settings().profile:  # the recompute is part of backward
            phases["recompute"] = 1000 * activation_checkpointing.recompute_seconds() / steps
        if phases:
            logger.info("time per step (ms) | " + " | ".join(f"{k}: {v:.1f}" for k, v in phases.items()))
            metrics.update({f"time_{k}_ms": v for k, v in phases.items()})
        for sink in self._sinks:
            sink.write(self.global_steps, metrics)
        self._loss_sum, self._loss_count = None, 0
        self._window_start, self._window_samples = now, 0

    def summary(self) -> dict[str, Any]:
        """End-of-run figures; every rank must call it (peak memory is gathered)."""
        peak = torch.tensor([peak_memory_bytes(self.device)], dtype=torch.int64, device=self.device)
        peaks = torch.zeros(self._groups.world_size, dtype=torch.int64, device=self.device)
        self._comm.all_gather(peaks, peak)
        loss = self._mean_loss_over_ranks()
        elapsed = time.perf_counter() - (self._run_start or time.perf_counter())
        return {
            "steps": self.global_steps,
            "skipped_steps": self.skipped_steps,
            "samples": self.global_samples,
            "final_loss": loss if loss is not None else self.last_loss,
            "samples_per_s": self._run_samples / max(elapsed, 1e-9),
            "elapsed_s": elapsed,
            "peak_memory_bytes_per_rank": [int(x) for x in peaks.tolist()],
        }

    def print_summary(self) -> dict[str, Any]:
        s = self.summary()
        loss = "n/a" if s["final_loss"] is None else f"{s['final_loss']:.4f}"
        peaks = ", ".join(f"rank {r}: {format_bytes(b)}" for r, b in enumerate(s["peak_memory_bytes_per_rank"]))
        logger.info(
            f"done: {s['steps']} steps ({s['skipped_steps']} skipped), {s['samples']} samples in "
            f"{s['elapsed_s']:.1f} s | final loss {loss} | {s['samples_per_s']:.1f} samples/s | "
            f"peak mem {peaks}"
        )
        for sink in self._sinks:
            sink.close()
        return s
