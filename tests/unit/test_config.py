"""Unit tests for zeroshard.config: schema defaults, every error path, "auto", batch triad, provenance."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from zeroshard.config import Config, load_config
from zeroshard.config.batch import solve_batch
from zeroshard.config.fields import get_dotted
from zeroshard.errors import ConfigError, NotSupportedError

ABSENT = object()
"""Override value that removes a key from the base config."""

BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2}


def make_raw(**overrides: Any) -> dict[str, Any]:
    """The base ds_config with overrides; `a__b=1` sets {"a": {"b": 1}}, ABSENT deletes."""
    raw = copy.deepcopy(BASE)
    for name, value in overrides.items():
        *parents, leaf = name.split("__")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        if value is ABSENT:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return raw


def make_config(*, world_size: int = 1, hidden_size: int | None = None,
                auto_values: dict[str, Any] | None = None, **overrides: Any) -> Config:
    """load_config on make_raw(**overrides)."""
    return load_config(make_raw(**overrides), dp_world_size=world_size, hidden_size=hidden_size,
                       auto_values=auto_values)


def config_error(**kwargs: Any) -> str:
    """The message of the plain ConfigError (not NotSupportedError) make_config raises."""
    with pytest.raises(ConfigError) as info:
        make_config(**kwargs)
    assert type(info.value) is ConfigError, f"expected ConfigError, got {type(info.value).__name__}"
    return str(info.value)


# --- defaults ---------------------------------------------------------------------------------

# The whole default table against DeepSpeed 0.19.8 is tests/unit/test_config_defaults.py.


def test_optimizer_and_scheduler_defaults_equal_deepspeeds() -> None:
    cfg = make_config(optimizer={"type": "Adam"}, scheduler={"type": "OneCycle", "params": {
        "cycle_min_lr": 0.0, "cycle_max_lr": 0.1}})
    assert dataclasses.asdict(cfg.optimizer.params) == {
        "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True,
        "adam_w_mode": True, "torch_adam": False, "amsgrad": False}
    assert dataclasses.asdict(cfg.scheduler.params) == {
        "cycle_min_lr": 0.0, "cycle_max_lr": 0.1, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
        "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
        "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0, "last_batch_iteration": -1}
    lamb = make_config(optimizer={"type": "lamb"}).optimizer
    assert (lamb.type, lamb.params.max_coeff, lamb.params.min_coeff) == ("Lamb", 10.0, 0.01)


@pytest.mark.parametrize("name, expected", [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
                  "warmup_type": "log", "last_batch_iteration": -1}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                       "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1}),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                        "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000,
                     "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": False,
                     "last_batch_iteration": -1}),
])
def test_scheduler_defaults(name: str, expected: dict[str, Any]) -> None:
    params = {"total_num_steps": 10} if "total_num_steps" in expected else {}
    cfg = make_config(scheduler={"type": name, "params": params})
    assert cfg.scheduler.type == name
    assert dataclasses.asdict(cfg.scheduler.params) == expected


def test_config_pickles_copies_and_converts_to_dict() -> None:
    cfg = make_config(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
                      scheduler={"type": "WarmupLR"})
    assert pickle.loads(pickle.dumps(cfg)) == cfg == copy.deepcopy(cfg)
    as_dict = dataclasses.asdict(cfg)
    assert as_dict["optimizer"]["params"] == {"lr": 0.1, "momentum": 0.9}
    assert as_dict["zero_optimization"]["offload_param"]["device"] == "none"
    assert hash(cfg.optimizer.params) == hash(copy.deepcopy(cfg.optimizer.params))


def test_config_is_frozen_and_source_not_mutated() -> None:
    raw = make_raw(zero_optimization={"reduce_bucket_size": "auto"})
    before = copy.deepcopy(raw)
    cfg = load_config(raw, dp_world_size=1, hidden_size=8)
    assert raw == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.zero_optimization.stage = 2  # type: ignore[misc]


# --- unknown, aliased and removed keys --------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"train_batch_sise": 4}, 'train_batch_sise: unknown key. Did you mean "train_batch_size"?'),
    ({"zero_optimization__overlap_comms": True},
     'zero_optimization.overlap_comms: unknown key. Did you mean "overlap_comm"?'),
    ({"zero_optimization__offload_optimizer__pin_memroy": True},
     'zero_optimization.offload_optimizer.pin_memroy: unknown key. Did you mean "pin_memory"?'),
    ({"fp16__loss_scale_windows": 10}, 'fp16.loss_scale_windows: unknown key. Did you mean "loss_scale_window"?'),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}},
     'optimizer.params.weight_decy: unknown key. Did you mean "weight_decay"?'),
    ({"optimizer": {"type": "SGD", "params": {"momentun": 0.9}}},
     'optimizer.params.momentun: unknown parameter of SGD. Did you mean "momentum"?'),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}},
     'scheduler.params.warmup_num_step: unknown key. Did you mean "warmup_num_steps"?'),
    ({"optimizer": {"type": "AdamW", "param": {}}}, 'optimizer.param: unknown key. Did you mean "params"?'),
    ({"optimizer": {"type": "Adam", "adam_w_mode": True}},
     'optimizer.adam_w_mode: unknown key; adam_w_mode is a parameter of the optimizer: move it into "params".'),
])
def test_unknown_key_names_path_and_near_match(overrides: dict[str, Any], message: str) -> None:
    assert config_error(**overrides) == message


@pytest.mark.parametrize("key, target", [
    ("cpu_offload", "offload_optimizer.device"),
    ("cpu_offload_param", "offload_param.device"),
])
def test_deprecated_cpu_offload_keys_map_as_deepspeed_does(key: str, target: str) -> None:
    cfg = make_config(zero_optimization={key: True, "stage": 3})
    assert get_dotted(cfg.zero_optimization, target) == "cpu"
    assert any(n.startswith(f"zero_optimization.{key} is deprecated") for n in cfg.notes)
    off = make_config(zero_optimization={key: False, "stage": 3})
    assert get_dotted(off.zero_optimization, target) == "none"
    pinned = make_config(zero_optimization={"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True})
    assert pinned.zero_optimization.offload_optimizer.pin_memory is True
    clash = {key: True, "stage": 3, target.split(".")[0]: {"device": "cpu"}}
    assert config_error(zero_optimization=clash).startswith(f"zero_optimization.{key} and zero_optimization.{target}")
    assert config_error(zero_optimization={key: "yes"}).startswith(f'zero_optimization.{key}: got "yes", expected')


def test_cpu_offload_param_below_stage3_is_noted_like_offload_param() -> None:
    cfg = make_config(zero_optimization={"stage": 2, "cpu_offload_param": True})
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert any("no effect at stage 2: offload_param (stage 3)" in n for n in cfg.notes), cfg.notes


@pytest.mark.parametrize("flag, stage", [(True, 1), (False, 0)])
def test_boolean_zero_optimization_reads_as_deepspeed_does(flag: bool, stage: int) -> None:
    cfg = make_config(zero_optimization=flag)
    assert cfg.zero_optimization.stage == stage
    assert cfg.notes == (f'"zero_optimization": {str(flag).lower()} is DeepSpeed\'s old format, read as stage '
                         f'{stage}; write "zero_optimization": {{"stage": {stage}}}.',)


def test_stage3_keys_by_deepspeeds_short_names() -> None:
    """DeepSpeed's ZeRO model populates `param_persistence_threshold` & co. by their field names as
    well as by the stage3_ aliases; a ds_config may use either, not both."""
    cfg = make_config(zero_optimization={"stage": 3, "param_persistence_threshold": 0, "prefetch_bucket_size": 10,
                                         "gather_16bit_weights_on_model_save": True})
    zero = cfg.zero_optimization
    assert (zero.stage3_param_persistence_threshold, zero.stage3_prefetch_bucket_size) == (0, 10)
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    message = config_error(zero_optimization={"stage": 3, "max_live_parameters": 5, "stage3_max_live_parameters": 6})
    assert message.startswith("zero_optimization.max_live_parameters and zero_optimization.stage3_max_live_parameters "
                              "are two spellings of one key")


def test_legacy_aliases() -> None:
    raw = make_raw(bfloat16={"enabled": True},
                   zero_optimization={"stage3_gather_fp16_weights_on_model_save": False})
    cfg = load_config(raw, dp_world_size=1)
    assert cfg.bf16.enabled and cfg.precision == "bf16"
    both = {"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}
    with pytest.raises(ConfigError, match="bfloat16 and bf16 are two spellings of one key"):
        load_config({**BASE, **both}, dp_world_size=1)


# --- types and ranges -------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, pattern", [
    ({"zero_optimization__stage": 4}, r"^zero_optimization\.stage: got 4, expected one of 0, 1, 2, 3\."),
    ({"zero_optimization__stage": True}, r"zero_optimization\.stage: got true, expected one of"),
    ({"zero_optimization__reduce_bucket_size": -1},
     r"^zero_optimization\.reduce_bucket_size: got -1, expected an integer >= 0\. Default: 500000000\."),
    ({"zero_optimization__reduce_bucket_size": 2.5e3 + 0.5}, r"got 2500\.5, expected an integer"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
     r"optimizer\.params\.betas: got \[0\.9\], expected a pair of numbers, each >= 0\.0 and < 1\.0\."),
    ({"optimizer": {"type": "Adam", "params": {"betas": 0.9}}}, r"optimizer\.params\.betas: got 0\.9"),
    ({"optimizer": {"type": "Adam", "params": {"lr": -0.001}}},
     r"optimizer\.params\.lr: got -0\.001, expected a number >= 0\.0\. Default: 0\.001\."),
    ({"optimizer": {"type": "SGD", "params": {"lr": -1}}}, r"optimizer\.params\.lr: got -1, expected a number >= 0"),
    ({"optimizer": {"type": "SGD", "params": {"nesterov": "yes"}}}, r"nesterov: got \"yes\", expected true or false"),
    ({"fp16__enabled": True, "fp16__loss_scale_window": 0},
     r"^fp16\.loss_scale_window: got 0, expected an integer >= 1 while the loss scale is dynamic"),
    ({"fp16__enabled": "true"}, r'fp16\.enabled: got "true", expected true or false\.'),
    ({"train_micro_batch_size_per_gpu": True}, r"train_micro_batch_size_per_gpu: got true, expected an integer"),
    ({"train_micro_batch_size_per_gpu": 0}, r"train_micro_batch_size_per_gpu: got 0, expected an integer >= 1"),
    ({"data_types__grad_accum_dtype": "fp8"},
     r'data_types\.grad_accum_dtype: got "fp8", expected one of "fp32", "fp16", "bf16" or null'),
    ({"communication_data_type": "float16"}, r'communication_data_type: got "float16", expected one of'),
    ({"zero_optimization__offload_optimizer__device": "gpu"},
     r'offload_optimizer\.device: got "gpu", expected one of "none", "cpu", "nvme"\. Did you mean "cpu"\?'),
    ({"zero_optimization": [1, 2]}, r"zero_optimization: got \[1, 2\], expected an object"),
    ({"gradient_clipping": -1.0}, r"gradient_clipping: got -1\.0, expected a number >= 0\.0"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}},
     r'warmup_type: got "cubic", expected one of "log", "linear"'),
])
def test_type_and_range_errors_name_key_value_and_expectation(overrides: dict[str, Any], pattern: str) -> None:
    assert re.search(pattern, config_error(**overrides))


def test_fp16_and_bf16_are_exclusive() -> None:
    message = config_error(fp16={"enabled": True}, bf16={"enabled": True})
    assert message.startswith("fp16.enabled and bf16.enabled are both true; choose one")


def test_integral_floats_are_ints_and_case_insensitive_literals() -> None:
    cfg = make_config(zero_optimization={"reduce_bucket_size": 3e8},
                      communication_data_type="BF16", checkpoint={"tag_validation": "warn"})
    assert cfg.zero_optimization.reduce_bucket_size == 300_000_000
    assert type(cfg.zero_optimization.reduce_bucket_size) is int
    assert (cfg.communication_data_type, cfg.checkpoint.tag_validation) == ("bf16", "Warn")


def test_steps_per_print_infinity_means_never(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 4, "steps_per_print": Infinity}')
    assert load_config(path, dp_world_size=1).steps_per_print is None
    assert make_config(steps_per_print=2_000_000).steps_per_print == 2_000_000
    assert make_config(steps_per_print=float("inf")).steps_per_print is None


def test_nvme_optimizer_offload_loads_at_stages_1_to_3() -> None:
    for stage in (1, 2, 3):
        cfg = make_config(
            zero_optimization={"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}},
            aio={"block_size": 2097152, "queue_depth": 16, "intra_op_parallelism": 2})
        assert cfg.zero_optimization.offload_optimizer.device == "nvme" and cfg.aio.block_size == 2097152


def test_nvme_needs_a_path() -> None:
    with pytest.raises(ConfigError, match=r'offload_optimizer\.nvme_path: required when device is "nvme"'):
        make_config(zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme"}})


# --- optimizer and scheduler types ------------------------------------------------------------


def test_optimizer_types_are_case_insensitive_and_torch_classes_are_checked() -> None:
    assert make_config(optimizer={"type": "adamw", "params": {"lr": 3e-4}}).optimizer.type == "AdamW"
    sgd = make_config(optimizer={"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9}}).optimizer
    assert sgd.type == "SGD" and dict(sgd.params) == {"lr": 0.1, "momentum": 0.9}
    rms = make_config(optimizer={"type": "RMSprop", "params": {"alpha": 0.9}}).optimizer
    assert rms.type == "RMSprop"


def test_unknown_optimizer_and_scheduler_types() -> None:
    assert re.search(r'optimizer\.type: unknown optimizer "Adamw8bit"\. Did you mean "AdamW"\? Known: Adam, '
                     r"AdamW, Lamb, or a torch\.optim class: ASGD, ", config_error(optimizer={"type": "Adamw8bit"}))
    assert re.search(r'scheduler\.type: unknown scheduler "WarmupLRR"\. Did you mean "WarmupLR"',
                     config_error(scheduler={"type": "WarmupLRR"}))
    assert "optimizer.type: required" in config_error(optimizer={"params": {"lr": 1.0}})


def test_scheduler_required_params_and_torch_schedulers() -> None:
    assert re.search(r"scheduler\.params\.total_num_steps: required by WarmupDecayLR",
                     config_error(scheduler={"type": "WarmupDecayLR"}))
    step = make_config(scheduler={"type": "steplr", "params": {"step_size": 10, "gamma": 0.5}}).scheduler
    assert step.type == "StepLR" and dict(step.params) == {"step_size": 10, "gamma": 0.5}
    assert "step_size: required by StepLR" in config_error(scheduler={"type": "StepLR"})


# --- "auto" -----------------------------------------------------------------------------------


def test_auto_from_hidden_size() -> None:
    cfg = make_config(hidden_size=768, zero_optimization={"reduce_bucket_size": "auto"})
    assert cfg.zero_optimization.reduce_bucket_size == 768 * 768
    assert cfg.source_of("zero_optimization.reduce_bucket_size") == "auto (model hidden_size=768)"


def test_auto_stage3_sizes_from_hidden_size() -> None:
    cfg = make_config(hidden_size=1024, zero_optimization={
        "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto"})
    z = cfg.zero_optimization
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        1024 * 1024, int(0.9 * 1024 * 1024), 10 * 1024)


def test_auto_values_win_over_the_model_rule() -> None:
    cfg = make_config(hidden_size=768, auto_values={"zero_optimization.reduce_bucket_size": 1000},
                      zero_optimization={"reduce_bucket_size": "auto"})
    assert cfg.zero_optimization.reduce_bucket_size == 1000
    assert cfg.source_of("zero_optimization.reduce_bucket_size") == "auto (from initialize arguments)"


def test_auto_left_in_a_deepspeed_model_section_takes_the_default_with_a_note() -> None:
    """OpenRLHF's deepspeed_utils.py passes Transformers' "auto"s straight to deepspeed.initialize;
    DeepSpeed 0.19.8's config models drop "auto" and use the default (issue 39 item 2)."""
    keys = ["sub_group_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
            "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size", "reduce_bucket_size"]
    cfg = make_config(zero_optimization={"stage": 3, **dict.fromkeys(keys, "auto")})
    default = make_config(zero_optimization={"stage": 3}).zero_optimization
    for key in keys:
        assert getattr(cfg.zero_optimization, key) == getattr(default, key), key
        assert cfg.source_of(f"zero_optimization.{key}").startswith("auto (the default"), key
        assert sum(n.startswith(f'zero_optimization.{key}: "auto"') for n in cfg.notes) == 1, cfg.notes
    with_model = make_config(hidden_size=64, zero_optimization={"reduce_bucket_size": "auto"})
    assert with_model.zero_optimization.reduce_bucket_size == 64 * 64 and not with_model.notes


