"""Pick and build the ZeRO strategy for a config: the one place that looks at the stage."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from zeroshard.comm.groups import node_size
from zeroshard.errors import NotSupportedError
from zeroshard.moe.prepare import expert_modules, prepare_experts
from zeroshard.moe.utils import is_moe_param
from zeroshard.zero.expert_split import build_expert_split
from zeroshard.zero.init_partition import init_partitioned, take_whole
from zeroshard.zero.leaf import apply_leaf_config, granularity_units, leaf_units
from zeroshard.zero.offload.policy import OffloadPolicy
from zeroshard.zero.offload.zenflow import ZenFlowRule
from zeroshard.zero.stage0 import Stage0Strategy
from zeroshard.zero.stage3 import Stage3Strategy
from zeroshard.zero.stage3_options import Stage3Options
from zeroshard.zero.stage12 import PartitionOptions, Stage1Strategy, Stage2Strategy
from zeroshard.zero.strategy import ModelParallelNorm, ZeroStrategy
from zeroshard.zero.units import default_units

if TYPE_CHECKING:
    from zeroshard.comm import Comm, ProcessGroups
    from zeroshard.config import Config

logger = logging.getLogger("zeroshard")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else DTYPES[name]


def resolve_units(module: nn.Module, units: Sequence[nn.Module | type[nn.Module]]) -> list[nn.Module]:
    """Stage-3 units from modules and/or module classes (every instance of the class), root first."""
    classes = tuple(u for u in units if isinstance(u, type))
    chosen = [u for u in units if isinstance(u, nn.Module)]
    chosen += [m for m in module.modules() if classes and isinstance(m, classes) and m is not module]
    return [module] + list({id(m): m for m in chosen if m is not module}.values())


def _use_reduce_scatter(configured: bool, comm: "Comm") -> bool:
    """Whether sharded gradient buckets are reduce-scattered, or all-reduced keeping a chunk.

    gloo's reduce-scatter clones its whole input bucket and then costs 1.3-1.9x an all-reduce
    of the same buffer (bench/results.md, collectives); all-reducing in place and keeping this
    rank's chunk gives the same sums (bitwise at 2 ranks) faster and without the clone. So on
    gloo every sharded stage all-reduces, unless the group's collectives go through shared
    memory (one host: Note: [shared-memory collectives] in comm/shm.py), where a reduce-scatter
    moves half an all-reduce's bytes; elsewhere `reduce_scatter` decides.
    """
    return configured and (comm.groups.backend != "gloo" or comm.shares_memory())


def _names(module: nn.Module, params: Sequence[nn.Parameter]) -> tuple[str, ...]:
    """`params`' names in `module` (the first name of a tied parameter)."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return tuple(names.get(id(p), "?") for p in params)


