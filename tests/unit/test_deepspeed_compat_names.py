"""The DeepSpeed names DeepSpeed's own unit tests import (issue 24): served by the `deepspeed`
alias, with DeepSpeed 0.19.8's signatures (checked against the installed DeepSpeed where there is
one); DeepSpeed's config classes as pydantic models over zeroshard's reader; the internals zeroshard
does not have importable and refused by name when used."""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from signatures import assert_same_signature

from zeroshard.errors import ConfigError

pydantic = pytest.importorskip("pydantic")

# (alias module, name) pairs that must import under ZEROSHARD_AS_DEEPSPEED=1.
SERVED = [
    ("deepspeed", "get_accelerator"),
    ("deepspeed.compression.helper", "recursive_getattr"),
    ("deepspeed.compression.helper", "recursive_setattr"),
    ("deepspeed.utils.module_utils", "recursive_getattr"),
    ("deepspeed.utils.module_utils", "recursive_setattr"),
    ("deepspeed.accelerator", "is_current_accelerator_supported"),
    ("deepspeed.git_version_info", "torch_info"),
    ("deepspeed.moe.layer", "MoE"),
    ("deepspeed.moe.utils", "split_params_into_different_moe_groups_for_optimizer"),
    ("deepspeed.utils.groups", "_get_expert_parallel_group"),
    ("deepspeed.utils.groups", "_get_expert_data_parallel_world_size"),
    ("deepspeed.utils.torch", "required_torch_version"),
    ("deepspeed.utils", "set_z3_leaf_modules_by_name"),
    ("deepspeed.utils", "set_z3_leaf_modules_by_suffix"),
    ("deepspeed.utils", "set_log_level_from_string"),
    ("deepspeed.utils.zero_to_fp32", "get_optim_files"),
    ("deepspeed.checkpoint.utils", "get_model_ckpt_name_for_rank"),
    ("deepspeed.runtime.config", "DeepSpeedConfig"),
    ("deepspeed.runtime.config", "get_gradient_clipping"),
    ("deepspeed.runtime.config", "ADAM_OPTIMIZER"),
    ("deepspeed.runtime.config_utils", "DeepSpeedConfigModel"),
    ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    ("deepspeed.runtime.precision_config", "get_bfloat16_config"),
    ("deepspeed.runtime.constants", "GRADIENT_CLIPPING_DEFAULT"),
    ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    ("deepspeed.runtime.zero.config", "DeepSpeedZeroOffloadParamConfig"),
    ("deepspeed.runtime.zero.offload_config", "OffloadDeviceEnum"),
    ("deepspeed.runtime.zero.utils", "ZeRORuntimeException"),
    ("deepspeed.runtime.zero", "ZeroParamStatus"),
    ("deepspeed.runtime.zero", "unwrap_model_for_generation"),
    ("deepspeed.runtime.zero.partition_parameters", "ZeroParamStatus"),
    ("deepspeed.runtime.lr_schedules", "LR_RANGE_TEST_MIN_LR"),
    ("deepspeed.runtime.lr_schedules", "CYCLE_MIN_MOM"),
    ("deepspeed.runtime.lr_schedules", "TOTAL_NUM_STEPS"),
    ("deepspeed.ops", "__compatible_ops__"),
    ("deepspeed.runtime.zero.leaf_module_config", "DEFAULT_LEAF_MODULE_CLASSES"),
    ("deepspeed.runtime.zero.leaf_module_config", "DEFAULT_LEAF_MODULE_NAMES"),
]
# Internals importable by name only: building / calling them raises NotSupportedError naming them.
REFUSED = [
    ("deepspeed.ops.op_builder", "CPUAdamBuilder"),
    ("deepspeed.ops.op_builder", "FusedAdamBuilder"),
    ("deepspeed.ops.op_builder", "FusedLambBuilder"),
    ("deepspeed.ops.op_builder", "OpBuilder"),
    ("deepspeed.ops.aio", "AsyncIOBuilder"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
    ("deepspeed.runtime.fp16.fused_optimizer", "FP16_Optimizer"),
    ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer"),
    ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer"),
    ("deepspeed.runtime.base_optimizer", "ZeROOptimizer"),
    ("deepspeed.runtime.zero.partition_parameters", "InsertPostInitMethodToModuleSubClasses"),
    ("deepspeed.runtime.zero.partition_parameters", "MultipleAllGatherHandles"),
    ("deepspeed.runtime.zero.parameter_offload", "ZeROOrderedDict"),
    ("deepspeed.runtime.zero.parameter_offload", "ensure_zero_ordered_dict"),
]

ALIAS_PROBE = """
import importlib, json, sys
served, refused = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {"missing": [], "refusals": {}}
for mod, name in served + refused:
    try:
        getattr(importlib.import_module(mod), name)
    except Exception as e:
        out["missing"].append(f"{mod}.{name}: {type(e).__name__}: {e}")
for mod, name in refused:
    try:
        getattr(importlib.import_module(mod), name)()
        out["refusals"][name] = "not refused"
    except Exception as e:
        out["refusals"][name] = f"{type(e).__name__}: {e}"
import deepspeed
from deepspeed.ops.op_builder import CPUAdamBuilder
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from zeroshard.errors import ZeroshardError
out["file"] = deepspeed.__file__
out["cpu_adam"] = deepspeed.ops.__compatible_ops__[CPUAdamBuilder.NAME]
out["zre"] = ZeRORuntimeException is ZeroshardError
from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
out["leaf"] = DEFAULT_LEAF_MODULE_CLASSES
from deepspeed import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
import zeroshard.ops.adam
out["accelerator"] = get_accelerator() is deepspeed.accelerator.get_accelerator()
out["ops"] = (DeepSpeedCPUAdam, FusedAdam) == (zeroshard.ops.adam.DeepSpeedCPUAdam, zeroshard.ops.adam.FusedAdam)
print("PROBE" + json.dumps(out))
"""


def test_alias_serves_the_names_and_refuses_the_internals_by_name() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    env.update(ZEROSHARD_AS_DEEPSPEED="1", ZEROSHARD_ALIAS_QUIET="1", DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-c", ALIAS_PROBE, json.dumps(SERVED), json.dumps(REFUSED)], env=env,
                          text=True, capture_output=True, timeout=180, cwd="/")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PROBE"))[5:])
    assert "compat/alias" in out["file"], out["file"]
    assert out["missing"] == []
    for mod, name in REFUSED:
        got = out["refusals"][name]
        assert got.startswith("NotSupportedError:") and name in got, f"{mod}.{name}: {got}"
    assert out["cpu_adam"] is True and out["zre"] is True
    assert out["accelerator"] is True and out["ops"] is True  # one object each, ported or through the alias
    from zeroshard.zero.leaf import DEFAULT_LEAF_CLASSES

    assert out["leaf"] == list(DEFAULT_LEAF_CLASSES)


# -- config classes: pydantic models over zeroshard's section reader ---------------------------


def test_zero_config_model_reads_through_zeroshard() -> None:
    from zeroshard.compat.ds_config import (
        DeepSpeedZeroConfig,
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    assert isinstance(DeepSpeedZeroConfig(), pydantic.BaseModel)
    plain = DeepSpeedZeroConfig()
    assert plain.offload_param is None and plain.offload_optimizer is None  # DeepSpeed's Optional sections
    assert (plain.overlap_comm, DeepSpeedZeroConfig(stage=3).overlap_comm) == (False, True)
    assert DeepSpeedZeroConfig(stage3_prefetch_bucket_size=12345).prefetch_bucket_size == 12345
    assert DeepSpeedZeroConfig(stage3_gather_fp16_weights_on_model_save=True).gather_16bit_weights_on_model_save
    legacy = DeepSpeedZeroConfig(cpu_offload_param=True)
    assert isinstance(legacy.offload_param, DeepSpeedZeroOffloadParamConfig) and legacy.offload_param.device == "cpu"
    assert isinstance(DeepSpeedZeroConfig(offload_optimizer={}).offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_write=True).pipeline is True
    assert DeepSpeedZeroConfig(stage=2).zeroshard().stage == 2
    with pytest.raises(pydantic.ValidationError, match=r"zero_optimization\.stage: got 7"):
        DeepSpeedZeroConfig(stage=7)
    with pytest.raises(pydantic.ValidationError, match="overlap_comms"):
        DeepSpeedZeroConfig(overlap_comms=True)  # zeroshard's unknown-key error (with the near match)


def test_precision_models_and_helpers() -> None:
    from zeroshard.compat.ds_config import DeepSpeedFP16Config, get_bfloat16_config, get_gradient_clipping

    assert DeepSpeedFP16Config(enabled=True, loss_scale=0, loss_scale_window=10).loss_scale_window == 10
    for bad in (-1, float("nan"), True):
        with pytest.raises(pydantic.ValidationError, match="fp16.loss_scale"):
            DeepSpeedFP16Config(loss_scale=bad)
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled is True
    assert get_bfloat16_config({}).enabled is False
    assert get_gradient_clipping({}) == 1.0 and get_gradient_clipping({"gradient_clipping": 0.5}) == 0.5


@pytest.mark.parametrize("field, bad, message", [
    ("min_loss_scale", 0, r"fp16\.min_loss_scale: got 0\.0, expected a number > 0"),
    ("loss_scale_window", 0, r"fp16\.loss_scale_window: got 0, expected an integer >= 1 while the loss scale"),
])
def test_dynamic_scale_fields_are_checked_only_where_the_scale_is_dynamic(field: str, bad: int, message: str) -> None:
    """As DeepSpeed: unused with a static scale or fp16 off (any number), checked when dynamic,
    also when the fp16 section is read alone (DeepSpeedFP16Config)."""
    from zeroshard.compat.ds_config import DeepSpeedFP16Config
    from zeroshard.config import load_config
    from zeroshard.errors import ConfigError

    for fp16 in ({"enabled": True, "loss_scale": 128, field: -1}, {"enabled": False, field: 0}):
        assert getattr(load_config({"train_batch_size": 1, "fp16": fp16}, dp_world_size=1).fp16, field) == fp16[field]
        assert getattr(DeepSpeedFP16Config(**fp16), field) == fp16[field]
    with pytest.raises(ConfigError, match="^" + message):
        load_config({"train_batch_size": 1, "fp16": {"enabled": True, field: bad}}, dp_world_size=1)
    with pytest.raises(pydantic.ValidationError, match=message):
        DeepSpeedFP16Config(enabled=True, loss_scale=0, **{field: bad})


def test_config_model_base_moves_deprecated_fields() -> None:
    from pydantic import Field

    from zeroshard.compat.ds_config import DeepSpeedConfigModel

    class Conf(DeepSpeedConfigModel):
        new: list[str] | None = None
        old: str | None = Field(None, json_schema_extra={"deprecated": True, "new_param": "new",
                                                         "new_param_fn": lambda v: [v]})
        aliased: int = Field(0, alias="aliased_old")

    assert Conf(old="x").new == ["x"]
    assert Conf(aliased_old=3).aliased == 3 and Conf(aliased=4).aliased == 4
    assert Conf(aliased="auto").aliased == 0  # DeepSpeed drops "auto" unless strict
    with pytest.raises(AssertionError, match="give only new"):
        Conf(old="x", new=["y"])
    with pytest.raises(pydantic.ValidationError):
        Conf(typo=1)


def test_deepspeed_config_over_zeroshard_config(tmp_path: Path) -> None:
    from zeroshard.compat.ds_config import DeepSpeedConfig, DeepSpeedZeroConfig

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 64, "zero_optimization": {"stage": 2},
                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    cfg = DeepSpeedConfig(str(path))
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 64, 1)
    assert isinstance(cfg.zero_config, DeepSpeedZeroConfig) and cfg.zero_optimization_stage == 2 and cfg.zero_enabled
    assert (cfg.optimizer_name, cfg.optimizer_params["lr"], cfg.gradient_allreduce_op) == ("adamw", 1e-3, "mean")
    assert cfg._param_dict["zero_optimization"] == {"stage": 2}
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = 32, None, 2
    cfg._configure_train_batch_size()
    assert cfg.train_micro_batch_size_per_gpu == 16
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = 33, 17, 2
    with pytest.raises(AssertionError):
        cfg._configure_train_batch_size()
    with pytest.raises(ConfigError):
        DeepSpeedConfig({"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lrr": 1}}})
    with pytest.raises(AttributeError, match="no attribute 'not_a_key'"):
        _ = cfg.not_a_key