def test_keys_a_listed_client_writes_and_deepspeed_ignores_load_with_a_note() -> None:
    """LLaMA-Factory's examples/deepspeed/ds_z3_fp8_config.json (two versions: `comms_config` and
    `monitor_config`; an `fp8` section carrying fp16's loss-scaler keys) loads; a near miss of a
    real key is still refused."""
    cfg = make_config(comms_config={"verbose": False},
                      monitor_config={"enabled": True, "tag": "DeepSpeedMonitor", "csv_monitor": {"enabled": False}},
                      fp8={"enabled": True, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1})
    ignored = ["comms_config", "monitor_config", "fp8.loss_scale_window", "fp8.hysteresis", "fp8.min_loss_scale"]
    for key in ignored:
        assert sum(n.startswith(f"{key}: no effect") for n in cfg.notes) == 1, (key, cfg.notes)
    assert cfg.fp8.enabled
    near_miss = config_error(comms_loger={"enabled": True})
    assert near_miss.startswith('comms_loger: unknown key. Did you mean "comms_logger"')
    assert config_error(fp8={"loss_scale": 0}).startswith("fp8.loss_scale: unknown key")


def test_unresolvable_auto_says_how_to_resolve_it() -> None:
    assert config_error(gradient_clipping="auto").startswith(
        'gradient_clipping: is "auto" but initialize() supplied no value for it; set it to a maximum')
    assert "optimizer.params.lr" in config_error(optimizer={"type": "AdamW", "params": {"lr": "auto"}})


