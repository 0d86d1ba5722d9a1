"""The engine's counters, progress lines, monitor events and end-of-run summary, in one object.

`ZeroEngine` (runtime/engine.py) owns one `EngineProgress` and feeds it (torchtitan's
`MetricsProcessor` is the model): a forward starts the run clock, each backward adds its loss,
each `engine.step()` counts samples, and an optimizer step counts a step (skipped or not). The
engine's `global_steps`, `micro_steps`, ... read these counters.

`report` and `summary` are collective: each rank reaches them on the same step (the loss and
the memory figures are reduced or gathered over the data-parallel group).

With MoE layers it reports their routing (moe/telemetry.py): the counters are reduced over the
data-parallel group in `report` only, one collective for every layer (Note: [routing telemetry]).

It also drives `tput_timer` (runtime/throughput.py, DeepSpeed's `engine.tput_timer`) from the
same calls, with the samples it counts per step.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

import zeroshard.activation_checkpointing as activation_checkpointing
from zeroshard.moe.telemetry import RoutingTelemetry, routing_line, routing_metrics
from zeroshard.runtime.monitor import format_bytes, peak_memory_bytes
from zeroshard.runtime.throughput import ThroughputTimer

if TYPE_CHECKING:
    from zeroshard.comm import Comm
    from zeroshard.runtime.monitor import MetricSink, Timers
    from zeroshard.zero.strategy import ModelStateBytes

logger = logging.getLogger("zeroshard")


class EngineProgress:
    """Steps, samples and losses of one engine, and what it reports about them.

    Args:
        comm: the data-parallel group's Comm (the loss mean and memory figures go over it).
        device: where the collectives' tensors live.
        sinks: monitor back-ends (CSV, TensorBoard, wandb); each gets every report.
        timers: the engine's phase timers (`wall_clock_breakdown`), read and reset per report.
        micro_batch_samples: samples one `engine.step()` consumes over all ranks.
        train_batch_size: samples one optimizer step consumes over all ranks.
        steps_per_print: report every this many optimizer steps; None never.
        routing: the model's MoE route counters (moe/prepare.py's `routing_telemetry`); None
            without MoE layers, and then nothing is counted or reduced.
    """

    def __init__(self, *, comm: "Comm", device: torch.device, sinks: "list[MetricSink]", timers: "Timers",
                 micro_batch_samples: int, train_batch_size: int, steps_per_print: int | None,
                 routing: RoutingTelemetry | None = None) -> None:
        self._comm, self._device, self.sinks, self._timers = comm, device, sinks, timers
        self.routing = routing
        self._micro_batch_samples, self._train_batch_size = micro_batch_samples, train_batch_size
        self._steps_per_print = steps_per_print
        self.global_steps = 0
        """Optimizer steps taken, skipped (overflow) steps included."""
        self.global_samples = 0
        """Samples consumed over all ranks, counted per optimizer step (train_batch_size each;
        under `managed_gradient_accumulation: false` the micro-batches that step accumulated)."""
        self.micro_steps = 0
        """Micro-batches this rank processed (`engine.step()` calls)."""
        self.skipped_steps = 0
        """Steps skipped because of an fp16 overflow."""
        self.last_loss: float | None = None
        self.last_samples_per_s: float | None = None
        self._loss_sum: Tensor | None = None  # on the loss's device: no sync per micro-batch
        self._loss_count = 0
        self._window_start = time.perf_counter()
        self._window_samples = 0
        self._window_steps = 0
        self._run_start: float | None = None
        self._run_samples = 0
        self.tput_timer = ThroughputTimer(batch_size=train_batch_size)
        """DeepSpeed's throughput timer; no lines of its own (the progress line reports samples/s)."""

    # -- fed by the engine -------------------------------------------------------------------

    def forward_started(self) -> None:
        """A forward began: the first one starts the run's clock; each starts the throughput timer's."""
        if self._run_start is None:
            self._run_start = time.perf_counter()
        self.tput_timer.start()

    def add_loss(self, loss: Tensor) -> None:
        """A backward of `loss` (the micro-batch's unscaled loss) finished."""
        detached = loss.detach().double()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._loss_count += 1

    def micro_batch_done(self, count: int = 1) -> None:
        """`engine.step()` ended `count` micro-batches (their samples count toward throughput;
        more than one only under `managed_gradient_accumulation: false`)."""
        self._window_samples += self._micro_batch_samples * count
        self._run_samples += self._micro_batch_samples * count

    def accumulation_step_done(self) -> None:
        """`engine.step()` ended a micro-batch inside gradient accumulation (no optimizer step)."""
        self.micro_steps += 1
        self.tput_timer.stop(global_step=False)

    def optimizer_step_done(self, skipped: bool, micro_batches: int | None = None, micro_steps: int = 1) -> bool:
        """The boundary step ran (`skipped`: for an fp16 overflow) after `micro_batches`
        micro-batches (None: gradient_accumulation_steps of them, train_batch_size samples);
        `micro_steps`: the micro-batches it ends that no `accumulation_step_done` counted (a
        pipeline's batch ends all of them at once).
        Returns True when a progress report is due (every `steps_per_print` steps)."""
        if skipped:
            self.skipped_steps += 1
        samples = self._train_batch_size if micro_batches is None else self._micro_batch_samples * micro_batches
        self.global_steps += 1
        self._window_steps += 1
        self.global_samples += samples
        self.micro_steps += micro_steps
        self.tput_timer.stop(global_step=True, samples=samples)
        every = self._steps_per_print
        return every is not None and self.global_steps % every == 0

    # -- reports -----------------------------------------------------------------------------

    def _mean_loss_over_ranks(self) -> float | None:
        if self._loss_count == 0 or self._loss_sum is None:
            return None
        t = (self._loss_sum / self._loss_count).reshape(1).to(self._device, torch.float64)
        self._comm.all_reduce(t, op="avg")
        return float(t.item())

    def _memory_per_rank(self, model_states: "list[ModelStateBytes]") -> tuple[list[int], list[int]]:
        """(model-state bytes on this rank's device, peak memory) of every rank; collective."""
        on_device = sum(m.params + m.grads + m.master_params + m.optimizer_states
                        for m in model_states if not m.device.endswith("(offload)"))
        mine = torch.tensor([on_device, peak_memory_bytes(self._device)], dtype=torch.int64, device=self._device)
        every = torch.zeros(2 * self._comm.world_size, dtype=torch.int64, device=self._device)
        self._comm.all_gather(every, mine)
        values = [int(v) for v in every.tolist()]
        return values[0::2], values[1::2]

    def report(self, *, lr: float, loss_scale: float, grad_norm: float | None,
               model_states: "list[ModelStateBytes]") -> None:
        """Progress line and monitor events; collective (every rank reaches it on the same step).

        Every sink gets the same metrics (Note: [monitor events] in runtime/monitor.py)."""
        now = time.perf_counter()
        self.last_loss = self._mean_loss_over_ranks()
        self.last_samples_per_s = self._window_samples / max(now - self._window_start, 1e-9)
        model_bytes, peaks = self._memory_per_rank(model_states)
        metrics = {
            "loss": self.last_loss if self.last_loss is not None else float("nan"),
            "lr": lr,
            "loss_scale": loss_scale,
            "skipped_steps": float(self.skipped_steps),
            "grad_norm": grad_norm if grad_norm is not None else float("nan"),
            "samples_per_s": self.last_samples_per_s,
            "samples": float(self.global_samples),
        }
        for r, (m, p) in enumerate(zip(model_bytes, peaks)):
            metrics[f"model_state_bytes_rank{r}"] = float(m)
            metrics[f"peak_memory_bytes_rank{r}"] = float(p)
        logger.info(
            f"step {self.global_steps} | loss {metrics['loss']:.4f} | lr {lr:.3e} | "
            f"scale {metrics['loss_scale']:g} | grad norm {metrics['grad_norm']:.3f} | "
            f"{self.last_samples_per_s:.1f} samples/s | "
            f"peak mem {format_bytes(peak_memory_bytes(self._device))}"
        )
        steps = self._steps_per_print or 1
        phases = self._timers.means_ms_and_reset(steps) if self._timers.enabled else {}
        if activation_checkpointing.settings().profile:  # the recompute is part of backward
            phases["recompute"] = 1000 * activation_checkpointing.recompute_seconds() / steps
        if phases:
            logger.info("time per step (ms) | " + " | ".join(f"{k}: {v:.1f}" for k, v in phases.items()))
            metrics.update({f"time_{k}_ms": v for k, v in phases.items()})
        if self.routing is not None:
            metrics.update(self._routing_report())
        for sink in self.sinks:
            sink.write(self.global_steps, metrics)
        self._loss_sum, self._loss_count = None, 0
        self._window_start, self._window_samples, self._window_steps = now, 0, 0

    def _routing_report(self) -> dict[str, float]:
        """Every MoE layer's routing per step of the window, summed over ranks, logged one line per
        layer; one all-reduce and one read-back for all layers (Note: [routing telemetry])."""
        totals = self.routing.take(self._device)
        self._comm.all_reduce(totals, op="sum")
        layers = self.routing.summarize(totals.tolist(), self._window_steps)
        for i, layer in enumerate(layers):
            logger.info(routing_line(i, layer))
        return routing_metrics(layers)

    def summary(self) -> dict[str, Any]:
        """End-of-run figures; every rank must call it (peak memory is gathered)."""
        peak = torch.tensor([peak_memory_bytes(self._device)], dtype=torch.int64, device=self._device)
        peaks = torch.zeros(self._comm.world_size, dtype=torch.int64, device=self._device)
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
        """`summary()`, logged on one line; closes the sinks. Collective."""
        s = self.summary()
        loss = "n/a" if s["final_loss"] is None else f"{s['final_loss']:.4f}"
        peaks = ", ".join(f"rank {r}: {format_bytes(b)}" for r, b in enumerate(s["peak_memory_bytes_per_rank"]))
        logger.info(
            f"done: {s['steps']} steps ({s['skipped_steps']} skipped), {s['samples']} samples in "
            f"{s['elapsed_s']:.1f} s | final loss {loss} | {s['samples_per_s']:.1f} samples/s | "
            f"peak mem {peaks}"
        )
        for sink in self.sinks:
            sink.close()
        return s
