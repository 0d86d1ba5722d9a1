"""`zeroshard.initialize`: config + process group + model -> engine, as `deepspeed.initialize`."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from os import PathLike
from typing import Any

import torch
from torch import nn

from zeroshard.activation_checkpointing import configure_from_config
from zeroshard.arguments import config_path_from_args
from zeroshard.checkpoint_format import Checkpointer
from zeroshard.comm import Comm, CommLog, ProcessGroups, init_distributed
from zeroshard.comm.groups import node_leader, node_size
from zeroshard.comm.parallel_dims import ParallelDims, resolve_dims
from zeroshard.comm.topology import build_mesh
from zeroshard.config import CheckpointConfig, Config, load_config, read_config_file, tensor_parallel_size
from zeroshard.config.load import sequence_parallel_size
from zeroshard.config.pipeline import check_for_pipeline
from zeroshard.config.schema_ep import expert_parallel_size_of
from zeroshard.config.zenflow_checks import with_steps_per_epoch
from zeroshard.errors import ConfigError, InitializeArgumentError, NotSupportedError
from zeroshard.moe.balance import build_balance
from zeroshard.moe.hf_experts import mark_expert_banks
from zeroshard.moe.prepare import expert_parallel_size
from zeroshard.optim.factory import (
    adopt_client_optimizer,
    build_optimizer,
    client_auto_values,
    params_dict,
)
from zeroshard.optim.lr_schedules import build_scheduler
from zeroshard.optim.onebit_adam import OneBitOptimizer
from zeroshard.pipe.module import PipelineModule
from zeroshard.runtime.auto_resume import find_resumable, keep_global_batch, load_resumable
from zeroshard.runtime.autocast import autocast_dtype, safe_module_classes
from zeroshard.runtime.config_sync import check_same_config
from zeroshard.runtime.dataloader import DistributedDataLoader
from zeroshard.runtime.engine import ZeroEngine
from zeroshard.runtime.fp8 import convert_to_fp8, refuse_float8_weight_wrappers
from zeroshard.runtime.keep_fp32 import fp32_buffers, keep_fp32_pattern
from zeroshard.runtime.loss_scaler import LossScaler, build_loss_scaler
from zeroshard.runtime.monitor import build_sinks, format_bytes, setup_logging
from zeroshard.runtime.periodic_save import SaveSchedule
from zeroshard.runtime.pipe_engine import PipelineEngine, PipeParts
from zeroshard.runtime.preemption import Preemption
from zeroshard.sequence.sp_setup import (
    check_megatron_sequence_mpu,
    check_sequence_layout,
    is_sequence_mpu,
    loader_rank,
    make_sequence_groups,
    mesh_shape,
    sequence_size,
)
from zeroshard.tensor_parallel.setup import (
    ParallelGroups,
    check_recorded_dtype,
    layout_for_model_axis,
    layout_for_mpu,
    layout_for_tensor_parallel,
    mpu_shape,
    recorded_tp_size,
)
from zeroshard.zero import ZeroStrategy, broadcast_module_state
from zeroshard.zero.build import DTYPES, build_strategy
from zeroshard.zero.init_partition import init_partitioned, move_unpartitioned

logger = logging.getLogger("zeroshard")

def model_hidden_size(model: nn.Module) -> int | None:
    """`model.config.hidden_size`, or the largest of `hidden_sizes`, as Accelerate reads it."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    size = getattr(cfg, "hidden_size", None)
    if isinstance(size, int):
        return size
    sizes = getattr(cfg, "hidden_sizes", None)
    return max(sizes) if sizes else None


def _config_source(args: Any, config: Any) -> tuple[Any, Mapping[str, Any]]:
    """(the config as given: a path or a dict, its raw mapping) from `config` or the args."""
    source = _resolve_config_source(args, config)
    return source, source if isinstance(source, Mapping) else read_config_file(source)


def _resolve_config_source(args: Any, config: Any) -> Any:
    from_args = config_path_from_args(args) if args is not None else None
    if config is not None and from_args is not None:
        raise ConfigError(
            f"a config was given twice: config= to initialize() and {from_args!r} on the command "
            "line (--deepspeed_config); pass only one"
        )
    source = config if config is not None else from_args
    if source is None:
        raise ConfigError(
            "no config: pass config=<path or dict> to zeroshard.initialize(), or run the script "
            "with --deepspeed_config <file> (see zeroshard.arguments.add_config_arguments)"
        )
    return source