def test_auto_values_are_type_checked() -> None:
    message = config_error(gradient_clipping="auto", auto_values={"gradient_clipping": "big"})
    assert message.startswith('gradient_clipping: got "big", expected a number') and "supplied" in message


def test_auto_precision_flags_default_off() -> None:
    cfg = make_config(fp16={"enabled": "auto"}, bf16={"enabled": "auto"})
    assert cfg.precision == "fp32" and cfg.source_of("fp16.enabled").startswith("auto (off")
    cfg = make_config(fp16={"enabled": "auto"}, bf16={"enabled": "auto"}, auto_values={"bf16.enabled": True})
    assert cfg.precision == "bf16"


def test_auto_optimizer_and_scheduler_values() -> None:
    cfg = make_config(
        optimizer={"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        scheduler={"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "total_num_steps": 100}},
        gradient_clipping="auto",
        auto_values={"optimizer.params.lr": 1e-3, "optimizer.params.weight_decay": 0.01,
                     "gradient_clipping": 1.0, "unused.key": 5},
    )
    assert cfg.optimizer.params.lr == 1e-3 and cfg.optimizer.params.weight_decay == 0.01
    assert cfg.scheduler.params.warmup_max_lr == 1e-3 and cfg.scheduler.params.warmup_min_lr == 0.0
    assert cfg.gradient_clipping == 1.0
    assert cfg.source_of("scheduler.params.warmup_max_lr") == "auto (optimizer.params.lr)"