def build_strategy(cfg: "Config", module: nn.Module, params: list[nn.Parameter], comm: "Comm",
                   groups: "ProcessGroups", units: Sequence[nn.Module | type[nn.Module]] | None = None,
                   norm_group: ModelParallelNorm | None = None, hpz_size: int = 1, tp_comm: "Comm | None" = None,
                   pipeline: "Comm | None" = None) -> ZeroStrategy:
    """The strategy for `cfg.zero_optimization.stage` over the trainable `params`.

    `hpz_size`: ZeRO++ hpZ's shard (``ParallelDims.dp_shard``, decided and checked against the node
    layout in comm/parallel_dims.py; 1: off).

    `comm` and `groups` are the data-parallel group (``MeshGroups.axis("dp")``, comm/topology.py);
    `norm_group` sums the gradient norm over the ranks holding the other parts of the model
    (tensor-parallel ranks and pipeline stages), each parameter counted once (Note: [norm groups]).

    `units` (stage 3): modules or module classes gathered as one; default: every block of a
    ModuleList, plus the root.

    A model with DeepSpeed `MoE` layers gets its expert groups here (moe/prepare.py) and one
    strategy per expert group beside the dense one (Note: [expert gradients] in zero/expert_split.py);
    `tp_comm` (the tensor-parallel group) makes the experts equal over it (Note: [experts under tensor
    parallelism] in moe/prepare.py); `pipeline` (the world's Comm, for a PipelineModule's stage) lets
    the stages agree on their expert groups (Note: [experts in pipeline stages] there).

    Note: [experts at stage 3] Ranks hold different experts, so an expert cannot be partitioned
    over the data-parallel group as a dense parameter is: its shards would mix experts. Stage 3
    therefore has two kinds of owner over one module. The dense `Stage3Strategy` partitions every
    parameter but the experts (`include`) over the data-parallel group, in the usual units. Each
    expert group's `Stage3Strategy` partitions that group's experts over its expert-data-parallel
    group (the ranks holding the same experts), one unit per local expert module, taken as they
    are (`exact_units`: a `MoE` leaf mark must not fold them into the layer's dense unit). Every
    rank runs each of its local experts on every forward (capacity buffers), so the expert units'
    gathers happen in the same order on the ranks of a group, whatever the routing. Each parameter
    knows its owner (`ZeroParamState.owner`), which is how `GatheredParameters`, checkpoints and
    exports reach both kinds.
    """
    experts = prepare_experts(module, params, groups, comm, tp_comm=tp_comm, pipeline=pipeline, whole_of=take_whole)
    if experts is None:
        return _build_group_strategy(cfg, module, params, comm, groups, units, norm_group, hpz_size=hpz_size)
    _check_experts_config(cfg, params)
    dense = [p for p in params if not is_moe_param(p)]
    zero3 = cfg.zero_optimization.stage == 3
    dense_ids = {id(p) for p in module.parameters() if not is_moe_param(p)} if zero3 else None

    def build_part(part: list[nn.Parameter], part_comm: "Comm", part_groups: "ProcessGroups") -> ZeroStrategy:
        if part is dense:
            return _build_group_strategy(cfg, module, part, part_comm, part_groups, units if zero3 else None,
                                         norm_group, include=dense_ids)
        if not zero3:
            return _build_group_strategy(cfg, module, part, part_comm, part_groups, None, None)
        expert_units = expert_modules(module, part[0].group_name)  # Note: [experts at stage 3]
        return _build_group_strategy(cfg, module, part, part_comm, part_groups, [module, *expert_units], None,
                                     include={id(p) for m in expert_units for p in m.parameters()}, exact_units=True)

    return build_expert_split(
        dense, [(e.params, e.groups.edp_comm, e.groups.edp, e.groups.ep_comm) for e in experts], build_part,
        comm, groups, average=cfg.gradient_allreduce_op == "mean",
        # DeepSpeed's fp32 ZeRO 0 clips by its clip_grad_norm_, the mean of the ranks' norms; elsewhere,
        # and with tensor parallelism, the global norm (Note: [expert gradients] in zero/expert_split.py).
        norm_rule="rank_mean" if cfg.zero_optimization.stage == 0 and cfg.precision == "fp32" and norm_group is None
        else "global", norm_group=norm_group)