# -- small helpers ------------------------------------------------------------------------------


def test_get_optim_files_in_rank_order(tmp_path: Path) -> None:
    from zeroshard.compat.ds_utils import get_model_ckpt_name_for_rank, get_optim_files

    for r in (10, 2, 1, 0):
        (tmp_path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_text("x")
    (tmp_path / "mp_rank_00_model_states.pt").write_text("x")
    assert [Path(p).name.split("_")[3] for p in get_optim_files(tmp_path)] == ["0", "1", "2", "10"]
    with pytest.raises(FileNotFoundError, match="no \\*_optim_states.pt file"):
        get_optim_files(tmp_path / "missing")
    assert get_model_ckpt_name_for_rank(str(tmp_path), "00") == str(tmp_path / "mp_rank_00_model_states.pt")


def test_version_log_level_and_accelerator_helpers() -> None:
    import torch

    from zeroshard.compat.ds_utils import (
        is_current_accelerator_supported,
        required_torch_version,
        set_log_level_from_string,
        torch_info,
    )

    major_minor = ".".join(torch.__version__.split(".")[:2])
    assert required_torch_version(min_version=major_minor) and not required_torch_version(max_version="1.0")
    with pytest.raises(ValueError, match="give min_version"):
        required_torch_version()
    assert torch_info()["version"] == major_minor
    log = logging.getLogger("zeroshard-test-level")
    log.addHandler(logging.NullHandler())
    set_log_level_from_string("error", custom_logger=log)
    assert log.level == logging.ERROR and log.handlers[0].level == logging.ERROR
    with pytest.raises(ValueError, match="expected one of debug"):
        set_log_level_from_string("loud", custom_logger=log)
    assert is_current_accelerator_supported() is True


def test_refused_class_is_never_built_and_never_matches() -> None:
    from zeroshard.compat.refused import refused_class
    from zeroshard.errors import NotSupportedError

    cls = refused_class("deepspeed.x.Thing", "use y", NAME="thing")
    assert cls.__name__ == "Thing" and cls.__module__ == "deepspeed.x" and cls.NAME == "thing"
    assert not isinstance(object(), cls)
    with pytest.raises(NotSupportedError, match=r"^deepspeed\.x\.Thing: .*use y"):
        cls()
    with pytest.raises(NotSupportedError, match="deepspeed.x.Thing"):
        type("Sub", (cls,), {})


# -- signatures against the installed DeepSpeed -------------------------------------------------

SIGNATURES = [
    ("zeroshard.compat.ds_utils:get_optim_files", "deepspeed.utils.zero_to_fp32:get_optim_files"),
    ("zeroshard.compat.ds_utils:get_model_ckpt_name_for_rank",
     "deepspeed.checkpoint.utils:get_model_ckpt_name_for_rank"),
    ("zeroshard.compat.ds_utils:required_torch_version", "deepspeed.utils.torch:required_torch_version"),
    ("zeroshard.compat.ds_utils:set_log_level_from_string", "deepspeed.utils:set_log_level_from_string"),
    ("zeroshard.compat.ds_utils:is_current_accelerator_supported",
     "deepspeed.accelerator:is_current_accelerator_supported"),
    ("zeroshard.compat.ds_utils:unwrap_model_for_generation", "deepspeed.runtime.zero:unwrap_model_for_generation"),
    ("zeroshard.utils:set_z3_leaf_modules_by_name", "deepspeed.utils:set_z3_leaf_modules_by_name"),
    ("zeroshard.utils:set_z3_leaf_modules_by_suffix", "deepspeed.utils:set_z3_leaf_modules_by_suffix"),
    ("zeroshard.compat.ds_config:get_gradient_clipping", "deepspeed.runtime.config:get_gradient_clipping"),
    ("zeroshard.compat.ds_config:get_bfloat16_config", "deepspeed.runtime.precision_config:get_bfloat16_config"),
    ("zeroshard.compat.ds_config:DeepSpeedConfig.__init__", "deepspeed.runtime.config:DeepSpeedConfig.__init__"),
]


@pytest.mark.parametrize(("ours", "theirs"), SIGNATURES, ids=[s[0].rpartition(":")[2] for s in SIGNATURES])
def test_signature_matches_deepspeed(ours: str, theirs: str) -> None:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    assert_same_signature(ours, theirs)