def test_warmup_max_lr_auto_from_client_optimizer_lr() -> None:
    cfg = make_config(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
                      auto_values={"optimizer.params.lr": 0.02})
    assert cfg.scheduler.params.warmup_max_lr == 0.02
    assert "warmup_max_lr" in config_error(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}})


# --- batch triad ------------------------------------------------------------------------------


@pytest.mark.parametrize("tbs, micro, gas, world, expected", [
    (32, None, None, 4, (32, 8, 1)),
    (None, 4, None, 2, (8, 4, 1)),
    (32, 4, None, 2, (32, 4, 4)),
    (32, None, 2, 2, (32, 8, 2)),
    (None, 4, 2, 2, (16, 4, 2)),
    (16, 4, 2, 2, (16, 4, 2)),
])
def test_batch_triad_rules(tbs: int | None, micro: int | None, gas: int | None, world: int,
                           expected: tuple[int, int, int]) -> None:
    got = solve_batch(tbs, micro, gas, world)
    assert (got.train_batch_size, got.train_micro_batch_size_per_gpu, got.gradient_accumulation_steps) == expected


def test_batch_triad_mismatch_message() -> None:
    message = config_error(world_size=2, train_batch_size=32, train_micro_batch_size_per_gpu=4,
                           gradient_accumulation_steps=2)
    assert message == (
        "train_batch_size: 32 != train_micro_batch_size_per_gpu (4) * gradient_accumulation_steps (2)\n"
        "  * data-parallel world size (2) = 16. Set it to 16, or set one of the three to \"auto\".")


