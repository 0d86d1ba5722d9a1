"""Setting a model's MoE layers up at initialize: their groups, and their experts' first values.

`prepare_experts` finds DeepSpeed `MoE` layers and AutoEP's expert banks, creates each expert-parallel size's groups
(moe/ep_groups.py), attaches the expert-parallel group to the layers, and makes the ranks of each
expert-data-parallel group agree on their experts (rank 0's dense broadcast skips expert
parameters: zero/stage0.py::broadcast_module_state), as DeepSpeed's engine does.
`routing_telemetry` gives the engine its layers' route counters (moe/telemetry.py). Imports
torch, `zeroshard.comm`, `zeroshard.errors` and the moe package's own modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.comm import Comm, ProcessGroups
from zeroshard.errors import NotSupportedError
from zeroshard.moe.ep_groups import ExpertGroups, create_expert_groups
from zeroshard.moe.hf_experts import ExpertParallelBank, shard_expert_bank
from zeroshard.moe.layer import MoE
from zeroshard.moe.telemetry import RoutingTelemetry
from zeroshard.moe.utils import is_moe_param


@dataclass(frozen=True, slots=True)
class ExpertParams:
    """One expert group's trainable parameters and its groups (what the ZeRO strategy needs)."""

    groups: ExpertGroups
    params: list[nn.Parameter]
    """In the order of the `params` list given to `prepare_experts`."""


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def expert_layers(module: nn.Module) -> list[nn.Module]:
    """DeepSpeed `MoE` layers and Hugging Face expert banks marked for AutoEP (moe/hf_experts.py),
    in module order: each has `ep_size` and `expert_group_name`."""
    return [m for m in module.modules() if isinstance(m, (MoE, ExpertParallelBank))]


def expert_modules(module: nn.Module, group_name: str) -> list[nn.Module]:
    """This rank's expert modules of every expert layer of group `group_name`, layer by layer: ZeRO
    stage 3 gathers each as one unit over the expert-data-parallel group (a DeepSpeed layer's local
    experts one by one; a bank whole)."""
    out: list[nn.Module] = []
    for layer in expert_layers(module):
        if layer.expert_group_name == group_name:
            out += list(layer.deepspeed_moe.experts.deepspeed_experts) if isinstance(layer, MoE) else [layer]
    return out


def routing_telemetry(module: nn.Module) -> RoutingTelemetry | None:
    """Route counters on every MoE layer's gate and AutoEP bank (moe/telemetry.py), named by the
    layer's name in `module`; None, and nothing attached, for a model without either."""
    layers = [(name, m.deepspeed_moe.gate if isinstance(m, MoE) else m) for name, m in module.named_modules()
              if isinstance(m, (MoE, ExpertParallelBank))]
    return RoutingTelemetry(layers) if layers else None


def expert_parallel_size(module: nn.Module) -> int:
    """The largest `ep_size` of `module`'s expert layers (1 without any): the `ep` of the job's
    ParallelDims, validated against the data-parallel size before any group exists."""
    return max((layer.ep_size for layer in expert_layers(module)), default=1)


def prepare_experts(module: nn.Module, params: list[nn.Parameter], dp: ProcessGroups, comm: Comm,
                    *, model_parallel: bool = False) -> list[ExpertParams]:
    """Groups for every expert layer of `module`, and the trainable expert parameters by group.

    Collective over the data-parallel group; every rank passes the same model. Returns [] for a
    model without expert parameters. Hugging Face expert banks are cut to this rank's experts here
    (moe/hf_experts.py::shard_expert_bank).

    Raises:
        NotSupportedError: expert parameters with tensor or pipeline parallelism
            (`model_parallel`), or expert parameters outside any expert layer.
    """
    layers = expert_layers(module)
    experts = [p for p in params if is_moe_param(p)]
    if not layers and not experts:
        return []
    if model_parallel:
        raise NotSupportedError("MoE layers with tensor or pipeline parallelism are not implemented: train the MoE "
                                "model with data and expert parallelism only (tensor_parallel.autotp_size 1, no "
                                "PipelineModule, no mpu)")
    names = {layer.expert_group_name for layer in layers}
    stray = sorted({str(getattr(p, "group_name", None)) for p in experts} - names)
    if stray:
        raise NotSupportedError(f"expert parameters of group(s) {stray} belong to no zeroshard MoE layer of the model "
                                "(DeepSpeed marks them allreduce=False); build the layers with zeroshard.moe.layer.MoE "
                                "(deepspeed.moe.layer.MoE through the alias)")
    by_name: dict[str, ExpertGroups] = {}
    for layer in layers:  # same order on every rank: the model is the same
        groups = by_name.get(layer.expert_group_name)
        if groups is None:
            groups = by_name[layer.expert_group_name] = create_expert_groups(dp, layer.ep_size, comm)
        if isinstance(layer, MoE):
            layer.deepspeed_moe.set_ep_comm(groups.ep_comm)
            _broadcast_experts(layer, groups.edp_comm)
        else:
            shard_expert_bank(layer, groups.ep_comm, comm)
    return [ExpertParams(g, [p for p in experts if p.group_name == name]) for name, g in by_name.items()
            if any(p.group_name == name for p in experts)]


@torch.no_grad()
def _broadcast_experts(layer: MoE, edp_comm: Comm) -> None:
    """The first rank of the expert-data-parallel group's expert values to the others."""
    tensors = [p for p in layer.deepspeed_moe.experts.parameters() if p.numel() > 0]
    if edp_comm.world_size == 1 or not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    edp_comm.broadcast(flat, src=0)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
