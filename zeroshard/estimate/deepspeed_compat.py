"""DeepSpeed's memory-estimator API (`estimate_zero2/3_model_states_mem_needs_all_live/_cold`).

Same names, arguments and printed table as `deepspeed.runtime.zero.stage_1_and_2` and
`deepspeed.runtime.zero.stage3`. By default the figures are zeroshard's (what zeroshard will
hold: estimate/states.py); `formulas="deepspeed"` prints DeepSpeed 0.19's own formulas, for
comparison. "All live" means the model object is at hand and its sizes are read from it;
"all cold" means only the counts are given. Imports torch and `zeroshard.estimate` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from zeroshard.estimate.spec import ModelSpec, spec_from_counts, spec_from_module
from zeroshard.estimate.states import Precision, Setup, estimate_node

Formulas = Literal["zeroshard", "deepspeed"]
GiB = 2**30
"""DeepSpeed prints bytes / 2**30 and labels them "GB"; so do we."""


@dataclass(frozen=True, slots=True)
class EstimateRow:
    """One printed line: bytes per node's CPU, bytes per GPU, and the options."""

    cpu_bytes: int
    gpu_bytes: int
    offload_optimizer: str
    offload_param: str | None = None
    zero_init: bool | None = None

    def options(self) -> str:
        opt = f"offload_optimizer={self.offload_optimizer:4}"
        if self.offload_param is None:
            return opt
        return f"offload_param={self.offload_param:4}, {opt}, zero_init={int(bool(self.zero_init))}"

    def line(self) -> str:
        return f" {self.cpu_bytes / GiB:7.2f}GB | {self.gpu_bytes / GiB:6.2f}GB | {self.options()}"


# -- DeepSpeed 0.19's formulas (facts from its docs and estimator; see docs/estimate.md) --------

def estimate_zero2_model_states_mem_needs(total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """DeepSpeed's ZeRO-2 figures: (CPU bytes per node, GPU bytes per GPU).

    GPU: 2*params with optimizer offload, else 2*params + 18*params/total_gpus (16-bit
    params; 16-bit and fp32 gradients, fp32 master and Adam's two states partitioned).
    CPU: params*max(4*total_gpus, 16)*factor with offload, else params*4*gpus_per_node*factor
    (the fp32 model each process builds before moving it to its GPU).
    """
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def estimate_zero3_model_states_mem_needs(total_params: float, largest_layer_params: float,
                                          num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True, cpu_offload_params: bool = True,
                                          zero_init: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """DeepSpeed's ZeRO-3 figures: (CPU bytes per node, GPU bytes per GPU, largest layer bytes).

    largest_layer_memory = 4*largest_layer_params (16-bit params and gradients gathered).
    GPU: that + 18*params/total_gpus without offload; + 2*params/total_gpus with optimizer
    offload; just that with both offloaded. CPU per node (gpus_factor = 1/nodes): 18 or 16
    *params*gpus_factor*factor with offload (at least 4*params*gpus_per_node without
    zero.Init), else 4 bytes of the largest layer (zero.Init) or of the model, per GPU.
    """
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload:
        per_param = 18 if cpu_offload_params else 16
        gpu = largest if cpu_offload_params else largest + int(2 * total_params / total_gpus)
        mult = per_param * gpus_factor if zero_init else max(4 * num_gpus_per_node, per_param * gpus_factor)
        cpu = total_params * mult * additional_buffer_factor
    else:
        gpu = largest + int(18 * total_params / total_gpus)
        base = largest_layer_params if zero_init else total_params
        cpu = base * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), int(largest)


# -- the rows, by DeepSpeed's or zeroshard's accounting -----------------------------------------

def zero2_rows(spec: ModelSpec, num_gpus_per_node: int, num_nodes: int, additional_buffer_factor: float,
               formulas: Formulas, precision: Precision = "bf16") -> list[EstimateRow]:
    rows = []
    for offload in (True, False):
        if formulas == "deepspeed":
            cpu, gpu = estimate_zero2_model_states_mem_needs(spec.total_params, num_gpus_per_node, num_nodes,
                                                             offload, additional_buffer_factor)
        else:
            node = estimate_node(spec, Setup(zero_stage=2, offload_optimizer="cpu" if offload else "none",
                                             precision=precision, devices_per_node=num_gpus_per_node,
                                             nodes=num_nodes))
            cpu, gpu = int(node.cpu_peak * additional_buffer_factor), node.device_peak
        rows.append(EstimateRow(cpu, gpu, "cpu" if offload else "none"))
    return rows


def zero3_rows(spec: ModelSpec, num_gpus_per_node: int, num_nodes: int, additional_buffer_factor: float,
               formulas: Formulas, precision: Precision = "bf16") -> list[EstimateRow]:
    rows = []
    for opt_off, param_off in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            if formulas == "deepspeed":
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                    spec.total_params, spec.largest_layer_params, num_gpus_per_node, num_nodes,
                    opt_off, param_off, zero_init, additional_buffer_factor)
            else:
                node = estimate_node(spec, Setup(
                    zero_stage=3, offload_optimizer="cpu" if opt_off else "none",
                    offload_param="cpu" if param_off else "none", precision=precision,
                    devices_per_node=num_gpus_per_node, nodes=num_nodes, zero_init=zero_init))
                cpu, gpu = int(node.cpu_peak * additional_buffer_factor), node.device_peak
            rows.append(EstimateRow(cpu, gpu, "cpu" if opt_off else "none",
                                    "cpu" if param_off else "none", zero_init))
    return rows