def _param_groups(model: nn.Module, model_parameters: Iterable[Any] | None) -> list[dict[str, Any]]:
    """Normalise `model_parameters` (params or param-group dicts) to trainable groups."""
    if model_parameters is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and isinstance(items[0], Mapping):
        groups = [dict(g) for g in items]
    else:
        groups = [{"params": items}]
    for g in groups:
        g["params"] = [p for p in g["params"] if p.requires_grad]
    return [g for g in groups if g["params"]]


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    config: str | PathLike[str] | Mapping[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: Mapping[str, Any] | None = None,
    *,
    zero_units: list[nn.Module | type[nn.Module]] | None = None,
) -> tuple[ZeroEngine, torch.optim.Optimizer | None, DistributedDataLoader | None, Any]:
    """Wrap `model` for ZeRO data-parallel training, as `deepspeed.initialize` does.

    Args:
        args: an argparse namespace; `--deepspeed_config` / `--zeroshard_config` is read from it.
        model: the model to train.
        optimizer: a `torch.optim.Optimizer` built on the model's parameters, or a callable
            taking the parameters and returning one; None to build the config's `optimizer`.
        model_parameters: parameters (or param-group dicts) to optimize; default: all
            trainable parameters of `model`.
        training_data: a Dataset; a distributed data loader over it is returned.
        lr_scheduler: a scheduler object, or a callable taking the optimizer; None to build
            the config's `scheduler`.
        distributed_port: the rendezvous port when the launcher's environment has none
            (DeepSpeed's argument; `MASTER_PORT` wins when set).
        mpu: a Megatron-style model-parallel unit (`get_model_parallel_rank/world_size/group`,
            `get_data_parallel_rank/world_size/group`): ZeRO partitions over its data-parallel
            group and the gradient norm spans its model-parallel group (parameters the script
            split carry `tensor_model_parallel = True`, the others are counted once).
        dist_init_required: accepted for DeepSpeed scripts; zeroshard joins the launcher's
            process group when none exists and reuses the script's own otherwise.
        collate_fn: collate function of the returned data loader.
        config: a ds_config path or dict (DeepSpeed's format, see docs/config.md).
        mesh_param: DeepSpeed's (data-parallel size, sequence-parallel size) device mesh; the same
            as `sequence_parallel_size` in the config (zeroshard/sequence/sp_setup.py).
        config_params: DeepSpeed's legacy name for `config`.
        zero_units: ZeRO stage 3 only: the modules (or module classes) whose parameters are
            gathered together; default every block of a ModuleList plus the root.

    Returns:
        `(engine, optimizer, dataloader, lr_scheduler)`; optimizer is `engine.optimizer` (DeepSpeed's
        ZeRO optimizer surface over the torch one, runtime/zero_optimizer.py), dataloader is None
        without `training_data`, lr_scheduler None without one.

    Raises:
        ConfigError: the config is invalid, names an unsupported feature, or has an "auto"
            value nothing can resolve.
        NotSupportedError: `mpu` together with `tensor_parallel` or a PipelineModule; sequence
            parallelism with a PipelineModule or tensor parallelism.

    Example::

        engine, optimizer, loader, _ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), training_data=ds,
            config="ds_config.json")
        for x, y in loader:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
    """
    model = _check_arguments(args, model, mpu, mesh_param, config, config_params)
    source, raw_config = _config_source(args, config if config is not None else config_params)
    world = _join_world(distributed_port)
    pipe_module = model if isinstance(model, PipelineModule) else None
    cfg, dims = _config_and_dims(source, raw_config, world, model, pipe_module, mpu, optimizer, mesh_param)
    _check_optimizer_present(cfg, optimizer, model_parameters, training_data, lr_scheduler)
    _prepare_model(model, cfg, world.device)
    world_comm = _world_comm(world, cfg)
    cfg, resumable = _find_resumable(cfg, dims, world_comm)  # before the engine: it may change the batch
    layout = _parallel_layout(world, world_comm, model, cfg, dims, mpu, pipe_module)
    groups = layout.dp  # ZeRO and the batch run over the data-parallel ranks (with SP: dp x sp)
    comm = world_comm if groups is world else Comm(groups, log=world_comm.log, label="dp")
    seq = layout.sequence = make_sequence_groups(dims, groups, model)
    _convert_fp8(model, cfg, pipe_module)  # after AutoTP's split, before ZeRO packs the parameters
    broadcast_module_state(model, comm)
    pipe = PipeParts(pipe_module, cfg, layout.mesh) if pipe_module is not None else None  # before the strategy's hooks
    param_groups, params = _param_groups_after_split(model, model_parameters, layout)
    norm_group = layout.norm_group(model, world_comm, tied_duplicates=pipe_module.tied_duplicates()
                                   if pipe_module is not None else frozenset())
    cfg, loader = _data_loader(cfg, training_data, collate_fn, groups, seq)
    strategy = build_strategy(cfg, model, params, comm, groups, units=zero_units, norm_group=norm_group,
                              hpz_size=dims.dp_shard, tp_comm=layout.tp_comm, pipeline=world_comm if pipe else None)
    opt = _make_optimizer(cfg, optimizer, param_groups, strategy, comm, tensor_parallel=layout.tp_comm is not None)
    sched, scaler = _make_scheduler(cfg, lr_scheduler, opt), _loss_scaler(cfg, groups.device.type)
    engine_cls, extra = (ZeroEngine, {}) if pipe is None else (PipelineEngine, {"pipe": pipe})
    engine = engine_cls(
        **extra, module=model, config=cfg, groups=groups, comm=comm, strategy=strategy, optimizer=opt,
        lr_scheduler=sched, loss_scaler=scaler, sinks=build_sinks(cfg, world.rank),
        training_dataloader=loader, raw_config=raw_config)
    _attach(engine, cfg, dims, layout, world_comm, comm, pipe_module)
    if resumable is not None:  # checkpoint.auto_resume_dir (runtime/auto_resume.py)
        load_resumable(engine, resumable)
    return engine, engine.optimizer, loader, sched  # DeepSpeed returns engine.optimizer too


