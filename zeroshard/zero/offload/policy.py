"""Where a rank's model states live: the offload policy, passed whole (as FSDP2's
`CPUOffloadPolicy`).

One policy for the optimizer shard (`offload_optimizer`: fp32 master, gradient shard,
optimizer state) and one for stage-3 parameter shards (`offload_param`). A new home (NVMe
swap files) is one more policy here; strategies only ask `home`, `allocate` and `label`.
Imports nothing of ours but `config` types, nvme_io.py (the `aio` options) and, for typing,
zenflow.py's rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zeroshard.zero.offload.nvme_io import IOOptions

if TYPE_CHECKING:
    from zeroshard.config.schema import AioConfig
    from zeroshard.config.schema_zero import OffloadOptimizerConfig, OffloadParamConfig
    from zeroshard.zero.offload.zenflow import ZenFlowRule


@dataclass(frozen=True, slots=True)
class NvmeHome:
    """Swap files under `path` (zero/offload/nvme_swap.py), read and written with `io`."""

    path: Path
    sub_group_numel: int
    io: IOOptions
    fast_init: bool = True
    buffer_count: int = 3
    """Slots of the swap pipeline (`offload_optimizer.buffer_count`; Note: [swap pipeline])."""
    key: str = "zero_optimization.offload_optimizer.nvme_path"
    max_in_cpu: int = 1_000_000_000
    """Parameter shards: the most elements kept in memory (`offload_param.max_in_cpu`;
    Note: [parameters on NVMe])."""


@dataclass(frozen=True, slots=True)
class OffloadPolicy:
    """Where one kind of state lives between uses.

    Args:
        device: the home ("cpu"), or None to keep it on the model's device.
        pin_memory: allocate the home's tensors page-locked, so copies to and from an
            accelerator run asynchronously (ignored where no accelerator exists to pin for).
    """

    device: torch.device | None = None
    pin_memory: bool = False
    nvme: NvmeHome | None = None
    """Set when the states live in swap files; `device` is then the CPU that steps them."""
    ratio: float = 1.0
    """`offload_optimizer.ratio`: the share of the optimizer's buckets at this home; the leading
    others stay on the model's device (Note: [partial offload] in zero/offload/split_home.py)."""
    delayed_update: int | None = None
    """`offload_optimizer.delayed_update`: the warm-up steps before the optimizer step runs one
    step late in the background (zero/offload/delayed_step.py); None: every step synchronous."""
    zenflow: "ZenFlowRule | None" = None
    """`zero_optimization.zenflow` (stages 1-3): the optimizer steps by ZenFlow's rule
    (zero/offload/zenflow.py); set by zero/build.py, not by `from_config`."""

    @classmethod
    def from_config(cls, section: "OffloadOptimizerConfig | OffloadParamConfig", *,
                    sub_group_size: int = 1_000_000_000, aio: "AioConfig | None" = None) -> "OffloadPolicy":
        """From an `offload_optimizer` / `offload_param` config section (NVMe: with
        `zero_optimization.sub_group_size` and the `aio` section)."""
        if section.device == "none":
            return cls()
        if section.device == "nvme" and section.nvme_path is not None:
            io = IOOptions() if aio is None else IOOptions(
                block_size=aio.block_size, queue_depth=aio.queue_depth, thread_count=aio.intra_op_parallelism)
            param = hasattr(section, "max_in_cpu")  # an offload_param section
            home = NvmeHome(path=Path(section.nvme_path), sub_group_numel=int(sub_group_size), io=io,
                            fast_init=bool(getattr(section, "fast_init", True)),
                            buffer_count=int(section.buffer_count),
                            key=f"zero_optimization.{'offload_param' if param else 'offload_optimizer'}.nvme_path",
                            max_in_cpu=int(getattr(section, "max_in_cpu", 1_000_000_000)))
            return cls(device=torch.device("cpu"), pin_memory=bool(section.pin_memory), nvme=home)
        if section.device != "cpu":
            raise AssertionError(f"offload device {section.device!r} passed config validation but has no home")
        delayed = getattr(section, "delayed_update", False)  # an offload_optimizer section only
        return cls(device=torch.device("cpu"), pin_memory=bool(section.pin_memory),
                   ratio=float(getattr(section, "ratio", 1.0)),
                   delayed_update=int(section.delayed_update_warmup_steps) if delayed else None)

    @property
    def offloaded(self) -> bool:
        return self.device is not None

    def home(self, model_device: torch.device) -> torch.device:
        return self.device if self.device is not None else model_device

    def pinned(self, model_device: torch.device) -> bool:
        home = self.home(model_device)
        return self.pin_memory and home.type == "cpu" and model_device.type != "cpu" and torch.cuda.is_available()

    def allocate(self, numel: int, dtype: torch.dtype, model_device: torch.device, *, zero: bool = True) -> Tensor:
        """A 1-D tensor of `numel` elements at the home (pinned when the policy asks)."""
        factory = torch.zeros if zero else torch.empty
        return factory(numel, dtype=dtype, device=self.home(model_device), pin_memory=self.pinned(model_device))

    def label(self, model_device: torch.device) -> str:
        """The `ModelStateBytes.device` name of this home."""
        if self.nvme is not None:
            return "nvme (offload)"
        return f"{self.device.type} (offload)" if self.device is not None else model_device.type