def format_rows(spec: ModelSpec, rows: list[EstimateRow], num_gpus_per_node: int, num_nodes: int,
                formulas: Formulas, precision: Precision = "bf16", with_largest: bool = False) -> str:
    """DeepSpeed's printed table; zeroshard's figures get one extra line saying whose they are."""
    sw = f"SW: Model with {int(spec.total_params / 1e6)}M total params"
    sw += f", {int(spec.largest_layer_params / 1e6)}M largest layer params." if with_largest else "."
    lines = ["Estimated memory needed for params, optim states and gradients for a:",
             f"HW: Setup with {num_nodes} {'nodes' if num_nodes > 1 else 'node'}, {num_gpus_per_node} "
             f"{'GPUs' if num_gpus_per_node > 1 else 'GPU'} per node.", sw]
    if formulas == "zeroshard":
        lines.append(f"(zeroshard's accounting, {precision} mixed precision: fp32 gradients, transient "
                     "buffers included; formulas='deepspeed' prints DeepSpeed's)" if precision != "fp32"
                     else "(zeroshard's accounting, fp32 training)")
    lines.append("  per CPU  |  per GPU |   Options")
    lines += [r.line() for r in rows]
    return "\n".join(lines)


def _report(spec: ModelSpec, rows: list[EstimateRow], gpus: int, nodes: int, formulas: Formulas,
            precision: Precision, with_largest: bool) -> list[EstimateRow]:
    print(format_rows(spec, rows, gpus, nodes, formulas, precision, with_largest))
    return rows


def estimate_zero2_model_states_mem_needs_all_live(
        model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5,
        *, formulas: Formulas = "zeroshard", precision: Precision = "bf16") -> list[EstimateRow]:
    """Print (and return) ZeRO-2 memory needs for a live model, with and without optimizer offload.

    Args:
        model: the model (its parameters' sizes are read; a meta-device model is fine).
        num_gpus_per_node: devices per node.
        num_nodes: nodes.
        additional_buffer_factor: CPU figures are multiplied by it (DeepSpeed's 1.5 margin).
        formulas: "zeroshard" (what zeroshard holds) or "deepspeed" (DeepSpeed's formulas).
        precision: training precision for zeroshard's figures ("bf16", "fp16", "fp32").

    Returns:
        The printed rows: CPU bytes per node, GPU bytes per device, options.

    Example:
        >>> rows = estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=8)  # doctest: +SKIP
    """
    spec = spec_from_module(model)
    rows = zero2_rows(spec, num_gpus_per_node, num_nodes, additional_buffer_factor, formulas, precision)
    return _report(spec, rows, num_gpus_per_node, num_nodes, formulas, precision, False)


def estimate_zero2_model_states_mem_needs_all_cold(
        total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5,
        *, formulas: Formulas = "zeroshard", precision: Precision = "bf16") -> list[EstimateRow]:
    """As `..._all_live`, from the parameter count alone (no model needed)."""
    spec = spec_from_counts(total_params)
    rows = zero2_rows(spec, num_gpus_per_node, num_nodes, additional_buffer_factor, formulas, precision)
    return _report(spec, rows, num_gpus_per_node, num_nodes, formulas, precision, False)


def estimate_zero3_model_states_mem_needs_all_live(
        model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5,
        *, formulas: Formulas = "zeroshard", precision: Precision = "bf16") -> list[EstimateRow]:
    """Print (and return) ZeRO-3 memory needs for a live model: six rows, as DeepSpeed prints.

    The rows cover parameter + optimizer offload, optimizer offload alone and no offload, each
    with and without zero.Init (which decides the CPU memory needed while the model is built).
    Arguments as `estimate_zero2_model_states_mem_needs_all_live`.
    """
    spec = spec_from_module(model)
    rows = zero3_rows(spec, num_gpus_per_node, num_nodes, additional_buffer_factor, formulas, precision)
    return _report(spec, rows, num_gpus_per_node, num_nodes, formulas, precision, True)


def estimate_zero3_model_states_mem_needs_all_cold(
        total_params: float, largest_layer_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1,
        additional_buffer_factor: float = 1.5, *, formulas: Formulas = "zeroshard",
        precision: Precision = "bf16") -> list[EstimateRow]:
    """As `estimate_zero3_model_states_mem_needs_all_live`, from the two counts alone."""
    spec = spec_from_counts(total_params, largest_layer_params)
    rows = zero3_rows(spec, num_gpus_per_node, num_nodes, additional_buffer_factor, formulas, precision)
    return _report(spec, rows, num_gpus_per_node, num_nodes, formulas, precision, True)