def _check_experts_config(cfg: "Config", params: list[nn.Parameter]) -> None:
    """What the expert split does not cover, refused by key."""
    zero = cfg.zero_optimization
    for key, section in (("offload_optimizer", zero.offload_optimizer), ("offload_param", zero.offload_param)):
        if section.device == "nvme":  # one swapper per part is not built; "cpu" is
            raise NotSupportedError(
                f"zero_optimization.{key}.device \"nvme\" with MoE layers is not implemented: set it to \"cpu\" "
                "(or \"none\")")
    if zero.offload_optimizer.delayed_update:  # each part would need its own settle; not built
        raise NotSupportedError("zero_optimization.offload_optimizer.delayed_update with MoE layers is not "
                                "implemented: set it to false (the CPU offload itself works)")
    if zero.offload_optimizer.ratio < 1.0:
        raise NotSupportedError("zero_optimization.offload_optimizer.ratio below 1 with MoE layers is not "
                                "implemented: remove the key (the CPU offload itself works)")
    if zero.zenflow.enabled:  # ExpertSplitStrategy.wrap_optimizer would drop its selective step unsaid
        raise NotSupportedError("zero_optimization.zenflow with MoE layers is not implemented: "
                                "the dense parameters and each expert group are separate strategies, and ZenFlow's "
                                "step is built for one; remove the zenflow section (the CPU offload itself works)")
    if zero.stage != 3:
        return
    if int(zero.zero_hpz_partition_size) > 1:
        raise NotSupportedError("zero_optimization.zero_hpz_partition_size > 1 with MoE layers is not implemented: "
                                "set it to 1 (expert parameters are partitioned over their expert-data-parallel "
                                "group only)")
    if any(is_moe_param(p) and init_partitioned(p) for p in params):
        raise NotSupportedError(
            "MoE layers built inside zeroshard.zero.Init (deepspeed.zero.Init) are not implemented: zero.Init "
            "partitions every parameter over all data-parallel ranks, but ranks hold different experts; build "
            "the model outside zero.Init (stage 3 then partitions the experts over their expert-data-parallel "
            "group at initialize)")


def _build_group_strategy(cfg: "Config", module: nn.Module, params: list[nn.Parameter], comm: "Comm",
                          groups: "ProcessGroups", units: Sequence[nn.Module | type[nn.Module]] | None,
                          norm_group: ModelParallelNorm | None, *, include: set[int] | None = None,
                          exact_units: bool = False, hpz_size: int = 1) -> ZeroStrategy:
    """`build_strategy` for one set of parameters over one group. Stage 3: `include` limits the
    partition to those parameters, and `exact_units` takes `units` (modules, root first) as they
    are, without leaf modules or coarsening (Note: [experts at stage 3])."""
    zero = cfg.zero_optimization
    grad_dtype = _dtype(cfg.accumulation_dtype) or torch.float32
    # bf16 masters (cfg.bf16_masters): the master shard and the gradients are bf16, and torch
    # optimizers keep their states in their (bf16) parameters' dtype.
    master_dtype = torch.bfloat16 if cfg.bf16_masters else torch.float32
    comm_dtype = _dtype(cfg.communication_data_type)
    # "sum" reduces without any division, as DeepSpeed's (its predivide factor is unused then);
    # stage 3 with "sum" is refused at config load (config/load.py::check_allreduce_op).
    average = cfg.gradient_allreduce_op == "mean"
    prescale = cfg.gradient_predivide_factor if cfg.prescale_gradients and average else 1.0
    if zero.stage == 0:
        return Stage0Strategy(params, comm=comm, world_size=groups.world_size, grad_dtype=grad_dtype,
                              comm_dtype=comm_dtype, reduce_bucket_numel=int(zero.reduce_bucket_size),
                              prescale_factor=prescale, average=average, norm_group=norm_group)
    if zero.stage in (1, 2):
        options = PartitionOptions(
            grad_dtype=grad_dtype,
            master_dtype=master_dtype,
            comm_dtype=comm_dtype,
            bucket_numel=max(1, min(int(zero.reduce_bucket_size), int(zero.allgather_bucket_size))),
            prescale_factor=prescale,
            average=average,
            overlap_comm=bool(zero.overlap_comm),
            reduce_scatter=_use_reduce_scatter(bool(zero.reduce_scatter), comm),
            allgather_partitions=bool(zero.allgather_partitions),
            offload=dataclasses.replace(
                OffloadPolicy.from_config(zero.offload_optimizer, sub_group_size=int(zero.sub_group_size), aio=cfg.aio),
                zenflow=ZenFlowRule.from_config(zero.zenflow)),
            ignore_unused=bool(zero.ignore_unused_parameters),
            param_names=_names(module, params) if not zero.ignore_unused_parameters else (),
        )
        cls = Stage1Strategy if zero.stage == 1 else Stage2Strategy
        return cls(params, comm=comm, rank=groups.rank, world_size=groups.world_size, options=options,
                   norm_group=norm_group)
    if zero.stage == 3:
        options3 = _zero3_options(cfg, comm, groups, grad_dtype, master_dtype, comm_dtype, prescale, hpz_size)
        return Stage3Strategy(module, params, comm=comm, options=options3,
                              units=_zero3_units(cfg, module, units, exact_units), norm_group=norm_group,
                              include=include)
    raise AssertionError(f"stage {zero.stage} passed config validation but has no strategy")


