"""Accepted means acted on: what each schema key does, as data (issue 11).

Every ds_config key zeroshard accepts is exactly one of:
- *acted on*: read by the code listed in `ACTED_ON` (tests/unit/test_config_effects.py checks that
  each listed file really mentions the key, or that the listed class takes it as an argument);
- *refused unless default*: a `support.NOT_SUPPORTED` entry raises NotSupportedError for any
  other value;
- *accepted without effect*: listed in `NO_EFFECT` with the reason, for keys DeepSpeed configs
  carry whose value cannot change what zeroshard does.
docs/config.md shows which, per key. Optimizer and scheduler parameters are spelled
`optimizer.params[Adam].lr` (the params class in brackets). Imports nothing of zeroshard but `config`.
"""

from __future__ import annotations

from typing import Literal

from zeroshard.config.support import status_of

Effect = Literal["acted on", "refused unless default", "accepted without effect"]

_Z = "zero_optimization."
_BUILD = ("zero/build.py",)
_ENGINE = ("runtime/engine.py",)
_SCALER = ("runtime/initialize.py", "runtime/loss_scaler.py")
_SCHED = ("optim/lr_schedules.py",)
_ADAM = ("optim/factory.py::cls(param_groups, **kwargs)", "class:torch.optim.AdamW", "class:torch.optim.Adam")

