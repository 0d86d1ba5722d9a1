"""How initialize() lays out a job with model parallelism: the data-parallel groups ZeRO runs on,
the model-parallel group the gradient norm spans, and the model sharded for tensor parallelism.

Two sources: the `tensor_parallel` section (AutoTP: groups from `comm/topology.py`'s (pp, dp, tp)
mesh, the model split by `tensor_parallel/tp_plan.py`), or a Megatron-style `mpu` object (the script built
its own tensor-parallel layers and groups; parameters it split carry Megatron's
`tensor_model_parallel = True`). Imports torch, comm, config, errors, zero, sequence (its groups) and
tensor_parallel/.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.comm import Comm, ProcessGroups
from zeroshard.comm.groups import wrap_process_group
from zeroshard.comm.parallel_dims import MpuShape
from zeroshard.comm.topology import MeshGroups, Topology, build_mesh
from zeroshard.config.schema_tp import TensorParallelConfig
from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.sequence.sp_groups import SequenceGroups
from zeroshard.tensor_parallel.tp_plan import TensorParallelState, resolve_plan, shard_model, tp_state_of
from zeroshard.zero.init_partition import unpartition
from zeroshard.zero.stage0 import broadcast_module_state
from zeroshard.zero.strategy import ModelParallelNorm

logger = logging.getLogger("zeroshard")

_RECORDED: weakref.WeakKeyDictionary[nn.Module, tuple[int, torch.dtype | None]] = weakref.WeakKeyDictionary()
_SEQUENCE_PARALLEL: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype | None = None,
                  config: Any = None, *, sequence_parallel: bool = False, **kwargs: Any) -> nn.Module:
    """Record tensor-parallel arguments for `initialize`, as DeepSpeed 0.19.8's `tp_model_init`
    does (the model is sharded in `initialize`, where the groups exist).

    Args:
        model: the whole model (every rank builds the same one).
        tp_size: the tensor-parallel size; the config's `tensor_parallel.autotp_size` must agree.
        dtype: the training dtype; must agree with the config's precision (fp16 / bf16 / fp32).
        config: the ds_config (a mapping, as Transformers' Trainer passes it) or None; its
            `tensor_parallel.autotp_size`, when set, must equal `tp_size`.
        sequence_parallel: zeroshard's option: keep the residual stream cut along the sequence
            between tensor-parallel regions (tensor_parallel/sequence.py; Hugging Face layouts).
        kwargs: DeepSpeed's other arguments (`tp_group`, ...): anything given raises NotSupportedError.

    Returns:
        `model`, unchanged.
    """
    if kwargs:
        raise NotSupportedError(f"not supported yet: tp_model_init({', '.join(kwargs)}=...); zeroshard builds the "
                                "tensor-parallel groups itself (comm/topology.py). Drop the argument(s).")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_model_init: tp_size must be an integer >= 1, got {tp_size!r}.")
    if config is not None:
        from zeroshard.config import read_config_file, tensor_parallel_size

        raw = config if isinstance(config, Mapping) else read_config_file(config)
        size = tensor_parallel_size(raw)
        if size > 1 and size != tp_size:
            raise ConfigError(f"tp_model_init(tp_size={tp_size}) and the config's tensor_parallel.autotp_size "
                              f"({size}) disagree; make them equal.")
    _RECORDED[model] = (tp_size, dtype)
    if sequence_parallel:
        _SEQUENCE_PARALLEL.add(model)
    return model


def recorded_tp(model: nn.Module) -> tuple[int, torch.dtype | None] | None:
    """What `tp_model_init` recorded for `model`, if it was called."""
    return _RECORDED.get(model)


def recorded_tp_size(model: nn.Module) -> int:
    """The tensor-parallel size `tp_model_init` recorded for `model` (1 when it was not called), one
    of the sources comm/parallel_dims.py's `resolve_dims` decides the size from."""
    rec = _RECORDED.get(model)
    return rec[0] if rec is not None else 1


def check_recorded_dtype(model: nn.Module, precision_dtype: torch.dtype) -> None:
    """`tp_model_init`'s dtype, when it named one, is the config's precision.

    Raises:
        ConfigError: they differ.
    """
    rec = _RECORDED.get(model)
    if rec is not None and rec[1] is not None and rec[1] != precision_dtype:
        raise ConfigError(f"tp_model_init(dtype={rec[1]}) does not match the config's precision ({precision_dtype}); "
                          "set fp16 / bf16 in the config to match, or pass that dtype.")


@dataclass
class ParallelGroups:
    """The groups one rank trains with."""

    world: ProcessGroups
    dp: ProcessGroups
    """ZeRO's data-parallel group (the batch is split over it)."""
    tp_comm: Comm | None
    """The model-parallel group the gradient norm spans; None without model parallelism."""
    tp_rank: int
    mesh: MeshGroups | None = None
    tp: TensorParallelState | None = None
    sequence: SequenceGroups | None = None
    """The sequence-parallel groups (zeroshard/sequence/sp_groups.py); None without sequence parallelism."""
    sequence_sum: bool = True
    """Sum the sequence-parallel ranks' gradients (False: average them, DeepSpeed 0.19.8's ZeRO-3 rule,
    which the `deepspeed` alias keeps: Note: [sequence-parallel gradients] in sequence/sp_setup.py)."""

    def norm_group(self, model: nn.Module, world_comm: Comm, *,
                   tied_duplicates: frozenset[int] = frozenset()) -> ModelParallelNorm | None:
        """The group the gradient norm sums over beyond ZeRO's data-parallel ranks, and what this rank
        leaves out of it (Note: [norm groups] in zero/strategy.py): the tensor-parallel ranks, and with
        pipeline stages the stages too (``axes("pp", "tp")``); a parameter not split over tp is counted
        by tp rank 0 only, a tied weight by the first stage holding it (`tied_duplicates`: this rank's
        tied weights when its stage is not their first holder). None without model parallelism."""
        pp = self.mesh.topology.pp if self.mesh is not None else 1
        if self.tp_comm is None and pp == 1:
            return None
        comm = self.tp_comm if pp == 1 else Comm(self.mesh.axes("pp", "tp"), timeout_s=world_comm.timeout_s,
                                                 log=world_comm.log, label="norm")
        dup = set(tied_duplicates)
        if self.tp_rank != 0:
            split = set(self.tp.split) if self.tp is not None else set()
            dup |= {id(p) for n, p in model.named_parameters()
                    if n not in split and not getattr(p, "tensor_model_parallel", False)}
        return ModelParallelNorm(comm, frozenset(dup))


def layout_for_tensor_parallel(world: ProcessGroups, world_comm: Comm, model: nn.Module,
                               config: TensorParallelConfig, topology: Topology, *,
                               keep_whole: frozenset[int] = frozenset()) -> ParallelGroups:
    """Mesh (pp, dp, tp), the model made equal on every rank of its stage and then split over tp
    (collective).

    Args:
        topology: the (pp, dp, tp) layout (comm/parallel_dims.py's `ParallelDims.topology`). With a pipeline
            (pp > 1) `model` is this rank's stage (Note: [3D layout] in docs/tensor-parallel.md):
            its weights are made equal over the stage's ranks only.
        keep_whole: ids of parameters that must not be split (a pipeline's tied weights, which
            several stages hold).
    """
    tp_size = topology.tp
    mesh = build_mesh(world, topology)
    tp_groups = mesh.axis("tp")
    tp_comm = Comm(tp_groups, timeout_s=world_comm.timeout_s, log=world_comm.log, label="tp")
    state = tp_state_of(model)
    if state is None:
        if topology.pp > 1 and model in _SEQUENCE_PARALLEL:
            raise NotSupportedError("not supported yet: sequence parallelism with a PipelineModule (3D); drop "
                                    "tp_model_init(..., sequence_parallel=True).")
        plan = resolve_plan(model, config)
        # Note: [zero.Init under AutoTP]. zero.Init cut the parameters over the data-parallel ranks
        # (its config named the tensor-parallel size); AutoTP needs whole layers and equal copies, so
        # they are gathered back here, then split over tp, then ZeRO-3 partitions the split model.
        unpartition(model)
        pp_stage_comm = world_comm if topology.pp == 1 else Comm(mesh.axes("dp", "tp"), timeout_s=world_comm.timeout_s,
                                                          log=world_comm.log, label="stage")
        broadcast_module_state(model, pp_stage_comm)  # every tp rank cuts its piece from the same weights
        experts = frozenset(id(p) for p in model.parameters() if getattr(p, "allreduce", True) is False)
        state = shard_model(model, plan, tp_comm, sequence_parallel=model in _SEQUENCE_PARALLEL, keep_whole=keep_whole,
                            experts=experts)  # DeepSpeed's expert marker (moe/utils.py::is_moe_param)
    elif state.size != tp_size:
        raise ConfigError(f"the model is already split over {state.size} tensor-parallel ranks; the config asks "
                          f"for {tp_size}.")
    return ParallelGroups(world=world, dp=mesh.axis("dp"), tp_comm=tp_comm, tp_rank=tp_groups.rank,
                          mesh=mesh, tp=state)


def layout_for_model_axis(world: ProcessGroups, world_comm: Comm, mesh: MeshGroups, model: nn.Module) -> ParallelGroups:
    """A PipelineModule whose topology has a model axis and whose layers the script split itself
    (Megatron's layers in DeepSpeed's 3D): ZeRO over `dp`, the norm over `tp`; parameters the script
    split carry Megatron's `tensor_model_parallel = True`, the others are counted once."""
    tp = mesh.axis("tp")
    if not any(getattr(p, "tensor_model_parallel", False) for p in model.parameters()):
        logger.warning(f"the PipelineModule's topology has a model (tensor-parallel) axis of {tp.world_size}, but no "
                       "parameter of this stage is marked tensor_model_parallel = True: the tensor-parallel ranks "
                       "hold replicas. Split the layers (Megatron's) or set tensor_parallel.autotp_size.")
    tp_comm = Comm(tp, timeout_s=world_comm.timeout_s, log=world_comm.log, label="tp")
    return ParallelGroups(world=world, dp=mesh.axis("dp"), tp_comm=tp_comm, tp_rank=tp.rank, mesh=mesh)


def check_mpu(mpu: Any) -> None:
    """Refuse an `mpu` that lacks one of the queries zeroshard reads (at initialize's start).

    Raises:
        ConfigError: naming every missing method.
    """
    names = ("get_model_parallel_rank", "get_model_parallel_world_size", "get_model_parallel_group",
             "get_data_parallel_rank", "get_data_parallel_world_size", "get_data_parallel_group")
    missing = [n for n in names if not callable(getattr(mpu, n, None))]
    if missing:
        raise ConfigError(f"initialize(mpu=...): the object lacks {', '.join(missing)}; pass Megatron's mpu "
                          "(megatron.core.parallel_state) or an object with those methods.")


def mpu_shape(mpu: Any) -> MpuShape:
    """An mpu's sizes for `resolve_dims`, after checking it has every query zeroshard reads."""
    check_mpu(mpu)
    return MpuShape(model_parallel=int(mpu.get_model_parallel_world_size()),
                    data_parallel=int(mpu.get_data_parallel_world_size()))


def _sibling_groups(dp: ProcessGroups, world_comm: Comm) -> tuple[tuple[int, ...], ...]:
    """Every data-parallel group of the world in global ranks, each in position order (what
    comm/groups.py::subgroup needs to make a split in all of them at once); one all_gather."""
    mine = torch.tensor(dist.get_process_group_ranks(dp.dp_group), dtype=torch.int64)
    every = torch.empty(world_comm.world_size * mine.numel(), dtype=torch.int64)
    world_comm.all_gather(every, mine)
    return tuple(sorted({tuple(int(r) for r in row) for row in every.view(world_comm.world_size, -1)}))


def layout_for_mpu(world: ProcessGroups, world_comm: Comm, mpu: Any) -> ParallelGroups:
    """The groups of a Megatron-style `mpu` (get_model_parallel_* and get_data_parallel_*), whose sizes
    comm/parallel_dims.py's `resolve_dims` has checked (`mpu_shape`)."""
    tp_size, dp_size = int(mpu.get_model_parallel_world_size()), int(mpu.get_data_parallel_world_size())
    dp = wrap_process_group(world, mpu.get_data_parallel_group(), int(mpu.get_data_parallel_rank()), dp_size)
    if 1 < dp_size < world.world_size:  # groups split out of dp (expert groups) are made in every dp group
        dp = replace(dp, siblings=_sibling_groups(dp, world_comm))
    tp_group = wrap_process_group(world, mpu.get_model_parallel_group(), int(mpu.get_model_parallel_rank()), tp_size)
    tp_comm = Comm(tp_group, timeout_s=world_comm.timeout_s, log=world_comm.log, label="mp") if tp_size > 1 else None
    return ParallelGroups(world=world, dp=dp, tp_comm=tp_comm, tp_rank=tp_group.rank)