def _zero3_options(cfg: "Config", comm: "Comm", groups: "ProcessGroups", grad_dtype: torch.dtype,
                    master_dtype: torch.dtype, comm_dtype: torch.dtype | None, prescale: float,
                    hpz_size: int) -> Stage3Options:
    zero = cfg.zero_optimization
    return Stage3Options(
        grad_dtype=grad_dtype,
        master_dtype=master_dtype,
        comm_dtype=comm_dtype,
        persistence_threshold=int(zero.stage3_param_persistence_threshold),
        persistence_budget=int(zero.stage3_model_persistence_threshold),
        prefetch_numel=int(zero.stage3_prefetch_bucket_size),
        max_live_numel=int(zero.stage3_max_live_parameters),
        max_reuse_distance=int(zero.stage3_max_reuse_distance),
        release_grads=bool(zero.stage3_release_grads),
        prescale_factor=prescale,
        overlap_comm=bool(zero.overlap_comm),
        reduce_scatter=_use_reduce_scatter(bool(zero.reduce_scatter), comm),
        offload_optimizer=dataclasses.replace(OffloadPolicy.from_config(
            zero.offload_optimizer, sub_group_size=int(zero.sub_group_size), aio=cfg.aio),
            zenflow=ZenFlowRule.from_config(zero.zenflow)),
        offload_param=OffloadPolicy.from_config(zero.offload_param),
        quantized_gradients=bool(zero.zero_quantized_gradients),
        quantized_weights=bool(zero.zero_quantized_weights),
        node_size=node_size(groups),
        hpz_size=hpz_size,
        float8_gather=cfg.fp8.enabled and cfg.fp8.float8_all_gather,
    )


def _zero3_units(cfg: "Config", module: nn.Module, units: Sequence[nn.Module | type[nn.Module]] | None,
                  exact_units: bool) -> list[nn.Module]:
    """The modules stage 3 gathers as one: `units` as they are (`exact_units`), else the chosen units
    (default: each ModuleList block and the root) with `zero_optimization.leaf_module` (default:
    DeepSpeed's MoE block classes; marks set by set_z3_leaf_modules are kept) and the granularity
    threshold applied."""
    if exact_units:
        return list(units or [module])
    zero = cfg.zero_optimization
    leaf = zero.leaf_module
    apply_leaf_config(module, leaf.classes, leaf.names, leaf.name_suffixes)
    chosen = resolve_units(module, units) if units else default_units(module)
    if zero.stage3_module_granularity_threshold > 0:
        chosen = _coarsened(module, chosen, int(zero.stage3_module_granularity_threshold))
    return leaf_units(module, chosen)


def _coarsened(module: nn.Module, units: list[nn.Module], threshold: int) -> list[nn.Module]:
    """`stage3_module_granularity_threshold`: the units with each fine-grained module that
    contains some of them gathered as one (zero/leaf.py, `granularity_units`), said in the log."""
    coarse, smallest = granularity_units(module, units, threshold)
    if smallest > threshold:
        logger.warning(f"zero_optimization.stage3_module_granularity_threshold={threshold} selects no module: the "
                       f"smallest module granularity in the model is {smallest}; set it to at least that to gather "
                       "fine-grained modules as one unit")
    else:
        logger.info(f"stage3_module_granularity_threshold={threshold}: {len(units)} stage-3 units became "
                    f"{len(coarse)}")
    return coarse

