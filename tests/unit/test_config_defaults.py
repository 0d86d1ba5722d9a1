"""Every schema default against DeepSpeed 0.19.8's, key by key (issue 9: same config, same numbers).

`DEEPSPEED_0_19_8` is a literal table written by reading DeepSpeed 0.19.8's source (the files named
in each group's comment). A key whose zeroshard default differs must have a row in the
"Defaults that differ" table of docs/deepspeed-differences.md, with the reason; a row for a key
that no longer differs fails too. When DeepSpeed is importable, a second test reads its pydantic
models, constants and constructor signatures and checks the literal table itself.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from zeroshard.config import load_config
from zeroshard.config.fields import default_of, get_dotted, hints, is_section, json_fields
from zeroshard.config.schema import Config
from zeroshard.config.schema_ep import ExpertParallelConfig
from zeroshard.config.schema_optim import OPTIMIZER_PARAMS, SCHEDULER_PARAMS

DOC = Path(__file__).resolve().parents[2] / "docs" / "deepspeed-differences.md"

DERIVED = "derived from the other two batch keys"
STAGE3_ONLY_TRUE = "true at stage 3, false below"
REMOVED = "key removed in 0.19 (DeepSpeed refuses it)"
REQUIRED = "required"
EXTENSION = "zeroshard's extension (DeepSpeed has no such key)"

DEEPSPEED_0_19_8: dict[str, Any] = {
    # runtime/constants.py (+ runtime/config.py getters)
    "train_batch_size": DERIVED, "train_micro_batch_size_per_gpu": DERIVED, "gradient_accumulation_steps": DERIVED,
    "managed_gradient_accumulation": True,
    "optimizer": None, "scheduler": None,
    "gradient_clipping": 1.0, "steps_per_print": None, "wall_clock_breakdown": False, "dump_state": False,
    "communication_data_type": None, "seq_parallel_communication_data_type": "fp32",
    "prescale_gradients": False, "gradient_predivide_factor": 1.0,
    # read from the raw dict by DeepSpeed (absent: no sequence parallelism, no data-parallel check)
    "sequence_parallel_size": 1, "data_parallel_size": None,
    "gradient_allreduce_op": "mean", "zero_allow_untested_optimizer": False, "zero_force_ds_cpu_optimizer": True,
    "sparse_gradients": REMOVED, "disable_allgather": False, "memory_breakdown": False,
    "dataloader_drop_last": False, "data_types.grad_accum_dtype": None,
    "data_types.param_dtype": None, "data_types.buffer_dtype": None,
    "data_types.keep_in_fp32_modules": None,  # DeepSpeed's "auto", which zeroshard reads as null: the same rule
    "checkpoint.tag_validation": "Warn", "checkpoint.load_universal": False,
    "checkpoint.use_node_local_storage": False, "checkpoint.parallel_write.pipeline_stage": False,
    # runtime/model_checkpointing/constants.py
    "checkpoint.checkpoint_serialization": True, "checkpoint.auto_resume_dir": EXTENSION,
    "checkpoint.async_save": EXTENSION, "checkpoint.save_dir": EXTENSION, "checkpoint.save_interval_steps": EXTENSION,
    "checkpoint.save_interval_minutes": EXTENSION, "checkpoint.keep_last": EXTENSION,
    "checkpoint.preemption_save": EXTENSION, "checkpoint.preemption_grace_seconds": EXTENSION,
    # runtime/precision_config.py (the pydantic models DeepSpeedConfig uses, not constants.py's
    # BFLOAT16_* leftovers, which say immediate_grad_update=True and check_grad_overflow=False)
    "fp16.enabled": False, "fp16.auto_cast": False, "fp16.loss_scale": 0.0, "fp16.initial_scale_power": 16,
    "fp16.loss_scale_window": 1000, "fp16.hysteresis": 2, "fp16.consecutive_hysteresis": False,
    "fp16.min_loss_scale": 1, "fp16.fp16_master_weights_and_grads": False,
    "bf16.enabled": False, "bf16.immediate_grad_update": False, "bf16.check_grad_overflow": True,
    "bf16.bf16_master_weights_and_grads": False, "bf16.bf16_optimizer_states": False,
    # runtime/zero/config.py
    "zero_optimization.stage": 0, "zero_optimization.contiguous_gradients": True,
    "zero_optimization.reduce_scatter": True, "zero_optimization.reduce_bucket_size": 500_000_000,
    "zero_optimization.use_multi_rank_bucket_allreduce": True, "zero_optimization.allgather_partitions": True,
    "zero_optimization.allgather_bucket_size": 500_000_000, "zero_optimization.overlap_comm": STAGE3_ONLY_TRUE,
    "zero_optimization.load_from_fp32_weights": True, "zero_optimization.elastic_checkpoint": False,
    "zero_optimization.sub_group_size": 1_000_000_000,
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_param_persistence_threshold": 100_000,
    "zero_optimization.stage3_model_persistence_threshold": 9223372036854775807,  # sys.maxsize
    "zero_optimization.stage3_max_live_parameters": 1_000_000_000,
    "zero_optimization.stage3_max_reuse_distance": 1_000_000_000,
    "zero_optimization.stage3_release_grads": EXTENSION,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    "zero_optimization.stage3_module_granularity_threshold": 0,
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": False,
    "zero_optimization.stage3_allgather_sequential": False,
    "zero_optimization.ignore_unused_parameters": True, "zero_optimization.legacy_stage1": False,
    "zero_optimization.round_robin_gradients": False, "zero_optimization.zero_hpz_partition_size": 1,
    "zero_optimization.zero_quantized_weights": False, "zero_optimization.zero_quantized_nontrainable_weights": False,
    "zero_optimization.zero_quantized_gradients": False,
    "zero_optimization.mics_shard_size": REMOVED, "zero_optimization.mics_hierarchical_params_gather": REMOVED,
    "zero_optimization.memory_efficient_linear": True, "zero_optimization.pipeline_loading_checkpoint": False,
    "zero_optimization.override_module_apply": True, "zero_optimization.log_trace_cache_warnings": False,
    "zero_optimization.enable_sanity_checks": False, "zero_optimization.save_muon_momentum_buffer_in_memory": False,
    # runtime/zero/offload_config.py
    "zero_optimization.offload_param.device": "none", "zero_optimization.offload_param.nvme_path": None,
    "zero_optimization.offload_param.buffer_count": 5, "zero_optimization.offload_param.buffer_size": 100_000_000,
    "zero_optimization.offload_param.max_in_cpu": 1_000_000_000, "zero_optimization.offload_param.pin_memory": True,
    # runtime/zero/leaf_module_config.py
    "zero_optimization.leaf_module.classes": (
        "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"),
    "zero_optimization.leaf_module.names": (), "zero_optimization.leaf_module.name_suffixes": (),
    "zero_optimization.offload_optimizer.device": "none", "zero_optimization.offload_optimizer.nvme_path": None,
    "zero_optimization.offload_optimizer.buffer_count": 4, "zero_optimization.offload_optimizer.pin_memory": True,
    "zero_optimization.offload_optimizer.pipeline_read": False,
    "zero_optimization.offload_optimizer.pipeline_write": False,
    "zero_optimization.offload_optimizer.fast_init": False, "zero_optimization.offload_optimizer.ratio": 1.0,
    "zero_optimization.offload_optimizer.super_offload": False,
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": 0.8,
    # runtime/zenflow/zenflow_config.py (ZenFlowConfig; the section is None unless given)
    "zero_optimization.zenflow.topk_ratio": 0.1, "zero_optimization.zenflow.select_strategy": "auto",
    "zero_optimization.zenflow.select_interval": "auto", "zero_optimization.zenflow.update_interval": "auto",
    "zero_optimization.zenflow.overlap_step": False, "zero_optimization.zenflow.offload": False,
    "zero_optimization.zenflow.auto_ratio": 0.99, "zero_optimization.zenflow.full_warm_up_rounds": 0,
    "zero_optimization.zenflow.pt_reserved_cores_perc": 0.5, "zero_optimization.zenflow.steps_per_epoch": None,
    "zero_optimization.offload_optimizer.delayed_update": EXTENSION,
    "zero_optimization.offload_optimizer.delayed_update_warmup_steps": EXTENSION,
    # monitor/config.py
    "tensorboard.enabled": False, "tensorboard.output_path": "", "tensorboard.job_name": "DeepSpeedJobName",
    "csv_monitor.enabled": False, "csv_monitor.output_path": "", "csv_monitor.job_name": "DeepSpeedJobName",
    "wandb.enabled": False, "wandb.group": None, "wandb.team": None, "wandb.project": "deepspeed",
    # comm/config.py, comm/constants.py
    "comms_logger.enabled": False, "comms_logger.verbose": False, "comms_logger.prof_all": True,
    "comms_logger.debug": False, "comms_logger.prof_ops": (),
    # runtime/config.py get_torch_autocast_* (no section: disabled, dtype and modules None)
    "torch_autocast.enabled": False, "torch_autocast.dtype": None,
    "torch_autocast.lower_precision_safe_modules": None,
    # runtime/tensor_parallel/config.py (TPTrainingConfig, TPConfig); partition_config: the keys
    # module_inject/autotp_config.py's AutoTPConfig.from_dict reads, with its defaults
    "tensor_parallel.autotp_size": 0, "tensor_parallel.tp_overlap_comm": False,
    "tensor_parallel.vocab_parallel_lm_head": None, "tensor_parallel.vocab_parallel_ce_backend": "torch",
    "tensor_parallel.tensor_parallel.tp_size": 1, "tensor_parallel.tensor_parallel.tp_grain_size": 1,
    "tensor_parallel.preset_model": None, "tensor_parallel.keep_module_on_host": False,
    "tensor_parallel.replace_with_kernel_inject": False, "tensor_parallel.injection_policy_tuple": None,
    "tensor_parallel.partition_config.use_default_specs": True, "tensor_parallel.partition_config.layer_specs": (),
    "tensor_parallel.partition_config.tp_size": 1, "tensor_parallel.partition_config.embedding_partition_dim": 1,
    "tensor_parallel.partition_config.lm_head_patterns": ("lm_head", "embed_out"),
    "tensor_parallel.partition_config.strict_mode": False,
    # module_inject/auto_ep_config.py parse_autoep_config (expert_w3: its "unset" sentinel, the preset's)
    **{f"expert_parallel.{k}": v for k, v in (
        ("enabled", False), ("autoep_size", 1), ("expert_tensor_parallel_size", 1), ("validate_folding_routing", False),
        ("async_split_plan", False), ("preset_model", None), ("moe_layer_pattern", None), ("expert_pattern", None),
        ("router_pattern", None), ("use_grouped_mm", True), ("disable_triton_grouped_mm", False), ("route_norm", None),
        ("route_scale", 1.0), ("score_apply", "auto"), ("combine_impl", "auto"), ("row_weighting_impl", "auto"),
        ("gate_up_impl", "separate"), ("comm_backend", "comm"), ("comm_num_sm", 12), ("comm_qp_margin", 4),
        ("comm_max_tokens_per_rank", 0), ("num_expert_groups", None), ("num_limited_groups", None),
        ("score_func", "auto"), ("top_k", "auto"), ("load_balance_coeff", None), ("routed_scaling_factor", "auto"),
        ("expert_w1", None), ("expert_w2", None), ("expert_w3", None), ("num_experts_attr", None),
        ("top_k_attr", None), ("has_shared_experts", None), ("shared_experts_pattern", None),
        ("shared_experts_gate_pattern", None), ("expert_activation", None))},
    # runtime/config.py get_pipeline_config; runtime/pipe/engine.py (use_reentrant: None -> True)
    "pipeline.stages": "auto", "pipeline.partition": "best", "pipeline.seed_layers": False,
    "pipeline.activation_checkpoint_interval": 0, "pipeline.pipe_partitioned": True,
    "pipeline.grad_partitioned": True, "pipeline.use_reentrant": True, "pipeline.schedule": EXTENSION,
    "fp8.enabled": EXTENSION, "fp8.recipe": EXTENSION, "fp8.exclude": EXTENSION, "fp8.keep_first_last": EXTENSION,
    "fp8.backend": EXTENSION, "fp8.float8_all_gather": EXTENSION,
    # compile/config.py CompileConfig
    **{f"compile.{k}": v for k, v in (
        ("deepcompile", False), ("autoep_non_moe", False), ("free_activation", False),
        ("free_activation_threshold", 10 * 1024 * 1024), ("offload_activation", False),
        ("offload_activation_pin_memory", True), ("offload_opt_states", False), ("double_buffer", True),
        ("symmetric_memory", False), ("debug_log", False), ("offload_parameters", False),
        ("sync_before_reduce", False), ("sync_after_reduce", False), ("sync_before_allgather", False),
        ("sync_after_allgather", False), ("keep_int_input_tensors", True), ("keep_all_input_tensors", False),
        ("passes", None))},
    # runtime/swap_tensor/constants.py
    "aio.block_size": 1_048_576, "aio.queue_depth": 8, "aio.intra_op_parallelism": 1, "aio.single_submit": False,
    "aio.overlap_events": True, "aio.use_gds": False,
    # activation_checkpointing/config.py
    "activation_checkpointing.partition_activations": False, "activation_checkpointing.cpu_checkpointing": False,
    "activation_checkpointing.contiguous_memory_optimization": False,
    "activation_checkpointing.number_checkpoints": None,
    "activation_checkpointing.synchronize_checkpoint_boundary": False, "activation_checkpointing.profile": False,
    # runtime/config.py (LEGACY_FUSION_DEFAULT); ops/adam/fused_adam.py FusedAdam.__init__ and
    # runtime/engine.py (torch_adam popped with default False, adam_w_mode ADAM_W_MODE_DEFAULT)
    "optimizer.legacy_fusion": False,
    "optimizer.params[Adam].lr": 1e-3, "optimizer.params[Adam].betas": (0.9, 0.999),
    "optimizer.params[Adam].eps": 1e-8, "optimizer.params[Adam].weight_decay": 0.0,
    "optimizer.params[Adam].bias_correction": True, "optimizer.params[Adam].adam_w_mode": True,
    "optimizer.params[Adam].torch_adam": False, "optimizer.params[Adam].amsgrad": False,
    # ops/lamb/fused_lamb.py FusedLamb.__init__
    "optimizer.params[Lamb].lr": 1e-3, "optimizer.params[Lamb].bias_correction": True,
    "optimizer.params[Lamb].betas": (0.9, 0.999), "optimizer.params[Lamb].eps": 1e-8,
    "optimizer.params[Lamb].eps_inside_sqrt": False, "optimizer.params[Lamb].weight_decay": 0.0,
    "optimizer.params[Lamb].max_grad_norm": 0.0, "optimizer.params[Lamb].max_coeff": 10.0,
    "optimizer.params[Lamb].min_coeff": 0.01, "optimizer.params[Lamb].amsgrad": False,
    # runtime/fp16/onebit/adam.py OnebitAdam.__init__ (removed from DeepSpeed in 0.19; read from the
    # last releases that had it, microsoft/DeepSpeed master before the removal)
    **{f"optimizer.params[OneBitAdam].{k}": v for k, v in (
        ("lr", 1e-3), ("freeze_step", 100000), ("bias_correction", True), ("betas", (0.9, 0.999)),
        ("eps", 1e-8), ("eps_inside_sqrt", False), ("weight_decay", 0.0), ("max_grad_norm", 0.0),
        ("amsgrad", False), ("cuda_aware", False), ("comm_backend_name", "nccl"))},
    # runtime/fp16/onebit/zoadam.py ZeroOneAdam.__init__ (removed likewise; read from
    # microsoft/DeepSpeed master before the removal)
    **{f"optimizer.params[ZeroOneAdam].{k}": v for k, v in (
        ("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)), ("eps", 1e-8),
        ("eps_inside_sqrt", False), ("weight_decay", 0.0), ("max_grad_norm", 0.0), ("var_freeze_step", 100000),
        ("var_update_scaler", 16), ("local_step_scaler", 32678), ("local_step_clipper", 16), ("amsgrad", False),
        ("cuda_aware", False), ("comm_backend_name", "nccl"))},
    # runtime/fp16/onebit/lamb.py OnebitLamb.__init__ (removed likewise; read from
    # microsoft/DeepSpeed master before the removal)
    **{f"optimizer.params[OneBitLamb].{k}": v for k, v in (
        ("lr", 1e-3), ("freeze_step", 100000), ("bias_correction", True), ("betas", (0.9, 0.999)),
        ("eps", 1e-8), ("eps_inside_sqrt", False), ("weight_decay", 0.0), ("max_grad_norm", 0.0),
        ("max_coeff", 10.0), ("min_coeff", 0.01), ("amsgrad", False), ("cuda_aware", False),
        ("comm_backend_name", "nccl"), ("coeff_beta", 0.9), ("factor_max", 4.0), ("factor_min", 0.5),
        ("factor_threshold", 0.1))},
    # optim/lr_schedules.py constructors
    "scheduler.params[WarmupLR].warmup_min_lr": 0.0, "scheduler.params[WarmupLR].warmup_max_lr": None,
    "scheduler.params[WarmupLR].warmup_num_steps": 1000, "scheduler.params[WarmupLR].warmup_type": "log",
    "scheduler.params[WarmupLR].last_batch_iteration": -1,
    "scheduler.params[WarmupDecayLR].total_num_steps": REQUIRED,
    "scheduler.params[WarmupDecayLR].warmup_min_lr": 0.0, "scheduler.params[WarmupDecayLR].warmup_max_lr": 0.001,
    "scheduler.params[WarmupDecayLR].warmup_num_steps": 1000, "scheduler.params[WarmupDecayLR].warmup_type": "log",
    "scheduler.params[WarmupDecayLR].last_batch_iteration": -1,
    "scheduler.params[WarmupCosineLR].total_num_steps": REQUIRED,
    "scheduler.params[WarmupCosineLR].warmup_min_ratio": 0.0,
    "scheduler.params[WarmupCosineLR].warmup_num_steps": 1000,
    "scheduler.params[WarmupCosineLR].cos_min_ratio": 0.0001, "scheduler.params[WarmupCosineLR].warmup_type": "log",
    "scheduler.params[WarmupCosineLR].last_batch_iteration": -1,
    "scheduler.params[OneCycle].cycle_min_lr": REQUIRED, "scheduler.params[OneCycle].cycle_max_lr": REQUIRED,
    "scheduler.params[OneCycle].decay_lr_rate": 0.0, "scheduler.params[OneCycle].cycle_first_step_size": 2000,
    "scheduler.params[OneCycle].cycle_second_step_size": None,
    "scheduler.params[OneCycle].cycle_first_stair_count": 0,
    "scheduler.params[OneCycle].cycle_second_stair_count": None, "scheduler.params[OneCycle].decay_step_size": 0,
    "scheduler.params[OneCycle].cycle_momentum": True, "scheduler.params[OneCycle].cycle_min_mom": 0.8,
    "scheduler.params[OneCycle].cycle_max_mom": 0.9, "scheduler.params[OneCycle].decay_mom_rate": 0.0,
    "scheduler.params[OneCycle].last_batch_iteration": -1,
    "scheduler.params[LRRangeTest].lr_range_test_min_lr": 1e-3,
    "scheduler.params[LRRangeTest].lr_range_test_step_size": 2000,
    "scheduler.params[LRRangeTest].lr_range_test_step_rate": 1.0,
    "scheduler.params[LRRangeTest].lr_range_test_staircase": False,
    "scheduler.params[LRRangeTest].last_batch_iteration": -1,
}
"""DeepSpeed 0.19.8's default for every zeroshard schema key (read from its source)."""