def test_batch_triad_not_divisible_and_missing() -> None:
    assert config_error(world_size=2, train_batch_size=30, train_micro_batch_size_per_gpu=4).startswith(
        "train_batch_size: 30 is not divisible by train_micro_batch_size_per_gpu (4) * data-parallel world "
        "size (2) = 8, so gradient_accumulation_steps cannot be derived. Set train_batch_size to a "
        "multiple of 8 (e.g. 24 or 32)")
    assert "are both missing" in config_error(train_micro_batch_size_per_gpu=ABSENT)
    assert "are both missing" in config_error(train_micro_batch_size_per_gpu=ABSENT, gradient_accumulation_steps=4)


def test_batch_auto_is_derived_or_taken_from_initialize() -> None:
    cfg = make_config(world_size=2, train_batch_size="auto", train_micro_batch_size_per_gpu=4,
                      gradient_accumulation_steps=3)
    assert cfg.train_batch_size == 24 and cfg.source_of("train_batch_size") == "derived (batch triad)"
    cfg = make_config(train_batch_size="auto", train_micro_batch_size_per_gpu="auto",
                      auto_values={"train_micro_batch_size_per_gpu": 8})
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 1)
    assert cfg.source_of("train_micro_batch_size_per_gpu") == "auto (from initialize arguments)"


