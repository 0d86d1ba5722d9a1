"""Setting a model's MoE layers up at initialize: their groups, and their experts' first values.

`prepare_experts` finds DeepSpeed `MoE` layers and AutoEP's expert banks, creates each expert-parallel size's groups
(moe/ep_groups.py), attaches the expert-parallel group to the layers, and makes the ranks of each
expert-data-parallel group agree on their experts (rank 0's dense broadcast skips expert
parameters: zero/stage0.py::broadcast_module_state), as DeepSpeed's engine does.
`routing_telemetry` gives the engine its layers' route counters (moe/telemetry.py). Imports
torch, `zeroshard.comm`, `zeroshard.errors` and the moe package's own modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

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
                    *, tp_comm: Comm | None = None, pipeline: Comm | None = None,
                    whole_of: Callable[[nn.Parameter], Tensor | None] | None = None) -> list[ExpertParams] | None:
    """Groups for every expert layer of `module`, and the trainable expert parameters by group.

    Collective over the world; every rank passes the same model. Returns None for a model without
    expert parameters, and [] for a pipeline stage without any whose pipeline has them in another
    stage (its strategy must still take part in the experts' norm: zero/expert_split.py). Hugging
    Face expert banks are cut to this rank's experts here (moe/hf_experts.py::shard_expert_bank;
    `whole_of` reads a bank zero.Init cut: Note: [expert banks under zero.Init]).

    Note: [experts under tensor parallelism] `dp` is the data-parallel axis of this rank's
    tensor-parallel rank, so the expert groups are made of ranks with the same tensor-parallel rank
    (comm/groups.py::subgroup makes the same split in every sibling group). Experts are not split
    by AutoTP (tensor_parallel/tp_plan.py::shard_model): every tensor-parallel rank holds the same
    experts (made equal here over `tp_comm`), routes the same replicated tokens and gets the same
    expert gradients; the gradient norm counts them on tensor-parallel rank 0 only
    (zero/expert_split.py). DeepSpeed's `enable_expert_tensor_parallelism` (experts split by
    tensor parallelism) stays refused (moe/layer.py).

    Note: [experts in pipeline stages] With a PipelineModule, `module` is this rank's stage and
    `dp` its data-parallel group; stages hold different expert layers, or none. Creating a group
    is collective over the world, so the stages first agree on every expert-parallel size any of
    them uses (`pipeline`, the world's Comm) and every rank creates each size's groups, in
    increasing size, whether its stage uses it or not.

    Raises:
        NotSupportedError: expert parameters outside any expert layer.
    """
    layers = expert_layers(module)
    experts = [p for p in params if is_moe_param(p)]
    elsewhere = False
    if pipeline is not None:  # Note: [experts in pipeline stages]
        sizes = _sizes_of_every_pipeline_rank({layer.ep_size for layer in layers}, pipeline)
        for size in sizes:
            create_expert_groups(dp, size, comm)
        elsewhere = bool(sizes)
    if not layers and not experts:
        return [] if elsewhere else None
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
            shard_expert_bank(layer, groups.ep_comm, comm, whole_of)
        if tp_comm is not None and tp_comm.world_size > 1:  # Note: [experts under tensor parallelism]
            tp_comm.broadcast_values(list(layer.parameters()) if isinstance(layer, ExpertParallelBank)
                                     else list(layer.deepspeed_moe.experts.parameters()))
    return [ExpertParams(g, [p for p in experts if p.group_name == name]) for name, g in by_name.items()
            if any(p.group_name == name for p in experts)]


def _sizes_of_every_pipeline_rank(mine: set[int], world: Comm) -> list[int]:
    """The expert-parallel sizes any rank of `world` uses, in increasing order (one collective)."""
    flags = torch.zeros(world.world_size + 1, dtype=torch.int32)
    for size in mine:
        flags[size] = 1
    world.all_reduce(flags, op="max")
    return [size for size in range(1, world.world_size + 1) if flags[size]]


def _broadcast_experts(layer: MoE, edp_comm: Comm) -> None:
    """The first rank of the expert-data-parallel group's expert values to the others."""
    edp_comm.broadcast_values(list(layer.deepspeed_moe.experts.parameters()))