def _world_comm(world: ProcessGroups, cfg: Config) -> Comm:
    """The world's collectives; their first call checks that every rank parsed the same config,
    before anything trains on it."""
    world_comm = Comm(world, log=_comm_log(cfg))
    check_same_config(cfg, world_comm)
    return world_comm


def _join_world(distributed_port: int | None) -> ProcessGroups:
    """The launcher's process group (joined, or the script's own), and this rank's logging."""
    if distributed_port is not None:  # DeepSpeed's argument; MASTER_PORT wins when set
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    world = init_distributed()
    setup_logging(world.rank)
    return world


def _comm_log(cfg: Config) -> CommLog | None:
    """The config's comms_logger as the world Comm's log (None when off)."""
    comms = cfg.comms_logger
    if not comms.enabled:
        return None
    return CommLog(ops=None if comms.prof_all else comms.prof_ops, verbose=comms.verbose)


def _find_resumable(cfg: Config, dims: ParallelDims, world_comm: Comm) -> tuple[Config, Any]:
    """checkpoint.auto_resume_dir: the checkpoint to resume from (None: a fresh start), and the
    config with the saved global batch kept (it may change gradient accumulation)."""
    resume_dir = cfg.checkpoint.auto_resume_dir
    if resume_dir is None:
        return cfg, None
    # A checkpoint's files are checked the same way whatever layout wrote it (checkpoint/verify.py
    # reads a pipeline's stage directories), so a checkpointer over the world chooses for every
    # layout; Megatron-style pieces a script split itself (an mpu) are refused by find_resumable.
    finder = None if dims.from_mpu else _checkpointer(world_comm, cfg.checkpoint.use_node_local_storage)
    resumable = find_resumable(finder, resume_dir)
    return keep_global_batch(cfg, resumable), resumable


def _param_groups_after_split(model: nn.Module, model_parameters: Iterable[Any] | None,
                              layout: ParallelGroups) -> tuple[list[dict[str, Any]], list[nn.Parameter]]:
    """The param groups to optimize and their parameters, once each; parameters listed before
    AutoTP split their layers are swapped for the split ones."""
    param_groups = _param_groups(model, model_parameters)
    if layout.tp is not None and layout.tp.replaced:
        swap, layout.tp.replaced = layout.tp.replaced, {}
        param_groups = [{**g, "params": [swap.get(id(p), p) for p in g["params"]]} for g in param_groups]
    return param_groups, list({id(p): p for g in param_groups for p in g["params"]}.values())


