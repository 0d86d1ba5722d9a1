"""`zeroshard plan`: walk the stages from fastest to most frugal and keep the first that fits.

The order is the seeds' step-down procedure: stage 0 -> 1 -> 2 -> 2 + optimizer offload -> 3 ->
3 + parameter offload -> 3 + parameter and optimizer offload -> NVMe (and, when fp32 was asked
for and nothing fits, the same walk in bf16 mixed precision). Each candidate is a complete
ds_config, checked by `zeroshard.config.load_config` (what the installed zeroshard cannot run
is listed as skipped, with the loader's reason). The first candidate whose device peak (model
states + step buffers + activations) and CPU peak fit the budgets is chosen, then its micro
batch is raised as far as it still fits. Imports `zeroshard.config` and `zeroshard.estimate`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from zeroshard.config import load_config
from zeroshard.errors import ConfigError, NotSupportedError, ZeroshardError
from zeroshard.estimate.activations import ActivationOptions, activation_bytes
from zeroshard.estimate.spec import ModelSpec
from zeroshard.estimate.states import Device, NodeEstimate, Precision, Setup, ZeroStage, estimate_node
from zeroshard.estimate.table import zero_section

GiB = 2**30

STEP_DOWN: tuple[tuple[ZeroStage, Device, Device], ...] = (
    (0, "none", "none"),
    (1, "none", "none"),
    (2, "none", "none"),
    (2, "cpu", "none"),
    (3, "none", "none"),
    (3, "none", "cpu"),
    (3, "cpu", "cpu"),
    (3, "nvme", "cpu"),
    (3, "nvme", "nvme"),
)
"""(stage, offload_optimizer, offload_param), fastest first (seed 002's procedure)."""

RECOMPUTE_COST = 1 / 3
"""Extra compute of full activation checkpointing, as a fraction of a step without it: every
layer's forward runs again in backward, and a forward is about 1/3 of a step's FLOPs (backward
costs twice the forward). Communication and optimizer time do not grow, so the wall-clock cost is
at most this (measured: docs/activation-checkpointing.md)."""

DEFAULT_OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """What the job runs on."""

    devices_per_node: int
    nodes: int = 1
    device_memory: int
    """Bytes of accelerator memory per device (the RAM share of a rank on a CPU-only machine)."""
    cpu_memory: int
    """Bytes of CPU memory per node."""
    reserve: float = 0.10
    """Fraction of each budget kept free: allocator fragmentation, CUDA context and kernel
    workspaces, the framework itself. The margin printed is what remains beyond it."""
    nvme_path: str | None = None
    disk_read: float | None = None
    """Bytes per second read from `nvme_path` per node (measured by `zeroshard plan` with
    `zero/offload/nvme_bench.py`, or given); None: unknown."""
    disk_write: float | None = None
    """Bytes per second written to `nvme_path` per node; None: unknown."""

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def device_budget(self) -> int:
        return int(self.device_memory * (1 - self.reserve))

    @property
    def cpu_budget(self) -> int:
        return int(self.cpu_memory * (1 - self.reserve))


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What is trained: precision, sequence length, batch, and the rest of the ds_config."""

    precision: Precision = "bf16"
    seq_len: int | None = None
    global_batch: int | None = None
    max_micro_batch: int = 64
    checkpointing: bool | Literal["auto"] = False
    """True: the model recomputes activations (torch.utils.checkpoint / HF
    gradient_checkpointing_enable()); False: it does not. "auto": a planned choice: from stage
    2 on, each candidate that does not fit is tried again with checkpointing (costing
    RECOMPUTE_COST more compute) before the walk steps down to a slower one, as the seeds say
    ("turn on activation checkpointing first")."""
    base_config: Mapping[str, Any] = field(default_factory=dict)
    """Keys kept in every written ds_config (optimizer, scheduler, clipping, ...)."""


@dataclass(frozen=True, kw_only=True)
class Decision:
    """One step of the walk: a candidate and what became of it."""

    name: str
    status: Literal["fits", "too big", "skipped"]
    line: str
    estimate: NodeEstimate | None = None
    activations: int = 0
    micro_batch: int = 1
    ds_config: dict[str, Any] | None = None
    checkpointing: bool = False
    """The model must recompute activations for this candidate to fit (see RECOMPUTE_COST)."""

    @property
    def device_need(self) -> int:
        return (self.estimate.device_peak if self.estimate else 0) + self.activations


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The walk's decisions, the choice (None when nothing fits) and notes."""

    decisions: list[Decision]
    chosen: Decision | None
    notes: list[str]
    hardware: Hardware

    def report(self) -> str:
        """One line per decision, the notes, then the choice with its margin."""
        return "\n".join([d.line for d in self.decisions] + self.notes + [summary_line(self)])


def format_gb(n: float) -> str:
    """Bytes as "61.0 GB" (GB = 2^30 bytes), or MB below 0.1 GB; 0 as "0"."""
    if n == 0:
        return "0"
    return f"{n / GiB:.1f} GB" if abs(n) >= GiB / 10 else f"{n / 2**20:.1f} MB"


def bucket_numel(spec: ModelSpec) -> int:
    """Bucket elements written into the ds_config: DeepSpeed's "auto" (hidden^2), within [1e6, 5e8]."""
    hidden = spec.shape.hidden_size if spec.shape else None
    return int(min(5e8, max(1e6, hidden * hidden))) if hidden else 50_000_000


def build_ds_config(spec: ModelSpec, work: Workload, hw: Hardware, zero_stage: int, opt: Device, param: Device,
                    precision: Precision, micro: int, gas: int) -> dict[str, Any]:
    """A complete ds_config for one candidate (the user's base keys kept)."""
    cfg = copy.deepcopy(dict(work.base_config))
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "zero_optimization", "fp16", "bf16"):
        cfg.pop(key, None)
    cfg.setdefault("optimizer", copy.deepcopy(DEFAULT_OPTIMIZER))
    cfg["train_batch_size"] = micro * gas * hw.world_size
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_accumulation_steps"] = gas
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    bucket = bucket_numel(spec)
    extra: dict[str, Any] = {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": bucket}
    if zero_stage in (1, 2):
        extra["allgather_bucket_size"] = bucket
    if zero_stage == 3 and spec.shape:
        h = spec.shape.hidden_size
        extra["stage3_prefetch_bucket_size"] = int(0.9 * h * h)
        extra["stage3_param_persistence_threshold"] = 10 * h
    cfg["zero_optimization"] = zero_section(zero_stage, opt, param, hw.nvme_path, **extra)
    return cfg


def _batches(work: Workload, world: int) -> list[tuple[int, int]]:
    """(micro batch, accumulation steps) to try, smallest micro batch first."""
    if work.global_batch is None:
        out, micro = [], 1
        while micro <= work.max_micro_batch:
            out.append((micro, 1))
            micro *= 2
        return out
    if work.global_batch % world:
        raise ZeroshardError(f"--global-batch {work.global_batch} is not a multiple of the {world} devices")
    per_rank = work.global_batch // world
    return [(m, per_rank // m) for m in range(1, min(per_rank, work.max_micro_batch) + 1) if per_rank % m == 0]


def _activations(spec: ModelSpec, work: Workload, precision: Precision, micro: int, checkpointing: bool) -> int:
    if spec.shape is None or work.seq_len is None:
        return 0
    return activation_bytes(spec.shape, ActivationOptions(
        seq_len=work.seq_len, micro_batch=micro, checkpointing=checkpointing,
        act_bytes=4 if precision == "fp32" else 2))


def evaluate(spec: ModelSpec, work: Workload, hw: Hardware, zero_stage: ZeroStage, opt: Device, param: Device,
             precision: Precision, checkpointing: bool | None = None) -> Decision:
    """Estimate one candidate at the smallest batch; say in one line whether it fits.

    `checkpointing` None: as the workload says (True only when it is True)."""
    ckpt = work.checkpointing is True if checkpointing is None else checkpointing
    name = Setup(zero_stage=zero_stage, offload_optimizer=opt, offload_param=param).label()
    if ckpt and work.checkpointing == "auto":
        name += " + activation checkpointing"
    micro, gas = _batches(work, hw.world_size)[0]
    if opt == "nvme" and hw.nvme_path is None:
        return Decision(name=name, status="skipped", line=f"{name}: skipped, no --nvme-path given")
    ds = build_ds_config(spec, work, hw, zero_stage, opt, param, precision, micro, gas)
    try:
        cfg = load_config(ds, dp_world_size=hw.world_size,
                          hidden_size=spec.shape.hidden_size if spec.shape else None)
    except NotSupportedError as e:
        why = str(e).split(". ")[0].removeprefix("not supported yet: ")
        return Decision(name=name, status="skipped",
                        line=f"{name}: skipped, not supported yet by this zeroshard ({why})")
    except ConfigError as e:
        return Decision(name=name, status="skipped", line=f"{name}: skipped, {str(e).splitlines()[0]}")
    est = estimate_node(spec, Setup.from_config(cfg, devices_per_node=hw.devices_per_node, nodes=hw.nodes))
    act = _activations(spec, work, precision, micro, ckpt)
    need, cpu = est.device_peak + act, est.cpu_peak
    fits = need <= hw.device_budget and cpu <= hw.cpu_budget
    detail = f"states {format_gb(est.device_states)} + buffers {format_gb(est.device_peak - est.device_states)}"
    detail += f" + activations {format_gb(act)}" if act else ""
    cpu_text = f"CPU {format_gb(cpu)} of {format_gb(hw.cpu_memory)} per node"
    if fits:
        margin = min(hw.device_budget - need, hw.cpu_budget - cpu)
        verdict = f"fits, margin {format_gb(hw.device_budget - need)} per device"
        if hw.cpu_budget - cpu == margin:
            verdict = f"fits, margin {format_gb(margin)} of CPU per node"
    elif need > hw.device_budget:
        verdict = f"too big for the device ({format_gb(hw.device_budget)} usable)"
    else:
        verdict = f"too big for the CPU ({format_gb(hw.cpu_budget)} usable)"
    planned = ckpt and work.checkpointing == "auto"
    cost = f", recompute costs ~{RECOMPUTE_COST:.0%} more compute per step" if planned else ""
    if "nvme" in (opt, param):
        cost += ", " + disk_line(est, hw)
    line = (f"{name} ({precision}): needs {format_gb(need)} of {format_gb(hw.device_memory)} per device ({detail}), "
            f"{cpu_text}{cost} -> {verdict}")
    return Decision(name=name, status="fits" if fits else "too big", line=line, estimate=est, activations=act,
                    micro_batch=micro, ds_config=ds, checkpointing=ckpt)


def disk_traffic(est: NodeEstimate) -> tuple[int, int]:
    """(bytes read, bytes written) on the NVMe path per optimizer step per node: every swapped
    optimizer state (fp32 master included) is read and written back once; swapped parameters are
    read twice (forward and backward gathers) and written once (after the step)."""
    states = est.nvme - est.nvme_params
    return states + 2 * est.nvme_params, states + est.nvme_params


def disk_seconds(est: NodeEstimate, hw: Hardware) -> float | None:
    """Lower bound on a step's time from the disk alone (its I/O at `hw`'s bandwidth), None when
    the bandwidth is unknown."""
    if hw.disk_read is None or hw.disk_write is None:
        return None
    read, write = disk_traffic(est)
    return read / hw.disk_read + write / hw.disk_write


def disk_line(est: NodeEstimate, hw: Hardware) -> str:
    read, write = disk_traffic(est)
    t = disk_seconds(est, hw)
    text = f"disk swaps {format_gb(read)} read + {format_gb(write)} written per step per node"
    if t is None:
        return text + " (disk bandwidth unknown: pass --nvme-bandwidth or let plan measure --nvme-path)"
    return (text + f": >= {t:.2f} s per step at {hw.disk_read / 2**30:.2f} GB/s read, "  # type: ignore[operator]
            f"{hw.disk_write / 2**30:.2f} GB/s write")  # type: ignore[operator]


def raise_batch(spec: ModelSpec, work: Workload, hw: Hardware, d: Decision) -> Decision:
    """The largest micro batch (dividing the per-rank batch, when given) that still fits."""
    if d.estimate is None or d.ds_config is None:
        return d
    s = d.estimate.setup
    best = d
    for micro, gas in _batches(work, hw.world_size)[1:]:
        act = _activations(spec, work, s.precision, micro, d.checkpointing)
        if act == 0 or d.estimate.device_peak + act > hw.device_budget:
            break
        ds = build_ds_config(spec, work, hw, s.zero_stage, s.offload_optimizer, s.offload_param, s.precision,
                             micro, gas)
        best = Decision(name=d.name, status="fits", line=d.line, estimate=d.estimate, activations=act,
                        micro_batch=micro, ds_config=ds, checkpointing=d.checkpointing)
    return best


def make_plan(spec: ModelSpec, work: Workload, hw: Hardware, *, evaluate_all: bool = False) -> Plan:
    """Walk STEP_DOWN (then bf16 if fp32 fits nowhere); choose the first candidate that fits.

    Args:
        evaluate_all: keep walking after the first fit (the probe runs every fitting candidate).
    """
    decisions: list[Decision] = []
    notes: list[str] = []
    precisions: list[Precision] = [work.precision] + (["bf16"] if work.precision == "fp32" else [])
    chosen = None
    for i, precision in enumerate(precisions):
        if i == 1:
            notes.append("nothing fits in fp32: trying bf16 mixed precision (the seeds' next step)")
        for zero_stage, opt, param in STEP_DOWN:
            for ckpt in _checkpointing_choices(work, zero_stage):
                d = evaluate(spec, work, hw, zero_stage, opt, param, precision, ckpt)
                if d.status == "skipped" and ckpt and work.checkpointing == "auto":
                    continue  # said once, for the candidate without checkpointing
                decisions.append(d)
                if d.status == "fits" and chosen is None:
                    chosen = d
                    if not evaluate_all:
                        break
            if chosen is not None and not evaluate_all:
                break
        if chosen is not None:
            break
    if spec.shape is None or work.seq_len is None:
        notes.append("activations not estimated (give a transformer config and --seq-len); use --probe to measure")
    hint = _checkpointing_hint(spec, work, hw, decisions, chosen)
    if hint:
        notes.append(hint)
    if chosen is not None:
        chosen = raise_batch(spec, work, hw, chosen)
        if chosen.checkpointing and work.checkpointing == "auto":
            notes.append("the choice needs activation checkpointing in the model: "
                         "model.gradient_checkpointing_enable() (Hugging Face) or "
                         "zeroshard.checkpointing.checkpoint(layer, x) per layer")
    return Plan(decisions=decisions, chosen=chosen, notes=notes, hardware=hw)


def _checkpointing_choices(work: Workload, zero_stage: int) -> tuple[bool, ...]:
    """Checkpointing settings to try for one candidate. Under "auto", stages 0 and 1 are tried
    without it only: stage 2 runs as fast with less memory, so it comes before any recompute."""
    if work.checkpointing == "auto":
        return (False, True) if zero_stage >= 2 else (False,)
    return (bool(work.checkpointing),)


def _checkpointing_hint(spec: ModelSpec, work: Workload, hw: Hardware, decisions: list[Decision],
                        chosen: Decision | None) -> str | None:
    """The seeds' first step: would activation checkpointing let a faster candidate fit?"""
    if work.checkpointing is not False or spec.shape is None or work.seq_len is None:
        return None
    for d in decisions:
        if d is chosen:
            return None
        if d.status != "too big" or d.estimate is None:
            continue
        ckpt = activation_bytes(spec.shape, ActivationOptions(
            seq_len=work.seq_len, micro_batch=d.micro_batch, checkpointing=True,
            act_bytes=4 if d.estimate.setup.precision == "fp32" else 2))
        if d.estimate.device_peak + ckpt <= hw.device_budget and d.estimate.cpu_peak <= hw.cpu_budget:
            return (f"hint: with activation checkpointing in the model (then pass --activation-checkpointing), "
                    f"{d.name} would fit: activations {format_gb(d.activations)} -> {format_gb(ckpt)}")
    return None


def summary_line(plan: Plan) -> str:
    """The closing line: the choice, its batch and its margin."""
    c, hw = plan.chosen, plan.hardware
    if c is None or c.estimate is None:
        return ("no configuration fits: add devices or memory, shorten the sequence, or enable activation "
                "checkpointing in the model")
    gas = (c.ds_config or {}).get("gradient_accumulation_steps", 1)
    return (f"choice: {c.name} in {c.estimate.setup.precision}, micro batch {c.micro_batch} x {gas} "
            f"accumulation x {hw.world_size} device(s): needs {format_gb(c.device_need)} of "
            f"{format_gb(hw.device_memory)} "
            f"per device, margin {format_gb(hw.device_budget - c.device_need)} after the {hw.reserve:.0%} reserve; "
            f"CPU {format_gb(c.estimate.cpu_peak)} of {format_gb(hw.cpu_memory)} per node")
