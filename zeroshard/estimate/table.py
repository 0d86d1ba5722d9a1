"""The `zeroshard estimate` table: every stage and offload combination, per device and per node.

Each row is one `Setup` (estimate/states.py) and says whether the installed zeroshard runs it
(the config loader is asked; it raises NotSupportedError for what is not built yet).
Imports `zeroshard.config` and `zeroshard.estimate`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from zeroshard.config import load_config
from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.estimate.spec import ModelSpec
from zeroshard.estimate.states import Device, NodeEstimate, Precision, Setup, ZeroStage, estimate_node

GiB = 2**30

COMBINATIONS: tuple[tuple[ZeroStage, Device, Device], ...] = (
    (0, "none", "none"),
    (1, "none", "none"),
    (1, "cpu", "none"),
    (2, "none", "none"),
    (2, "cpu", "none"),
    (3, "none", "none"),
    (3, "none", "cpu"),
    (3, "cpu", "none"),
    (3, "cpu", "cpu"),
    (3, "nvme", "nvme"),
)
"""(stage, offload_optimizer, offload_param) rows, fastest first."""


def zero_section(zero_stage: int, offload_optimizer: Device, offload_param: Device,
                 nvme_path: str | None = None, **extra: Any) -> dict[str, Any]:
    """The `zero_optimization` section for one combination (NVMe paths when offloading there)."""
    zero: dict[str, Any] = {"stage": zero_stage, **extra}
    if offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": offload_optimizer}
        if offload_optimizer == "nvme":
            zero["offload_optimizer"]["nvme_path"] = nvme_path or "/local_nvme"
    if offload_param != "none":
        zero["offload_param"] = {"device": offload_param}
        if offload_param == "nvme":
            zero["offload_param"]["nvme_path"] = nvme_path or "/local_nvme"
    return zero


def support_status(ds_config: Mapping[str, Any], world_size: int) -> str | None:
    """None when the installed zeroshard loads `ds_config`; otherwise why not (one line)."""
    try:
        load_config(ds_config, dp_world_size=world_size)
    except NotSupportedError as e:
        return str(e).split(". ")[0].removeprefix("not supported yet: ") + ": not supported yet"
    except ConfigError as e:
        return str(e).splitlines()[0]
    return None


def zero_stage_supported(zero_stage: int, offload_optimizer: Device = "none", offload_param: Device = "none") -> bool:
    """Whether the installed zeroshard runs this combination (asks the config loader)."""
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": zero_section(zero_stage, offload_optimizer, offload_param)}
    return support_status(cfg, 1) is None


@dataclass(frozen=True, slots=True)
class TableRow:
    estimate: NodeEstimate
    unsupported: str | None


def table_rows(spec: ModelSpec, base: Setup) -> list[TableRow]:
    """One row per combination; `base` supplies precision, buckets, optimizer and hardware."""
    rows = []
    for zero_stage, opt, param in COMBINATIONS:
        setup = replace(base, zero_stage=zero_stage, offload_optimizer=opt, offload_param=param)
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero_section(zero_stage, opt, param)}
        rows.append(TableRow(estimate_node(spec, setup), support_status(cfg, 1)))
    return rows


def _gb(n: int) -> str:
    return f"{n / GiB:8.2f}"


def format_table(spec: ModelSpec, base: Setup, rows: list[TableRow]) -> str:
    """The printed table (GB = 2^30 bytes, as DeepSpeed prints)."""
    phi = spec.total_params
    head = [
        f"{spec.name}: {phi:,} parameters ({phi / 1e9:.2f}B), largest layer {spec.largest_layer_params:,}"
        f" ({_source(spec)})",
        f"{base.nodes} node(s) x {base.devices_per_node} device(s); {_precision_text(base.precision)}; "
        f"gradients accumulate in {base.grad_accum_dtype or 'fp32'}; optimizer state "
        f"{base.optimizer_state_bytes} bytes/param",
        "model states per device and per node's CPU, in GB (2^30 bytes)",
        "",
        "  stage  offload_optimizer  offload_param |  states   + buffers = device | CPU/node  (init)  "
        "|  NVMe/node | zeroshard",
    ]
    lines = list(head)
    for row in rows:
        e, s = row.estimate, row.estimate.setup
        lines.append(
            f"  {s.zero_stage:>5}  {s.offload_optimizer:<17}  {s.offload_param:<13} |"
            f"{_gb(e.device_states)} {_gb(e.device_peak - e.device_states)} {_gb(e.device_peak)} |"
            f"{_gb(e.cpu_steady)} {_gb(e.cpu_init)} | {_gb(e.nvme)}  | {row.unsupported or 'yes'}")
    lines += [
        "",
        "states: params + gradients + fp32 master + optimizer states held between steps; buffers: the",
        "step's transient memory (stage-2 reduce-scatter staging, stage-3 gathered layers); CPU/node:",
        "offloaded states (and NVMe swap buffers) of every local rank; "
        "(init): the fp32 model each rank builds on the CPU",
        "before moving it to its device (one layer per rank with zero.Init). Activations come on top.",
    ]
    return "\n".join(lines)


def _source(spec: ModelSpec) -> str:
    if spec.live:
        return "sizes read from the model"
    return "sizes from the config" if spec.param_numels is not None else "from counts"


def _precision_text(p: Precision) -> str:
    return "fp32 training" if p == "fp32" else f"{p} mixed precision (fp32 master weights)"