def _data_loader(cfg: Config, training_data: Any, collate_fn: Any, groups: ProcessGroups,
                 seq: Any) -> tuple[Config, DistributedDataLoader | None]:
    """The loader over `training_data` (None without it; a sequence-parallel group reads the same
    samples), and the config with ZenFlow's "epoch" in optimizer steps (DeepSpeed's configure_zenflow)."""
    loader_at, loader_of = loader_rank(groups, seq)
    loader = None if training_data is None else DistributedDataLoader(
        training_data, micro_batch_size=cfg.train_micro_batch_size_per_gpu, rank=loader_at,
        world_size=loader_of, collate_fn=collate_fn)
    return with_steps_per_epoch(cfg, None if loader is None else len(loader) // cfg.gradient_accumulation_steps), loader


def _attach(engine: ZeroEngine, cfg: Config, dims: ParallelDims, layout: ParallelGroups, world_comm: Comm,
            comm: Comm, pipe_module: PipelineModule | None) -> None:
    """What the engine holds beside its training state: the dimensions and groups, the checkpointer,
    the save schedule and the preemption latch (SIGTERM / SIGUSR1: save, exit 75); then the start-up log."""
    engine.dims, engine.parallel = dims, layout
    engine.checkpointer = _engine_checkpointer(cfg, layout, world_comm, comm, pipe_module)
    engine.save_schedule = SaveSchedule.from_config(cfg.checkpoint, world_comm)
    engine.preemption = Preemption.from_config(cfg.checkpoint, world_comm)
    engine.expert_balance = build_balance(engine.module, cfg.expert_parallel.load_balance_coeff, comm)
    _log_start(engine, comm.groups)


def _check_arguments(args: Any, model: nn.Module | None, mpu: Any, mesh_param: Any, config: Any,
                     config_params: Any) -> nn.Module:
    """initialize()'s arguments that are wrong on their own, refused before anything starts."""
    if model is None and isinstance(args, nn.Module):
        raise InitializeArgumentError(
            f"initialize() got the model ({type(args).__name__}) as its first positional argument, which is `args` "
            "in DeepSpeed's signature initialize(args=None, model=None, ...); pass it as model=...")
    if model is None:
        raise InitializeArgumentError("initialize() needs model=: the nn.Module (or PipelineModule) to train")
    if mpu is not None and not is_sequence_mpu(mpu):
        mpu_shape(mpu)  # a missing query is named before anything else happens
        check_megatron_sequence_mpu(mpu)
    if mesh_param is not None:
        mesh_shape(mesh_param)  # (dp, sp): a malformed shape is named before anything starts
    if config is not None and config_params is not None:
        raise ConfigError("pass the config once: config= or config_params=, not both")
    return model


def _config_and_dims(source: Any, raw_config: Mapping[str, Any], world: ProcessGroups, model: nn.Module,
                     pipe_module: PipelineModule | None, mpu: Any, optimizer: Any,
                     mesh_param: Any) -> tuple[Config, ParallelDims]:
    """Every parallel dimension decided once (comm/parallel_dims.py), then the config parsed once
    with the batch triad counted over the data-parallel ranks the dims name; both logged."""
    megatron_mpu = mpu if mpu is not None and not is_sequence_mpu(mpu) else None  # ALST's mpu: sequence groups only
    world_size, ranks_per_node = world.world_size, node_size(world)
    dims = resolve_dims(world_size, config_tp=tensor_parallel_size(raw_config), recorded_tp=recorded_tp_size(model),
                        pipe=pipe_module.shape if pipe_module else None,
                        mpu=mpu_shape(megatron_mpu) if megatron_mpu is not None else None,
                        ep=max(expert_parallel_size(model), expert_parallel_size_of(raw_config)),
                        sp=sequence_size(sequence_parallel_size(raw_config), mpu, mesh_param))
    cfg = load_config(source, dp_world_size=dims.dp, other_batch_world_sizes=dims.batch_world_sizes[1:],
                      hidden_size=model_hidden_size(model), auto_values=dict(client_auto_values(optimizer)))
    if pipe_module is not None:  # the pipeline's refusals, before anything else reads the config
        check_for_pipeline(cfg, pipe_module.virtual_stages)
    check_sequence_layout(dims, cfg, pipeline=pipe_module is not None, mesh_param=mesh_param)
    if cfg.zero_optimization.stage == 3:  # hpZ's secondary copy exists at ZeRO stage 3 only
        dims = dims.with_hpz(cfg.zero_optimization.zero_hpz_partition_size, ranks_per_node=ranks_per_node)
    if dims.sp > 1:  # DeepSpeed: with sequence parallelism this dtype replaces communication_data_type
        cfg = dataclasses.replace(cfg, communication_data_type=cfg.seq_parallel_communication_data_type)
    _log_dims(dims, cfg)
    logger.info(
        "resolved config (values not at their DeepSpeed default, with their source; "
        "`zeroshard config check FILE` lists every key):\n" + cfg.describe(non_default_only=True)
    )
    for note in cfg.notes:  # deprecated spellings mapped, other stages' tuning keys: once, at start-up
        logger.warning(note)
    return cfg, dims


def _prepare_model(model: nn.Module, cfg: Config, device: torch.device) -> None:
    """Before any collective: AutoEP's expert banks marked (cut at the strategy's build,
    moe/hf_experts.py), the activation-checkpointing settings applied, the model placed."""
    mark_expert_banks(model, cfg.expert_parallel)
    configure_from_config(cfg)
    _place_model(model, cfg, device)


def _place_model(model: nn.Module, cfg: Config, device: torch.device) -> None:
    """Parameters to the training dtype and device; buffers keep their dtype unless
    data_types.buffer_dtype names one (bf16/fp16 only: under fp32 every tensor keeps its dtype, as
    in DeepSpeed); data_types.keep_in_fp32_modules: the buffers the model's Transformers lists (or
    the config's patterns) name stay fp32 under bf16/fp16 (runtime/keep_fp32.py)."""
    dtype = DTYPES[cfg.precision] if cfg.precision != "fp32" else None
    check_recorded_dtype(model, dtype or torch.float32)
    zero_init = any(init_partitioned(p) for p in model.parameters())
    if zero_init and cfg.zero_optimization.stage != 3:
        raise ConfigError(
            f"the model was built under zeroshard.zero.Init (its parameters are partitioned), "
            f"which needs zero_optimization.stage 3; the config says stage "
            f"{cfg.zero_optimization.stage}. Set stage to 3, or build the model without zero.Init."
        )
    named = cfg.data_types.buffer_dtype
    buffer_dtype = DTYPES[named] if named is not None and dtype is not None else None
    kept = fp32_buffers(model, keep_fp32_pattern(model, cfg.data_types.keep_in_fp32_modules, dtype))
    if kept:
        logger.info(f"data_types.keep_in_fp32_modules: {len(kept)} buffer(s) kept in fp32 "
                    f"({', '.join(sorted(kept.values())[:4])}{', ...' if len(kept) > 4 else ''})")
    if zero_init or dtype is not None:
        move_unpartitioned(model, device, dtype, buffer_dtype, kept)
    else:
        model.to(device)


def _convert_fp8(model: nn.Module, cfg: Config, pipe_module: PipelineModule | None) -> None:
    """`fp8.enabled`: the eligible linear layers run their GEMMs in float8 (runtime/fp8.py); a model
    whose parameters are tensor subclasses (torchao's float8 weight wrappers) is refused. A
    pipeline stage keeps its first linear layer only on the first stage and its last only on the last,
    so `fp8.keep_first_last` means the model's first and last layers at any pipeline size."""
    refuse_float8_weight_wrappers(model)  # torchao's FSDP2 float8 weights (Accelerate's fp8 default)
    fp8 = cfg.fp8
    if not fp8.enabled:
        return
    first = last = fp8.keep_first_last
    if pipe_module is not None and fp8.backend == "torchao":
        raise NotSupportedError('fp8.backend "torchao" with a PipelineModule is not built (torchao replaces '
                                'modules the stage already holds); set fp8.backend "zeroshard".')
    if pipe_module is not None:
        first = first and pipe_module.stage_id == 0
        last = last and pipe_module.stage_id == pipe_module.num_stages - 1
    verdicts = convert_to_fp8(model, fp8.recipe, fp8.exclude, keep_first=first, keep_last=last, backend=fp8.backend)
    kept = {name: why for name, why in verdicts.items() if why != "fp8"}
    logger.info(f"fp8 ({fp8.recipe}, {fp8.backend}): {len(verdicts) - len(kept)} of {len(verdicts)} linear "
                "layer(s) in float8"
                + "".join(f"; {name} kept: {why}" for name, why in list(kept.items())[:6])
                + ("; ..." if len(kept) > 6 else ""))


def _loss_scaler(cfg: Config, device_type: str) -> LossScaler | None:
    """fp16's dynamic loss scaler (or torch_autocast to fp16 over fp32 parameters); None otherwise."""
    safe_module_classes(cfg.torch_autocast)  # a bad class name fails here, before training
    if cfg.precision == "fp32" and autocast_dtype(cfg.torch_autocast, device_type) == torch.float16:
        # fp16 autocast on fp32 parameters: dynamic loss scaling as torch's GradScaler (DeepSpeed's
        # choice in this mode): 2**16 to start, halve on overflow, double after 2000 good steps.
        return build_loss_scaler(loss_scale=0.0, initial_scale_power=16, loss_scale_window=2000,
                                 hysteresis=1, consecutive_hysteresis=False, min_loss_scale=2.0**-24)
    if cfg.precision == "fp16":
        f = cfg.fp16
        return build_loss_scaler(
            loss_scale=f.loss_scale, initial_scale_power=f.initial_scale_power,
            loss_scale_window=f.loss_scale_window, hysteresis=f.hysteresis,
            consecutive_hysteresis=f.consecutive_hysteresis, min_loss_scale=f.min_loss_scale)
    return None


def _parallel_layout(world: ProcessGroups, world_comm: Comm, model: nn.Module, cfg: Config, dims: ParallelDims,
                     mpu: Any, pipe_module: PipelineModule | None) -> ParallelGroups:
    """The groups this rank trains with, all from `dims` (comm/parallel_dims.py) over comm/topology.py's
    mesh, or an `mpu`'s: plain data parallelism, pipeline x data (the PipelineModule's topology),
    AutoTP (the model is split over the mesh's tp axis here), pipeline x data x AutoTP (each stage
    split), a pipeline whose layers the script split (its topology's model axis), or an mpu's groups."""
    if dims.from_mpu:
        return layout_for_mpu(world, world_comm, mpu)
    if pipe_module is not None:
        pipe_module.adopt_topology(dims.topology)  # its topology() and _grid answer DeepSpeed's 3D queries
    if dims.tp_split == "autotp":
        if pipe_module is None:
            return layout_for_tensor_parallel(world, world_comm, model, cfg.tensor_parallel, dims.topology)
        # 3D: AutoTP splits this rank's stage; a tied weight (held by several stages) stays whole.
        layout = layout_for_tensor_parallel(
            world, world_comm, model, cfg.tensor_parallel, dims.topology,
            keep_whole=frozenset(id(p) for p in pipe_module.tied_modules.parameters()))
        pipe_module.adopt_replaced_layers()
        return layout
    mesh = build_mesh(world, dims.topology)
    if dims.tp_split == "script":  # a PipelineModule with a model axis: its layers are split by the script (Megatron's)
        return layout_for_model_axis(world, world_comm, mesh, model)
    return ParallelGroups(world=world, dp=mesh.axis("dp"), tp_comm=None, tp_rank=0, mesh=mesh)


def _log_dims(dims: ParallelDims, cfg: Config) -> None:
    logger.info(f"parallel dimensions: {dims.describe()}")
    if cfg.dp_world_size != dims.dp:  # the batch triad holds over every rank only (AutoTP, DeepSpeed's count)
        share = cfg.dp_world_size // dims.dp
        logger.warning(f"train_batch_size {cfg.train_batch_size} counts all {cfg.dp_world_size} ranks, as DeepSpeed's "
                       f"AutoTP does; the {dims.dp} data-parallel rank(s) x tensor_parallel.autotp_size {share} see "
                       f"{cfg.train_batch_size // share} different samples per step")


def _check_optimizer_present(cfg: Config, optimizer: Any, model_parameters: Any,
                             training_data: Any, lr_scheduler: Any) -> None:
    """Training asked for, but nothing to step with: fail now, not at the first step().

    Training is asked for by `model_parameters=`, `training_data=`, a client `lr_scheduler=`
    or a config `scheduler`. Without any of them (and without an optimizer) the engine is for
    inference only (ZeRO inference, `engine.generate`), as in DeepSpeed.
    """
    if optimizer is not None or cfg.optimizer is not None:
        return
    asks = [name for name, given in (("model_parameters=", model_parameters is not None),
                                     ("training_data=", training_data is not None),
                                     ("lr_scheduler=", lr_scheduler is not None),
                                     ('a "scheduler" section', cfg.scheduler is not None)) if given]
    if asks:
        raise ConfigError(
            f"no optimizer: the config has no \"optimizer\" section and initialize() got no "
            f"optimizer=, but {' and '.join(asks)} ask(s) for training. Add an \"optimizer\" "
            "section (e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}}) or pass optimizer=; "
            "for inference only, leave out model_parameters=, training_data= and schedulers.")


def _checkpointer(comm: Comm, node_local: bool, section: CheckpointConfig | None = None) -> Checkpointer:
    # initialize() is the composition root (STYLE §1: it gives the engine a Checkpointer); the
    # import stays here so that nothing else in runtime/ depends on the checkpoint layer.
    from zeroshard.checkpoint import ShardedCheckpointer

    # checkpoint.use_node_local_storage (Trainer's save_on_each_node): each node's first rank
    # writes its node's directory (Note: [node-local storage] in checkpoint/save.py).
    # `section` (the engine's checkpointer): checkpoint.async_save and checkpoint.keep_last.
    return ShardedCheckpointer(comm, node_leader(comm.groups) if node_local else None,
                               async_save=section is not None and section.async_save,
                               keep_last=section.keep_last if section is not None else 0,
                               prefer_universal=section is not None and section.load_universal)


def _engine_checkpointer(cfg: Config, layout: ParallelGroups, world_comm: Comm, comm: Comm,
                         pipe_module: PipelineModule | None) -> Checkpointer:
    """The engine's checkpointer (`_layered_checkpointer`); with zero_optimization.pipeline_loading_checkpoint
    its loads run one rank at a time."""
    found = _layered_checkpointer(cfg, layout, world_comm, comm, pipe_module)
    if cfg.zero_optimization.pipeline_loading_checkpoint:
        from zeroshard.checkpoint import InTurnCheckpointer  # composition root (see _checkpointer)

        return InTurnCheckpointer(found)
    return found


def _layered_checkpointer(cfg: Config, layout: ParallelGroups, world_comm: Comm, comm: Comm,
                          pipe_module: PipelineModule | None) -> Checkpointer:
    """The engine's checkpointer, composed outside in: tensor_parallel/checkpoint.py's (AutoTP pieces as ranges
    of global parameters) around checkpoint/pipe_checkpointer.py's (a directory per stage, layer
    files, pipeline.json) around the sharded one over the ranks that hold pieces of the same layers
    (the data-parallel group; with AutoTP the dp x tp ranks of the world or of the stage). Every
    layer speaks global names, so a load reshards across DP, PP and TP degrees and ZeRO stage."""
    node_local = cfg.checkpoint.use_node_local_storage
    mesh = layout.mesh
    tp_size = mesh.topology.tp if mesh is not None else 1
    tp_rank = mesh.coord["tp"] if mesh is not None and tp_size > 1 else None
    plain = layout.tp is None and pipe_module is None
    for key, value in (("async_save", cfg.checkpoint.async_save), ("keep_last", cfg.checkpoint.keep_last)):
        if value and not plain:
            raise NotSupportedError(f"not supported yet: checkpoint.{key} with a PipelineModule or tensor parallelism "
                                    f"(issue 42); remove checkpoint.{key} (saves then write before returning and keep "
                                    "every tag)")
    if layout.tp is None:  # no AutoTP: whole layers, or Megatron-style pieces the script split itself
        inner = _checkpointer(comm, node_local, cfg.checkpoint)
        if pipe_module is None:
            return inner
        return _pipe_checkpointer(inner, world_comm, pipe_module, comm.rank, tp_rank, tp_size=tp_size)
    from zeroshard.tensor_parallel.checkpoint import TensorParallelCheckpointer

    pieces = world_comm if pipe_module is None or mesh is None or mesh.topology.pp == 1 else Comm(
        mesh.axes("dp", "tp"), log=world_comm.log, label="stage")
    inner = _checkpointer(pieces, node_local)
    if pipe_module is not None:
        inner = _pipe_checkpointer(inner, world_comm, pipe_module, comm.rank, tp_rank, tp_size=1)
    return TensorParallelCheckpointer(inner, layout.tp, pieces.rank, pieces.world_size)


def _pipe_checkpointer(inner: Checkpointer, world_comm: Comm, module: PipelineModule, dp_rank: int,
                       tp_rank: int | None, tp_size: int) -> Checkpointer:
    from zeroshard.checkpoint.pipe_checkpointer import PipelineCheckpointer
    from zeroshard.checkpoint.pipe_files import PipeLayout

    layout = PipeLayout(num_stages=module.num_stages, parts=list(module.parts), virtual_stages=module.virtual_stages,
                        tied=module.tie_map(), num_layers=module.num_layers, tp_size=tp_size,
                        partition=module.partition_for)
    return PipelineCheckpointer(inner, world_comm, layout, module.stage_id, dp_rank,
                                lambda: [(i, layer.state_dict()) for i, layer in module.local_layers()], tp_rank)


def _make_optimizer(cfg: Config, client: Any, param_groups: list[dict[str, Any]], strategy: ZeroStrategy,
                    comm: Comm, *, tensor_parallel: bool) -> torch.optim.Optimizer | None:
    """The client's or the config's optimizer over the strategy's master parameters, wrapped by the
    strategy (an NVMe home swaps its states); a 1-bit optimizer attached to the data-parallel group."""
    opt = _optimizer_over_masters(cfg, client, param_groups, strategy)
    if isinstance(opt, OneBitOptimizer) and tensor_parallel:
        raise NotSupportedError(f"not supported yet: optimizer {type(opt).__name__} with tensor parallelism or an "
                                "mpu (its compressed stage computes the norm of local gradients only); use Adam/AdamW.")
    if isinstance(opt, OneBitOptimizer):  # it all-reduces the momentum itself, after its warm-up
        opt.attach(comm, strategy)
    return strategy.wrap_optimizer(opt) if opt is not None else None


def _optimizer_over_masters(cfg: Config, client: Any, param_groups: list[dict[str, Any]],
                            strategy: ZeroStrategy) -> torch.optim.Optimizer | None:
    if client is not None:
        if cfg.optimizer is not None:
            logger.info("a client optimizer was passed; the config's \"optimizer\" section is ignored")
        masters = strategy.master_params_for([p for g in param_groups for p in g["params"]])
        offload = cfg.zero_optimization.offload_optimizer.device == "cpu"
        return adopt_client_optimizer(client, masters, strategy.master_params_for, cpu_offload=offload)
    if cfg.optimizer is None:
        return None
    groups = [{**g, "params": strategy.master_params_for(g["params"])} for g in param_groups]
    return build_optimizer(cfg.optimizer.type, cfg.optimizer.params, groups)


def _make_scheduler(cfg: Config, client: Any, opt: torch.optim.Optimizer | None) -> Any:
    if client is not None:
        if callable(client) and not hasattr(client, "step"):
            return client(opt)
        return client
    if cfg.scheduler is None or opt is None:
        return None
    return build_scheduler(cfg.scheduler.type, opt, params_dict(cfg.scheduler.params))


def _log_start(engine: ZeroEngine, groups: ProcessGroups) -> None:
    if engine.zs_config.dump_state:
        logger.info(f"engine state (dump_state):\n{engine.describe_state()}")
    for s in engine.model_state_bytes():
        logger.info(
            f"model states per rank ({s.device}): params {format_bytes(s.params)}, "
            f"grads {format_bytes(s.grads)}, master params {format_bytes(s.master_params)}, "
            f"optimizer states {format_bytes(s.optimizer_states)} (allocated at the first step)"
        )
    logger.info(
        f"world size {groups.world_size} ({groups.backend or 'no process group'}), device "
        f"{groups.device}, precision {engine.zs_config.precision}, "
        f"batch {engine.train_batch_size()} = {engine.train_micro_batch_size_per_gpu()} x "
        f"{engine.gradient_accumulation_steps()} x {groups.world_size}"
    )