# --- stage applicability and not-supported ----------------------------------------------------


@pytest.mark.parametrize("zero, message", [
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}},
     "zero_optimization.offload_optimizer applies to stages 1, 2 and 3; you chose stage 0. "
     "Remove it or set stage to 1, 2 or 3."),
    ({"stage": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}},
     "zero_optimization.offload_optimizer applies to stages 1, 2 and 3; you chose stage 0. "
     "Remove it or set stage to 1, 2 or 3."),
    ({"stage": 0, "zero_quantized_weights": True}, "zero_optimization.zero_quantized_weights = true applies to "
     "stage 3 only; you chose stage 0. Remove it or set stage to 3."),
])
def test_stage_inapplicable_keys(zero: dict[str, Any], message: str) -> None:
    assert config_error(zero_optimization=zero) == message


@pytest.mark.parametrize("zero, idle", [
    ({"stage": 1, "stage3_max_live_parameters": 3e7, "sub_group_size": 1e8},
     "sub_group_size (stage 3), stage3_max_live_parameters (stage 3)"),
    ({"stage": 0, "allgather_bucket_size": 2e8}, "allgather_bucket_size (stage 1/2)"),
    ({"stage": 3, "reduce_scatter": False, "allgather_bucket_size": 2e8},
     "reduce_scatter (stage 1/2), allgather_bucket_size (stage 1/2)"),
    ({"stage": 2, "stage3_model_persistence_threshold": 10, "stage3_allgather_sequential": True},
     "stage3_model_persistence_threshold (stage 3), stage3_allgather_sequential (stage 3)"),
    # DeepSpeed-Chat's --offload writes offload_param at every stage; DeepSpeed ignores it below 3.
    ({"stage": 2, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
     "offload_param (stage 3)"),
    ({"stage": 1, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}, "offload_param (stage 3)"),
])
def test_tuning_keys_of_another_stage_give_one_note(zero: dict[str, Any], idle: str) -> None:
    """One template reused across stages loads (DeepSpeed ignores these keys there) with one note;
    a refused stage-3 knob is not refused at a stage where it has no effect anyway."""
    cfg = make_config(zero_optimization=zero)
    assert cfg.notes == (f"zero_optimization: set for another ZeRO stage, no effect at stage {zero['stage']}: "
                         f"{idle}. Accepted so one config serves every stage.",)
    assert make_config(zero_optimization={"stage": 3, "sub_group_size": 1e8}).notes == ()


def test_stage0_accepts_its_keys_and_common_defaults() -> None:
    cfg = make_config(zero_optimization={
        "stage": 0, "overlap_comm": True, "contiguous_gradients": False, "reduce_bucket_size": 1e6,
        "offload_param": {"device": "none", "pin_memory": True}, "stage3_max_live_parameters": 1e9,
        "allgather_bucket_size": 5e8})
    assert cfg.zero_optimization.reduce_bucket_size == 1_000_000 and cfg.zero_optimization.overlap_comm


@pytest.mark.parametrize("overrides, message", [
    ({"comet": {"enabled": True}}, 'not supported yet: comet={"enabled": true}.'),
    ({"aio__use_gds": True}, "not supported yet: aio.use_gds=true. GPUDirect Storage is not built"),
    ({"checkpoint__parallel_write": {"pipeline_stage": True}},
     "not supported yet: checkpoint.parallel_write.pipeline_stage=true."),
    ({"zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": True}},
     "not supported yet: zero_optimization.stage3_use_all_reduce_for_fetch_params=true."),
    ({"compile": {"deepcompile": True}}, "not supported yet: compile.deepcompile=true."),
    ({"tensor_parallel": {"autotp_size": 2, "preset_model": "bloom"}},
     'not supported yet: tensor_parallel.preset_model="bloom".'),
    ({"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}},
     "not supported yet: tensor_parallel.vocab_parallel_lm_head=true."),
    ({"log_level": "info"}, 'not supported yet: log_level="info".'),
    ({"flops_profiler": {"enabled": True}}, 'not supported yet: flops_profiler={"enabled": true}.'),
    ({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}},
     'not supported yet: optimizer.type="Lion".'),
    ({"optimizer": {"type": "OneBitAdam", "params": {"cuda_aware": True}}},
     "not supported yet: optimizer.params.cuda_aware=true."),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}},
     "not supported yet: optimizer.params.bias_correction=false."),
])
def test_not_supported_yet(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(NotSupportedError) as info:
        make_config(**overrides)
    assert str(info.value).startswith(message)


def test_not_supported_sections_load_at_their_defaults() -> None:
    cfg = make_config(
        aio={"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True},
        activation_checkpointing={"partition_activations": False, "cpu_checkpointing": False},
        wandb={"enabled": False, "project": "mine"}, flops_profiler={"enabled": False}, amp=None,
        fp16={"enabled": True, "auto_cast": False}, checkpoint={"tag_validation": "Warn"})
    assert cfg.precision == "fp16" and cfg.fp16.dynamic_loss_scale and cfg.fp16.initial_loss_scale == 65536.0


def test_stage_checks_run_before_not_supported() -> None:
    with pytest.raises(ConfigError) as info:
        make_config(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}})
    assert not isinstance(info.value, NotSupportedError)