ACTED_ON: dict[str, tuple[str, ...]] = {
    # batch, optimizer, scheduler
    "train_batch_size": _ENGINE, "train_micro_batch_size_per_gpu": _ENGINE,
    "gradient_accumulation_steps": _ENGINE,
    "managed_gradient_accumulation": ("runtime/engine_accumulation.py",),
    "optimizer": ("runtime/initialize.py::cfg.optimizer",), "scheduler": ("runtime/initialize.py::cfg.scheduler",),
    "optimizer.type": ("runtime/initialize.py::cfg.optimizer.type",),
    "optimizer.params": ("runtime/initialize.py::cfg.optimizer.params",),
    "scheduler.type": ("runtime/initialize.py::cfg.scheduler.type",),
    "scheduler.params": ("runtime/initialize.py::cfg.scheduler.params",),
    **{f"optimizer.params[Adam].{k}": _ADAM for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")},
    "optimizer.params[Adam].adam_w_mode": ("optim/factory.py",),
    **{f"optimizer.params[Lamb].{k}": ("optim/lamb.py",) for k in (
        "lr", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_grad_norm", "max_coeff", "min_coeff",
        "amsgrad")},
    **{f"optimizer.params[OneBitAdam].{k}": ("optim/onebit_adam.py",) for k in (
        "lr", "freeze_step", "betas", "eps", "weight_decay", "comm_backend_name")},
    **{f"optimizer.params[OneBitAdam].{k}": ("optim/factory.py",) for k in ("amsgrad", "eps_inside_sqrt")},
    **{f"optimizer.params[ZeroOneAdam].{k}": ("optim/zero_one_adam.py",) for k in (
        "lr", "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "betas", "eps",
        "weight_decay", "comm_backend_name")},
    "optimizer.params[ZeroOneAdam].amsgrad": ("optim/factory.py",),
    **{f"optimizer.params[OneBitLamb].{k}": ("optim/onebit_lamb.py",) for k in (
        "lr", "freeze_step", "betas", "eps", "weight_decay", "max_coeff", "min_coeff", "coeff_beta", "factor_max",
        "factor_min", "factor_threshold", "comm_backend_name")},
    "optimizer.params[OneBitLamb].amsgrad": ("optim/factory.py",),
    # precision (fp16.enabled / bf16.enabled select Config.precision, which initialize reads)
    "fp16.enabled": ("runtime/initialize.py::cfg.precision",),
    "bf16.enabled": ("runtime/initialize.py::cfg.precision",),
    "fp16.loss_scale": _SCALER, "fp16.initial_scale_power": _SCALER, "fp16.loss_scale_window": _SCALER,
    "fp16.hysteresis": _SCALER, "fp16.consecutive_hysteresis": _SCALER, "fp16.min_loss_scale": _SCALER,
    "fp16.auto_cast": ("runtime/engine.py::fp16.auto_cast",),
    "data_types.grad_accum_dtype": ("zero/build.py::cfg.accumulation_dtype",
                                    "runtime/pipe_engine.py::cfg.accumulation_dtype"),
    "data_types.buffer_dtype": ("runtime/initialize.py::cfg.data_types.buffer_dtype",),
    "data_types.keep_in_fp32_modules": ("runtime/initialize.py::cfg.data_types.keep_in_fp32_modules",),
    # gradients and communication
    "gradient_clipping": _ENGINE, "communication_data_type": _BUILD,
    "seq_parallel_communication_data_type": ("runtime/initialize.py::cfg.seq_parallel_communication_data_type",),
    "prescale_gradients": _BUILD,
    "gradient_predivide_factor": _BUILD, "gradient_allreduce_op": _BUILD,
    "sequence_parallel_size": ("runtime/initialize.py::sequence_parallel_size(raw_config)",
                               "sequence/sp_setup.py::Note: [sequence-parallel gradients]"),
    "data_parallel_size": ("sequence/sp_setup.py::cfg.data_parallel_size",), _Z + "ignore_unused_parameters": _BUILD,
    **{_Z + f"leaf_module.{k}": ("zero/build.py::apply_leaf_config(module, leaf.classes, leaf.names, "
                                 "leaf.name_suffixes)",) for k in ("classes", "names", "name_suffixes")},
    # ZeRO
    _Z + "zero_quantized_gradients": (
        "zero/build.py::quantized_gradients=bool(zero.zero_quantized_gradients)",
        "zero/stage3.py::mode = ReduceMode.QUANTIZED_REDUCE_SCATTER"),
    _Z + "zero_quantized_weights": (
        "zero/build.py::quantized_weights=bool(zero.zero_quantized_weights)",
        "zero/unit_shards.py::QuantizedGather(comm, self.chunk, device)"),
    _Z + "zero_hpz_partition_size": (
        "runtime/initialize.py::dims.with_hpz(cfg.zero_optimization.zero_hpz_partition_size",
        "zero/stage3.py::secondary = SecondaryPartition("),
    _Z + "stage": _BUILD, _Z + "reduce_scatter": _BUILD, _Z + "reduce_bucket_size": _BUILD,
    _Z + "allgather_partitions": _BUILD, _Z + "allgather_bucket_size": _BUILD, _Z + "overlap_comm": _BUILD,
    _Z + "offload_param.device": ("zero/build.py::OffloadPolicy.from_config(zero.offload_param",
                                  "zero/offload/policy.py::section.device"),
    _Z + "offload_optimizer.device": ("zero/build.py::OffloadPolicy.from_config(zero.offload_optimizer",
                                      "zero/offload/policy.py::section.device"),
    _Z + "offload_optimizer.pin_memory": ("zero/build.py::OffloadPolicy.from_config(zero.offload_optimizer",
                                          "zero/offload/policy.py::section.pin_memory"),
    _Z + "offload_param.pin_memory": ("zero/build.py::OffloadPolicy.from_config(zero.offload_param",
                                      "zero/offload/policy.py::section.pin_memory"),
    _Z + "offload_optimizer.nvme_path": ("zero/offload/policy.py::section.nvme_path",),
    _Z + "offload_param.nvme_path": ("zero/offload/policy.py::section.nvme_path",
                                     "zero/unit_shards.py::check_swap_dir(nvme.path"),
    _Z + "offload_param.max_in_cpu": ("zero/offload/policy.py::section, \"max_in_cpu\"",
                                      "zero/offload/nvme_params.py::max_in_cpu"),
    _Z + "offload_optimizer.buffer_count": ("zero/offload/policy.py::section.buffer_count",
                                            "zero/offload/nvme_swap.py::buffer_count"),
    _Z + "offload_optimizer.fast_init": ("zero/offload/policy.py::fast_init", "zero/offload/nvme_swap.py::fast_init"),
    _Z + "offload_optimizer.ratio": ("zero/offload/policy.py::section, \"ratio\"",
                                     "zero/offload/split_home.py::def device_buckets"),
    _Z + "offload_optimizer.delayed_update": ("zero/offload/policy.py::section, \"delayed_update\"",
                                              "zero/offload/delayed_step.py::class DelayedStep"),
    _Z + "offload_optimizer.delayed_update_warmup_steps": (
        "zero/offload/policy.py::section.delayed_update_warmup_steps", "zero/offload/delayed_step.py::self._warmup"),
    **{_Z + f"zenflow.{k}": (f"zero/offload/zenflow.py::section.{k}",) for k in (
        "topk_ratio", "update_interval", "full_warm_up_rounds", "auto_ratio")},
    _Z + "zenflow.overlap_step": ("zero/offload/zenflow.py::section.overlap_step",
                                  "zero/offload/zenflow.py::OverlappedCpuStep(self._pieces)"),
    # config/schema_zero.py::ZenFlowConfig.select_steps turns these three into the steps between selections
    _Z + "zenflow.select_strategy": ("zero/offload/zenflow.py::section.select_steps",),
    _Z + "zenflow.select_interval": ("zero/offload/zenflow.py::section.select_steps",),
    _Z + "zenflow.steps_per_epoch": ("runtime/initialize.py::with_steps_per_epoch",
                                     "zero/offload/zenflow.py::section.select_steps"),
    "aio.block_size": ("zero/offload/policy.py::aio.block_size",),
    "aio.queue_depth": ("zero/offload/policy.py::aio.queue_depth",),
    "aio.intra_op_parallelism": ("zero/offload/policy.py::aio.intra_op_parallelism",),
    _Z + "sub_group_size": ("zero/build.py::sub_group_size", "zero/offload/nvme_swap.py::sub_group_numel"),
    _Z + "stage3_prefetch_bucket_size": _BUILD, _Z + "stage3_param_persistence_threshold": _BUILD,
    _Z + "stage3_max_live_parameters": _BUILD, _Z + "stage3_max_reuse_distance": _BUILD,
    _Z + "stage3_release_grads": _BUILD,
    _Z + "stage3_model_persistence_threshold": _BUILD, _Z + "stage3_module_granularity_threshold": _BUILD,
    _Z + "pipeline_loading_checkpoint": ("runtime/initialize.py",),
    _Z + "stage3_gather_16bit_weights_on_model_save": ("runtime/engine_queries.py", "runtime/model_export.py"),
    # logging and monitors
    "steps_per_print": _ENGINE, "wall_clock_breakdown": _ENGINE, "dump_state": ("runtime/initialize.py",),
    "tensorboard.enabled": ("runtime/monitor.py::tensorboard.enabled",),
    "tensorboard.output_path": ("runtime/monitor.py",), "tensorboard.job_name": ("runtime/monitor.py",),
    "csv_monitor.enabled": ("runtime/monitor.py::csv_monitor.enabled",),
    "csv_monitor.output_path": ("runtime/monitor.py",), "csv_monitor.job_name": ("runtime/monitor.py",),
    "wandb.enabled": ("runtime/monitor.py::wandb.enabled",), "wandb.group": ("runtime/monitor.py::wandb.group",),
    "wandb.team": ("runtime/monitor.py::wandb.team",), "wandb.project": ("runtime/monitor.py::wandb.project",),
    # activation checkpointing (initialize() -> configure_from_config)
    **{f"activation_checkpointing.{k}": ("activation_checkpointing.py",) for k in (
        "cpu_checkpointing", "synchronize_checkpoint_boundary", "profile")},
    "comms_logger.enabled": ("runtime/initialize.py::comms.enabled",),
    "comms_logger.verbose": ("runtime/initialize.py::comms.verbose",),
    "comms_logger.prof_all": ("runtime/initialize.py::comms.prof_all",),
    "comms_logger.prof_ops": ("runtime/initialize.py::comms.prof_ops",),
    "bf16.bf16_master_weights_and_grads": ("zero/build.py::cfg.bf16_masters",),
    "bf16.bf16_optimizer_states": ("zero/build.py::cfg.bf16_masters",),
    "checkpoint.use_node_local_storage": ("runtime/initialize.py::cfg.checkpoint.use_node_local_storage",),
    "checkpoint.auto_resume_dir": ("runtime/initialize.py::cfg.checkpoint.auto_resume_dir",),
    "checkpoint.async_save": ("runtime/initialize.py::section.async_save",),
    "checkpoint.keep_last": ("runtime/initialize.py::section.keep_last",),
    "checkpoint.load_universal": ("runtime/initialize.py::section.load_universal",),
    "checkpoint.save_dir": ("runtime/periodic_save.py::section.save_dir",),
    "checkpoint.save_interval_steps": ("runtime/periodic_save.py::section.save_interval_steps",),
    "checkpoint.save_interval_minutes": ("runtime/periodic_save.py::section.save_interval_minutes",),
    "checkpoint.preemption_save": ("runtime/preemption.py::section.preemption_save",),
    "checkpoint.preemption_grace_seconds": ("runtime/preemption.py::section.preemption_grace_seconds",),
    **{f"fp8.{k}": (f"runtime/initialize.py::fp8.{k}",) for k in ("enabled", "recipe", "exclude", "keep_first_last",
                                                                           "backend")},
    "fp8.float8_all_gather": ("zero/build.py::cfg.fp8.float8_all_gather",),
    "expert_parallel.enabled": ("moe/hf_experts.py::ep.enabled",),
    "expert_parallel.autoep_size": ("runtime/initialize.py::expert_parallel_size_of(raw_config)",
                                    "moe/hf_experts.py::ep.autoep_size"),
    "expert_parallel.preset_model": ("moe/hf_experts.py::ep.preset_model",),
    "expert_parallel.load_balance_coeff": ("runtime/initialize.py::load_balance_coeff",),
    "tensor_parallel.autotp_size": ("runtime/initialize.py::config_tp=tensor_parallel_size(raw_config)",),
    "tensor_parallel.tensor_parallel.tp_size": ("runtime/initialize.py::config_tp=tensor_parallel_size(raw_config)",),
    "tensor_parallel.preset_model": ("tensor_parallel/tp_plan.py::config.preset_model",),
    "tensor_parallel.vocab_parallel_lm_head": ("tensor_parallel/tp_plan.py::config.vocab_parallel_lm_head",),
    "tensor_parallel.partition_config.layer_specs": ("tensor_parallel/tp_plan.py::part.layer_specs",),
    "tensor_parallel.partition_config.use_default_specs": ("tensor_parallel/tp_plan.py::part.use_default_specs",),
    "tensor_parallel.partition_config.strict_mode": ("tensor_parallel/tp_plan.py::part.strict_mode",),
    "tensor_parallel.partition_config.lm_head_patterns": ("tensor_parallel/tp_plan.py::part.lm_head_patterns",),
    "torch_autocast.enabled": ("runtime/autocast.py::section.enabled",),
    "pipeline.activation_checkpoint_interval": ("runtime/pipe_engine.py",),
    "pipeline.use_reentrant": ("runtime/pipe_engine.py",),
    "pipeline.schedule": ("pipe/schedules.py",),
    "torch_autocast.dtype": ("runtime/autocast.py::section.precision",),
    # scheduler parameters: the schedule classes take them by name
    **{f"scheduler.params[{cls}].{k}": _SCHED for cls, keys in (
        ("WarmupLR", ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration")),
        ("WarmupDecayLR", ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                           "last_batch_iteration")),
        ("WarmupCosineLR", ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                            "warmup_type", "last_batch_iteration")),
        ("OneCycle", ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
                      "cycle_second_step_size", "cycle_first_stair_count", "cycle_second_stair_count",
                      "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate",
                      "last_batch_iteration")),
        ("LRRangeTest", ("lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                         "lr_range_test_staircase", "last_batch_iteration")),
    ) for k in keys},
}
"""Key -> where it is consumed (paths below zeroshard/): "file" (the file mentions the key's
name), "file::text" (the file contains `text`), or "class:module.Name" (the class takes the key
as a constructor argument, for parameters passed through as keyword arguments)."""

_PARAM_PAGES = ("parameter shards on NVMe are a memory-mapped swap file read ahead unit by unit; "
                "max_in_cpu bounds what stays in memory, so there are no swap buffers to count or size "
                "(zero/offload/nvme_params.py).")

_PIPE = ("the NVMe step always reads ahead and writes behind while stepping, in buffer_count slots "
         "of sub_group_size elements per state (zero/offload/nvme_swap.py).")

NO_EFFECT: dict[str, str] = {
    _Z + "zenflow.pt_reserved_cores_perc": "the cores DeepSpeed leaves to PyTorch beside its overlapped "
    "optimizer process; zeroshard's overlapped CPU step (overlap_step) is a thread of the training process "
    "that shares its cores (Note: [zenflow overlap] in zero/offload/zenflow_overlap.py).",
    "data_types.param_dtype": "the parameters' dtype follows fp16.enabled / bf16.enabled; the key may only "
    "agree with them (a disagreeing value is refused at config load, as DeepSpeed asserts).",
    "bf16.immediate_grad_update": "zeroshard always folds each micro-batch's gradients into the "
    "grad_accum_dtype buffers right after its backward.",
    "bf16.check_grad_overflow": "zeroshard computes the global gradient norm every step (for clipping) "
    "and always skips a step whose gradients hold inf/nan, at every precision.",
    _Z + "contiguous_gradients": "every stage reduces from contiguous flat buffers; there is no "
    "non-contiguous path to choose.",
    _Z + "use_multi_rank_bucket_allreduce": "each bucket is reduced with one collective whatever "
    "partitions it spans.",
    _Z + "elastic_checkpoint": "every zeroshard checkpoint loads at any world size and stage "
    "(resharded on load).",
    _Z + "round_robin_gradients": "each rank copies only its own gradient shard to the CPU, so there "
    "is no cross-rank copy order to balance.",
    _Z + "memory_efficient_linear": "stage 3 re-gathers each unit's weights for its backward, so no "
    "module keeps gathered weights alive; there is no special linear function to switch.",
    _Z + "log_trace_cache_warnings": "logging of DeepSpeed's stage-3 trace cache, which zeroshard does not have.",
    _Z + "enable_sanity_checks": "extra checks of DeepSpeed's stage-3 bookkeeping; zeroshard's "
    "invariants are always checked.",
    _Z + "save_muon_momentum_buffer_in_memory": "applies to DeepSpeed's Muon optimizer, which is not "
    "provided (refused).",
    **{_Z + f"offload_param.{k}": _PARAM_PAGES for k in ("buffer_count", "buffer_size")},
    _Z + "offload_optimizer.pipeline_read": _PIPE,
    _Z + "offload_optimizer.pipeline_write": _PIPE,
    "aio.single_submit": "each block is its own preadv/pwritev call from a pool thread; there is no "
    "batched submission to turn off (zero/offload/nvme_io.py).",
    "aio.overlap_events": "pool threads complete their own requests; submission never waits on "
    "completions, so there is nothing to overlap or not (zero/offload/nvme_io.py).",
    _Z + "offload_optimizer.cpuadam_cores_perc": "a SuperOffload setting; super_offload is not "
    "supported yet (refused).",
    "torch_autocast.lower_precision_safe_modules": "checked to import at initialize; zeroshard reduces "
    "every gradient in its accumulation dtype, where DeepSpeed sends these modules' gradients in the "
    "autocast dtype (docs/deepspeed-differences.md).",
    "comms_logger.debug": "logging detail: DeepSpeed adds the caller's name to each record; "
    "zeroshard's records do not carry it.",
    "activation_checkpointing.partition_activations": "zeroshard has no model parallelism, so the "
    "model-parallel size is 1 and there is nothing to partition over (configure() with a larger mpu refuses it).",
    "activation_checkpointing.contiguous_memory_optimization": "DeepSpeed's preallocated buffer for "
    "partitioned checkpoints; PyTorch's caching allocator handles fragmentation (validated: needs "
    "partition_activations and number_checkpoints, as in DeepSpeed).",
    "activation_checkpointing.number_checkpoints": "sizes DeepSpeed's contiguous buffer, which zeroshard "
    "does not allocate (validated with contiguous_memory_optimization).",
    "zero_allow_untested_optimizer": "zeroshard partitions any torch.optim optimizer; there is no "
    "list of tested optimizers to bypass.",
    "zero_force_ds_cpu_optimizer": "zeroshard steps any torch optimizer on the CPU shard; there is no "
    "DeepSpeed CPU optimizer to force.",
    "checkpoint.tag_validation": "zeroshard always compares save_dir and tag across ranks at the save call "
    "and refuses a difference on every rank (one checkpoint is one directory), so Ignore and Warn do not relax "
    "it; accepted so DeepSpeed configs load.",
    "optimizer.params[OneBitAdam].max_grad_norm": "DeepSpeed's OnebitAdam stores it and never reads it; "
    "the top-level gradient_clipping clips.",
    "optimizer.params[ZeroOneAdam].max_grad_norm": "DeepSpeed's ZeroOneAdam stores it and never reads it; "
    "the top-level gradient_clipping clips.",
    "optimizer.params[OneBitLamb].max_grad_norm": "DeepSpeed's OnebitLamb stores it and never reads it; "
    "the top-level gradient_clipping clips.",
    "optimizer.params[OneBitLamb].eps_inside_sqrt": "DeepSpeed's OnebitLamb stores it and always adds eps "
    "outside the square root; so does zeroshard's.",
    "optimizer.params[ZeroOneAdam].eps_inside_sqrt": "DeepSpeed's ZeroOneAdam stores it and always adds eps "
    "outside the square root; so does zeroshard's.",
    "pipeline.stages": "DeepSpeed carries it in its default pipeline block and never reads it; the "
    "PipelineModule's num_stages / topology sets the stages.",
    "pipeline.partition": "DeepSpeed carries it in its default pipeline block and never reads it; the "
    "PipelineModule's partition_method cuts the layers.",
    "pipeline.seed_layers": "DeepSpeed carries it in its default pipeline block and never reads it; "
    "PipelineModule(seed_layers=) seeds the layers.",
    "pipeline.pipe_partitioned": "splits stage-to-stage activations over tensor-parallel ranks in DeepSpeed; "
    "zeroshard's pipelines have no tensor parallelism, so there is nothing to split.",
    "pipeline.grad_partitioned": "splits stage-to-stage gradients over tensor-parallel ranks in DeepSpeed; "
    "zeroshard's pipelines have no tensor parallelism, so there is nothing to split.",
    "expert_parallel.use_grouped_mm": "the local experts run the model's own experts implementation "
    "(transformers' config._experts_implementation: eager, batched_mm or grouped_mm), which decides it.",
    "expert_parallel.disable_triton_grouped_mm": "zeroshard has no Triton grouped GEMM to disable.",
    **{f"expert_parallel.{k}": "a kernel choice of DeepSpeed's AutoEP layer; zeroshard's combine weights and sums "
       "each token's expert outputs in one way (moe/hf_experts.py)." for k in ("combine_impl", "row_weighting_impl",
                                                                               "gate_up_impl")},
    **{f"expert_parallel.{k}": "tunes DeepEP, which is not built (comm_backend \"comm\")."
       for k in ("comm_num_sm", "comm_qp_margin", "comm_max_tokens_per_rank")},
    "tensor_parallel.tp_overlap_comm": "the all-reduce of a row-parallel layer's output feeds the next "
    "operation directly, so there is no computation to overlap it with (zeroshard/tensor_parallel/layers.py).",
    "tensor_parallel.tensor_parallel.tp_grain_size": "DeepSpeed's granularity of uneven splits (inactive in its "
    "training path too); zeroshard splits evenly and refuses a dimension the size does not divide.",
    "tensor_parallel.partition_config.tp_size": "overwritten by autotp_size, as in DeepSpeed "
    "(AutoTPConfig.tp_size is set from it).",
    "tensor_parallel.partition_config.embedding_partition_dim": "embeddings stay whole on every "
    "tensor-parallel rank (as DeepSpeed's AutoTP keeps them), so there is no dimension to choose.",
    "tensor_parallel.keep_module_on_host": "a loading option of DeepSpeed's inference path; zeroshard "
    "splits the model in initialize and keeps each rank's pieces where the model was placed.",
    "optimizer.params[Adam].torch_adam": "zeroshard always uses torch's Adam (its fused kernel where "
    "available), which is what true asks DeepSpeed for.",
}
"""Key -> why its value cannot change what zeroshard does."""


def support_key(key: str) -> str:
    """`optimizer.params[Adam].lr` -> `optimizer.params.lr` (the spelling support.py uses)."""
    head, _, rest = key.partition("[")
    return head + rest.partition("]")[2] if rest else key


def effect_of(key: str) -> Effect:
    """Which of the three a schema key is (see the module docstring).

    Raises:
        KeyError: the key is in none of the tables (a new field must be added to one).
    """
    entry = status_of(support_key(key))
    if entry is not None and (entry.allowed is None or len(entry.allowed) == 1):
        return "refused unless default"
    if key in ACTED_ON:
        return "acted on"
    if key in NO_EFFECT:
        return "accepted without effect"
    raise KeyError(key)