def _leaves(cls: type, prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    types_ = hints(cls)
    for f in json_fields(cls):
        if is_section(types_[f.name]):
            out.update(_leaves(types_[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = default_of(f)
    return out


def zeroshard_defaults() -> dict[str, Any]:
    """Every schema key with zeroshard's default, in the table's spelling."""
    table = _leaves(Config, "")
    table["optimizer.legacy_fusion"] = False
    by_cls: dict[type, str] = {}
    for canonical, cls in OPTIMIZER_PARAMS.values():
        by_cls.setdefault(cls, canonical)
    for cls, canonical in by_cls.items():
        table.update(_leaves(cls, f"optimizer.params[{canonical}]."))
    for canonical, cls in SCHEDULER_PARAMS.values():
        table.update(_leaves(cls, f"scheduler.params[{canonical}]."))
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        table[key] = DERIVED  # solved by config/batch.py from the other two, as DeepSpeed does
    return {k: (REQUIRED if v is dataclasses.MISSING else v) for k, v in table.items()}


def documented_differences() -> dict[str, str]:
    """Keys in the "Defaults that differ" table of docs/deepspeed-differences.md -> their row."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"^## Defaults that differ\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"{DOC}: no '## Defaults that differ' section"
    rows = {}
    for line in match.group(1).splitlines():
        cell = re.match(r"\|\s*`([^`]+)`\s*\|", line)
        if cell:
            rows[cell.group(1)] = line
    return rows


def _same(ours: Any, theirs: Any) -> bool:
    if theirs == STAGE3_ONLY_TRUE:
        return (load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3}}, dp_world_size=1)
                .zero_optimization.overlap_comm is True
                and load_config({"train_batch_size": 2, "zero_optimization": {"stage": 2}}, dp_world_size=1)
                .zero_optimization.overlap_comm is False)
    if theirs == EXTENSION:
        return False  # no DeepSpeed default to equal: documented as zeroshard's extension
    if theirs == REMOVED:
        return False  # DeepSpeed refuses the key; zeroshard keeps it as "off" (documented)
    return type(ours) is type(theirs) and ours == theirs or (
        isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and not isinstance(ours, bool)
        and not isinstance(theirs, bool) and ours == theirs)


def test_table_covers_every_schema_key() -> None:
    ours = set(zeroshard_defaults())
    assert ours - set(DEEPSPEED_0_19_8) == set(), "schema keys missing from the DeepSpeed table"
    assert set(DEEPSPEED_0_19_8) - ours == set(), "table rows for keys the schema no longer has"
    assert len(DEEPSPEED_0_19_8) >= 170


def test_defaults_equal_deepspeeds_or_are_documented() -> None:
    ours = zeroshard_defaults()
    differ = {k for k, theirs in DEEPSPEED_0_19_8.items() if not _same(ours[k], theirs)}
    documented = set(documented_differences())
    assert differ - documented == set(), "defaults that differ from DeepSpeed 0.19.8 without a row in " \
        f"{DOC.name}: " + ", ".join(f"{k} (ours {ours[k]!r}, DeepSpeed {DEEPSPEED_0_19_8[k]!r})"
                                   for k in sorted(differ - documented))
    assert documented - differ == set(), f"{DOC.name} lists keys whose defaults now agree"


def test_resolved_config_holds_the_defaults() -> None:
    """The loader's output (not only the dataclass defaults) carries them: a minimal config."""
    cfg = load_config({"train_batch_size": 4}, dp_world_size=2)
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 10
    assert cfg.zero_optimization.offload_optimizer.pin_memory is True and cfg.bf16.check_grad_overflow is True
    assert get_dotted(cfg, "checkpoint.tag_validation") == "Warn"


# --- the literal table against the installed DeepSpeed ---------------------------------------


def _deepspeed_values() -> dict[str, Any]:
    """DeepSpeed's defaults read from its own models, constants and signatures."""
    ds = pytest.importorskip("deepspeed", reason="DeepSpeed (optional reference) is not installed")
    if not ds.__version__.startswith("0.19."):
        pytest.skip(f"the table is for DeepSpeed 0.19, found {ds.__version__}")
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.ops.adam.fused_adam import FusedAdam
    from deepspeed.ops.lamb.fused_lamb import FusedLamb
    from deepspeed.runtime import constants as c
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.activation_checkpointing import config as act
    from deepspeed.runtime.model_checkpointing import constants as mc
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    def model(prefix: str, obj: Any) -> dict[str, Any]:
        out = {}
        for name, info in type(obj).model_fields.items():
            value = getattr(obj, name)
            out[prefix + (info.alias or name)] = value.value if hasattr(value, "value") else value
        return out

    got: dict[str, Any] = {}
    zero = DeepSpeedZeroConfig()
    got.update(model("zero_optimization.", zero))
    got["zero_optimization.overlap_comm"] = STAGE3_ONLY_TRUE if (
        DeepSpeedZeroConfig(stage=3).overlap_comm and not DeepSpeedZeroConfig(stage=2).overlap_comm) else "?"
    got.update(model("zero_optimization.offload_param.", DeepSpeedZeroOffloadParamConfig()))
    got.update(model("zero_optimization.offload_optimizer.", DeepSpeedZeroOffloadOptimizerConfig()))
    leaf = model("zero_optimization.leaf_module.", zero.leaf_module)
    got.update({k: tuple(v) for k, v in leaf.items()})
    got.update(model("fp16.", DeepSpeedFP16Config()))
    got.update(model("bf16.", DeepSpeedBF16Config()))
    got.update(model("tensorboard.", TensorBoardConfig()))
    got.update(model("csv_monitor.", CSVConfig()))
    got.update(model("wandb.", WandbConfig()))
    comms = model("comms_logger.", CommsLoggerConfig())
    got.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in comms.items()})
    got.update({f"aio.{k}": v for k, v in AIO_DEFAULT_DICT.items()})
    got.update({f"activation_checkpointing.{k}": v for k, v in act.ACT_CHKPT_DEFAULT.items()})
    for key in ("gradient_clipping", "steps_per_print", "wall_clock_breakdown", "dump_state",
                "communication_data_type", "prescale_gradients", "gradient_predivide_factor",
                "gradient_allreduce_op", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
                "disable_allgather", "memory_breakdown", "dataloader_drop_last"):
        got[key] = getattr(c, key.upper() + "_DEFAULT")
    got["optimizer.legacy_fusion"] = c.LEGACY_FUSION_DEFAULT
    from deepspeed.module_inject.autotp_config import AutoTPConfig
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig

    tpc = TPTrainingConfig()
    for key in ("autotp_size", "tp_overlap_comm", "vocab_parallel_lm_head", "vocab_parallel_ce_backend",
                "preset_model", "keep_module_on_host", "replace_with_kernel_inject", "injection_policy_tuple"):
        got[f"tensor_parallel.{key}"] = getattr(tpc, key)
    for key in ("tp_size", "tp_grain_size"):
        got[f"tensor_parallel.tensor_parallel.{key}"] = getattr(tpc.tensor_parallel, key)
    part = AutoTPConfig.from_dict({})
    for key in ("use_default_specs", "tp_size", "embedding_partition_dim", "strict_mode"):
        got[f"tensor_parallel.partition_config.{key}"] = getattr(part, key)
    got["tensor_parallel.partition_config.layer_specs"] = tuple(part.layer_specs)
    got["tensor_parallel.partition_config.lm_head_patterns"] = tuple(part.lm_head_patterns)
    from deepspeed.compile.config import CompileConfig
    got.update(model("compile.", CompileConfig()))
    from deepspeed.module_inject.auto_ep_config import _UNSET, parse_autoep_config

    ep = parse_autoep_config({"enabled": False})  # a non-empty section: every key through its getter
    for f in dataclasses.fields(ExpertParallelConfig):
        value = getattr(ep, f.name)
        got[f"expert_parallel.{f.name}"] = None if value is _UNSET else value
    got["torch_autocast.enabled"] = c.TORCH_AUTOCAST_ENABLED_DEFAULT
    from deepspeed.runtime.config import get_lower_precision_safe_modules, get_torch_autocast_dtype
    got["torch_autocast.dtype"] = get_torch_autocast_dtype({})
    got["torch_autocast.lower_precision_safe_modules"] = get_lower_precision_safe_modules({})
    got["data_types.grad_accum_dtype"] = c.GRAD_ACCUM_DTYPE_DEFAULT
    tag = c.CHECKPOINT_TAG_VALIDATION_DEFAULT
    got["checkpoint.tag_validation"] = getattr(tag, "value", tag)
    got["checkpoint.load_universal"] = c.LOAD_UNIVERSAL_CHECKPOINT_DEFAULT
    got["checkpoint.use_node_local_storage"] = c.USE_NODE_LOCAL_STORAGE_CHECKPOINT_DEFAULT
    got["checkpoint.parallel_write.pipeline_stage"] = c.CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE_DEFAULT
    got["checkpoint.checkpoint_serialization"] = mc.CHECKPOINT_SERIALIZATION_DEFAULT
    for key, value in rc_pipeline_defaults().items():
        got[f"pipeline.{key}"] = value
    from deepspeed.runtime import config as rc
    for key in rc._REMOVED_TOP_LEVEL_CONFIG_KEYS:
        got[key] = REMOVED
    for key in rc._REMOVED_ZERO_CONFIG_KEYS:
        got["zero_optimization." + key] = REMOVED
    for name, cls in (("Adam", FusedAdam), ("Lamb", FusedLamb)):
        for p in list(inspect.signature(cls.__init__).parameters.values())[2:]:
            got[f"optimizer.params[{name}].{p.name}"] = p.default
    got["optimizer.params[Adam].torch_adam"] = False  # engine.py: optimizer_parameters.pop(TORCH_ADAM_PARAM, False)
    for name in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"):
        for p in list(inspect.signature(getattr(lr_schedules, name).__init__).parameters.values())[2:]:
            got[f"scheduler.params[{name}].{p.name}"] = REQUIRED if p.default is inspect.Parameter.empty else p.default
    return got


def rc_pipeline_defaults() -> dict[str, Any]:
    """DeepSpeed's pipeline block as its config parser fills it from an empty config."""
    from deepspeed.runtime.config import get_pipeline_config

    return dict(get_pipeline_config({}))


def test_literal_table_matches_installed_deepspeed() -> None:
    got = _deepspeed_values()
    checked = 0
    for key, theirs in DEEPSPEED_0_19_8.items():
        if key not in got:
            continue
        value = got[key]
        if isinstance(value, list):
            value = tuple(value)
        if hasattr(value, "__fspath__"):
            value = str(value)
        if key == "checkpoint.tag_validation":  # DeepSpeed upper-cases it; both read it case-insensitively
            value = value.capitalize()
        assert value == theirs or (value == 5e8 and theirs == 500_000_000), (
            f"{key}: table {theirs!r}, DeepSpeed {value!r}")
        checked += 1
    assert checked >= 150, f"only {checked} keys could be read from DeepSpeed"