def test_offload_param_below_stage3_has_no_effect_on_the_estimate() -> None:
    from zeroshard.estimate.states import Setup

    cfg = make_config(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}})
    assert Setup.from_config(cfg).offload_param == "none"


# --- dotted top-level keys (TRL's reference-model config) -------------------------------------


def test_dotted_top_level_keys_read_as_the_keys_they_name() -> None:
    """TRL's prepare_deepspeed adds these at the top level; DeepSpeed drops them, zeroshard reads them."""
    h = 64
    cfg = make_config(**{
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 500},
        "zero_optimization.reduce_bucket_size": h * h,
        "zero_optimization.stage3_param_persistence_threshold": 10 * h,
        "zero_optimization.stage3_prefetch_bucket_size": 0.9 * h * h,  # 3686.4: truncated, as Accelerate's int()
    })
    zero = cfg.zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_param_persistence_threshold, zero.stage3_prefetch_bucket_size) == (
        4096, 640, 3686)
    source = cfg.source_of("zero_optimization.reduce_bucket_size")
    assert source == "file (top-level 'zero_optimization.reduce_bucket_size')"
    (note,) = cfg.notes
    assert note == ("dotted top-level keys read as the keys they name (DeepSpeed ignores them): "
                    "zero_optimization.reduce_bucket_size = 4096, over 500 in the section; "
                    "zero_optimization.stage3_param_persistence_threshold = 640; "
                    "zero_optimization.stage3_prefetch_bucket_size = 3686 (from 3686.4). "
                    "Write them inside their sections.")
    alias = make_config(**{"zero_optimization": {"stage": 3}, "zero_optimization.prefetch_bucket_size": 7})
    assert alias.zero_optimization.stage3_prefetch_bucket_size == 7
    section = make_config(**{"zero_optimization": {"stage": 3}, "zero_optimization.offload_param": {"device": "cpu"}})
    assert section.zero_optimization.offload_param.device == "cpu"


