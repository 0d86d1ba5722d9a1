"""Pick and build the ZeRO strategy for a config: the one place that looks at the stage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from zeroshard.zero.leaf import DEFAULT_LEAF_CLASSES, apply_leaf_config, leaf_units
from zeroshard.zero.stage0 import Stage0Strategy
from zeroshard.zero.stage12 import PartitionedStrategy, PartitionOptions
from zeroshard.zero.stage3 import Stage3Options, Stage3Strategy
from zeroshard.zero.strategy import ZeroStrategy
from zeroshard.zero.units import default_units

if TYPE_CHECKING:
    from zeroshard.comm import Comm, ProcessGroups
    from zeroshard.config import Config

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else DTYPES[name]


def resolve_units(module: nn.Module, units: Sequence[nn.Module | type[nn.Module]]) -> list[nn.Module]:
    """Stage-3 units from modules and/or module classes (every instance of the class), root first."""
    classes = tuple(u for u in units if isinstance(u, type))
    chosen = [u for u in units if isinstance(u, nn.Module)]
    chosen += [m for m in module.modules() if classes and isinstance(m, classes) and m is not module]
    return [module] + list({id(m): m for m in chosen if m is not module}.values())


def _mark_leaves(module: nn.Module, zero: object) -> None:
    """Apply `zero_optimization.leaf_module` where the config models it; else DeepSpeed's
    default leaf classes (its MoE blocks). Marks set by `set_z3_leaf_modules` are kept."""
    leaf = getattr(zero, "leaf_module", None)
    if leaf is None:
        apply_leaf_config(module, DEFAULT_LEAF_CLASSES, (), ())
        return
    apply_leaf_config(module, tuple(getattr(leaf, "classes", DEFAULT_LEAF_CLASSES)),
                      tuple(getattr(leaf, "names", ())), tuple(getattr(leaf, "name_suffixes", ())))


def build_strategy(cfg: "Config", module: nn.Module, params: list[nn.Parameter], comm: "Comm",
                   groups: "ProcessGroups", units: Sequence[nn.Module | type[nn.Module]] | None = None,
                   ) -> ZeroStrategy:
    """The strategy for `cfg.zero_optimization.stage` over the trainable `params`.

    `units` (stage 3): modules or module classes gathered as one; default: every block of a
    ModuleList, plus the root.
    """
    zero = cfg.zero_optimization
    grad_dtype = _dtype(cfg.data_types.grad_accum_dtype) or torch.float32
    comm_dtype = _dtype(cfg.communication_data_type)
    prescale = cfg.gradient_predivide_factor if cfg.prescale_gradients else 1.0
    if zero.stage == 0:
        return Stage0Strategy(params, comm=comm, world_size=groups.world_size, grad_dtype=grad_dtype,
                              comm_dtype=comm_dtype, reduce_bucket_numel=int(zero.reduce_bucket_size),
                              prescale_factor=prescale)
    if zero.stage in (1, 2):
        offload = zero.offload_optimizer
        options = PartitionOptions(
            stage=zero.stage,
            grad_dtype=grad_dtype,
            comm_dtype=comm_dtype,
            bucket_numel=max(1, min(int(zero.reduce_bucket_size), int(zero.allgather_bucket_size))),
            prescale_factor=prescale,
            overlap_comm=bool(zero.overlap_comm),
            reduce_scatter=bool(zero.reduce_scatter),
            allgather_partitions=bool(zero.allgather_partitions),
            offload_device=torch.device("cpu") if offload.device == "cpu" else None,
            pin_memory=bool(offload.pin_memory),
        )
        return PartitionedStrategy(params, comm=comm, rank=groups.rank, world_size=groups.world_size,
                                   options=options)
    if zero.stage == 3:
        cpu = torch.device("cpu")
        options3 = Stage3Options(
            grad_dtype=grad_dtype,
            comm_dtype=comm_dtype,
            persistence_threshold=int(zero.stage3_param_persistence_threshold),
            prefetch_numel=int(zero.stage3_prefetch_bucket_size),
            max_live_numel=int(zero.stage3_max_live_parameters),
            max_reuse_distance=int(zero.stage3_max_reuse_distance),
            prescale_factor=prescale,
            overlap_comm=bool(zero.overlap_comm),
            optimizer_home=cpu if zero.offload_optimizer.device == "cpu" else None,
            param_home=cpu if zero.offload_param.device == "cpu" else None,
        )
        _mark_leaves(module, zero)
        chosen = resolve_units(module, units) if units else default_units(module)
        return Stage3Strategy(module, params, comm=comm, rank=groups.rank, world_size=groups.world_size,
                              options=options3, units=leaf_units(module, chosen))
    raise AssertionError(f"stage {zero.stage} passed config validation but has no strategy")
