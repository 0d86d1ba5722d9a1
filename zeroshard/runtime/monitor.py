"""Progress, timers and metric sinks (console, CSV, TensorBoard, Weights & Biases).

Rank 0 writes; other ranks keep their timers so the breakdown can be averaged if needed.

Note: [monitor events] Every sink receives the same dict at every printed step
(`steps_per_print`), built once by the engine: loss, lr, loss_scale, skipped_steps,
grad_norm, samples_per_s, samples, model_state_bytes_rank{r} and peak_memory_bytes_rank{r}
for every rank, with wall_clock_breakdown (or activation_checkpointing.profile)
time_{phase}_ms, and with MoE layers moe{L}_tokens_expert{E}, moe{L}_dropped, moe{L}_imbalance
and moe{L}_aux_loss per layer L (moe/telemetry.py). `zeroshard report` reads the CSV sink's
file; docs/monitoring.md lists them.
"""

from __future__ import annotations

import csv
import gc
import logging
import resource
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from zeroshard.comm import shm
from zeroshard.errors import ConfigError

logger = logging.getLogger("zeroshard")


def setup_logging(rank: int) -> None:
    """Rank 0 logs INFO to stdout with a `[zeroshard]` prefix; other ranks log warnings only."""
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[zeroshard] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: device allocator peak on CUDA, peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def allocated_bytes(device: torch.device) -> int:
    """Bytes of tensor memory this process holds now: the allocator's count on CUDA; on CPU a
    census of the distinct storages of every live tensor the garbage collector tracks (each
    storage once, however many views point at it; released stage-3 units count 0 bytes; the
    shared-memory collectives' arenas are communication memory, not counted)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated module attributes warns
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        tensors = [o for o in objects if isinstance(o, torch.Tensor)]
    for obj in tensors:
        if obj.device.type == "cpu" and obj.layout == torch.strided:
            try:
                storage = obj.untyped_storage()
                ptr = storage.data_ptr() if storage.nbytes() > 0 else 0
            except (RuntimeError, NotImplementedError):  # wrapper subclasses without storage, freed storages
                continue
            if ptr and not shm.is_arena_buffer(ptr):
                seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
    return sum(seen.values())


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


class Timers:
    """Named wall-clock timers, synchronising the device so GPU time is counted honestly."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self._device = device
        self.enabled = enabled
        self._start: dict[str, float] = {}
        self.totals: dict[str, float] = {}

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def start(self, name: str) -> None:
        if self.enabled:
            self._sync()
            self._start[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.enabled and name in self._start:
            self._sync()
            elapsed = time.perf_counter() - self._start.pop(name)
            self.totals[name] = self.totals.get(name, 0.0) + elapsed

    def means_ms_and_reset(self, steps: int) -> dict[str, float]:
        """Milliseconds per step of each phase since the last call."""
        means = {k: 1000 * v / max(steps, 1) for k, v in self.totals.items()}
        self.totals.clear()
        return means


class MetricSink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class CsvSink:
    """One CSV file per job: `output_path/job_name/metrics.csv`, a row per printed step.

    The header is the union of every metric seen; when a later row brings a new one, the file
    is rewritten with the wider header (rows are few: one per `steps_per_print`)."""

    def __init__(self, output_path: str, job_name: str) -> None:
        directory = Path(output_path or "./runs") / (job_name or "zeroshard")
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "metrics.csv"
        self._rows: list[dict[str, float]] = []
        self._fields: list[str] = []
        self._file = self.path.open("w", newline="")
        self._writer: csv.DictWriter | None = None

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": step, **metrics}
        self._rows.append(row)
        new = [k for k in row if k not in self._fields]
        if new or self._writer is None:
            self._fields += new
            self._file.seek(0)
            self._file.truncate()
            self._writer = csv.DictWriter(self._file, fieldnames=self._fields)
            self._writer.writeheader()
            self._writer.writerows(self._rows)
        else:
            self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars under `Train/<metric>` in `output_path/job_name`."""

    def __init__(self, output_path: str, job_name: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # tensorboard is an optional extra
            raise ConfigError(
                "tensorboard.enabled is true but the tensorboard package is not installed; "
                "pip install 'zeroshard[monitor]' or set tensorboard.enabled to false"
            ) from e
        self._writer = SummaryWriter(log_dir=str(Path(output_path or "./runs") / (job_name or "zeroshard")))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(f"Train/{key}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Logs every metric to a Weights & Biases run (`wandb` section: project, group, team).

    `WANDB_MODE=offline` keeps the run in `./wandb` with no network (`wandb sync` uploads it
    later); the package is an optional extra."""

    def __init__(self, project: str, group: str | None, team: str | None, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ConfigError(
                "wandb.enabled is true but the wandb package is not installed; "
                "pip install 'zeroshard[wandb]' or set wandb.enabled to false"
            ) from e
        self._run = wandb.init(project=project, group=group, entity=team, config=dict(config))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def build_sinks(cfg: Any, rank: int) -> list[MetricSink]:
    """Metric sinks enabled in the config (`tensorboard`, `csv_monitor`, `wandb`); rank 0 only."""
    if rank != 0:
        return []
    sinks: list[MetricSink] = []
    if cfg.csv_monitor.enabled:
        sinks.append(CsvSink(cfg.csv_monitor.output_path, cfg.csv_monitor.job_name))
    if cfg.tensorboard.enabled:
        sinks.append(TensorBoardSink(cfg.tensorboard.output_path, cfg.tensorboard.job_name))
    if cfg.wandb.enabled:
        run_config = {"stage": cfg.zero_optimization.stage, "precision": cfg.precision,
                      "train_batch_size": cfg.train_batch_size, "dp_world_size": cfg.dp_world_size}
        sinks.append(WandbSink(cfg.wandb.project, cfg.wandb.group, cfg.wandb.team, run_config))
    return sinks