@pytest.mark.parametrize("overrides, message", [
    ({"zero_optimization.reduce_bucket_sise": 5},
     'zero_optimization.reduce_bucket_sise: unknown key. Did you mean "reduce_bucket_size"?'),
    ({"zero_optimisation.stage": 2}, 'zero_optimisation.stage: unknown key. Did you mean "zero_optimization"?'),
    ({"optimizer.params.lr": 1e-3}, 'optimizer.params.lr: unknown key. Did you mean "optimizer"?'),
    ({"zero_optimization.stage.x": 1}, "zero_optimization.stage.x: unknown key; zero_optimization.stage takes a "
                                       "value, not keys."),
    ({"zero_optimization.reduce_bucket_size": "big"},
     'zero_optimization.reduce_bucket_size: got "big", expected an integer >= 0. Default: 500000000.'),
])
def test_dotted_top_level_keys_that_name_no_key_are_refused(overrides: dict[str, Any], message: str) -> None:
    assert config_error(**overrides) == message


# --- provenance, describe, files --------------------------------------------------------------


def test_describe_marks_non_defaults_with_their_source() -> None:
    cfg = make_config(world_size=2, hidden_size=768, train_batch_size=8, gradient_clipping="auto",
                      auto_values={"gradient_clipping": 1.0}, zero_optimization={"reduce_bucket_size": "auto"})
    text = cfg.describe()
    assert re.search(r"\n  reduce_bucket_size = 589824 +# auto \(model hidden_size=768\)\n", text)
    assert re.search(r"\ngradient_accumulation_steps = 2 +# derived \(batch triad\)\n", text)
    assert re.search(r"\ngradient_clipping = 1\.0 +# auto \(from initialize arguments\)\n", text)
    assert re.search(r"\ntrain_batch_size = 8 +# file\n", text)
    assert re.search(r"\n  loss_scale_window = 1000\n", text)
    short = cfg.describe(non_default_only=True)
    assert "loss_scale_window" not in short and "fp16:" not in short and "reduce_bucket_size" in short
    assert cfg.source_of("fp16.hysteresis") == "default"


def test_load_from_file_and_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 4, "bf16": {"enabled": True}}))
    assert load_config(str(path), dp_world_size=2).precision == "bf16"
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.json", dp_world_size=1)
    path.write_text('{"train_batch_size": 4,\n "fp16": {"enabled": true}\n "bf16": {]}')
    with pytest.raises(ConfigError, match=r"ds_config\.json:3:2: invalid JSON \(and not valid hjson either\)"):
        load_config(path, dp_world_size=1)
    with pytest.raises(ConfigError, match="dp_world_size: got 0"):
        load_config({"train_batch_size": 4}, dp_world_size=0)
