"""The `torch_autocast` section and the bf16 master-weights keys, as the config reads them."""

from __future__ import annotations

import pytest

from zeroshard.config import load_config
from zeroshard.errors import ConfigError, NotSupportedError


def _load(**extra: object) -> object:
    return load_config({"train_batch_size": 2, **extra}, dp_world_size=1)


@pytest.mark.parametrize("spelling,precision", [
    ("torch.bfloat16", "bf16"), ("bfloat16", "bf16"), ("bf16", "bf16"),
    ("torch.float16", "fp16"), ("float16", "fp16"), ("fp16", "fp16"), ("half", "fp16"), (None, None),
])
def test_deepspeed_dtype_spellings(spelling: str | None, precision: str | None) -> None:
    cfg = _load(torch_autocast={"enabled": True, "dtype": spelling})
    assert cfg.torch_autocast.enabled and cfg.torch_autocast.precision == precision
    assert cfg.precision == "fp32", "autocast keeps the parameters in the training dtype"


def test_defaults_and_modules() -> None:
    assert not _load().torch_autocast.enabled
    cfg = _load(torch_autocast={"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linear"]})
    assert cfg.torch_autocast.lower_precision_safe_modules == ("torch.nn.Linear",)


@pytest.mark.parametrize("section,match", [
    ({"enabled": True, "dtype": "float32"}, "torch_autocast.dtype"),
    ({"enabled": True, "dtype": "int8"}, "torch_autocast.dtype"),
    ({"enabeld": True}, 'Did you mean "enabled"'),
    ({"enabled": True, "lower_precision_safe_modules": "torch.nn.Linear"}, "lower_precision_safe_modules"),
])
def test_bad_values_name_the_key(section: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _load(torch_autocast=section)


_MASTER = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("offload", [None, "cpu"])
def test_bf16_masters_accepted_where_deepspeed_accepts_them(stage: int, offload: str | None) -> None:
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": offload}
    cfg = _load(bf16=_MASTER, zero_optimization=zero)
    assert cfg.bf16.bf16_master_weights_and_grads and cfg.bf16.bf16_optimizer_states


@pytest.mark.parametrize("bf16,zero,error,match", [
    # DeepSpeed 0.19.8 runtime/config.py: both need ZeRO stage 1-3; states need master weights.
    (_MASTER, {"stage": 0}, ConfigError, r"bf16.bf16_master_weights_and_grads: needs zero_optimization.stage 1"),
    ({"enabled": True, "bf16_optimizer_states": True}, {"stage": 0}, ConfigError, "bf16.bf16_optimizer_states"),
    ({"enabled": True, "bf16_optimizer_states": True}, {"stage": 2}, ConfigError,
     "needs bf16.bf16_master_weights_and_grads true"),
    # base_optimizer._configure_master_weights: fp32 states beside bf16 masters need CPU offload + CPU Adam.
    ({"enabled": True, "bf16_master_weights_and_grads": True}, {"stage": 2}, ConfigError,
     "needs offload_optimizer to the CPU"),
    ({"enabled": True, "bf16_master_weights_and_grads": True},
     {"stage": 2, "offload_optimizer": {"device": "cpu"}}, NotSupportedError, "fp32_optimizer_states"),
])
def test_bf16_masters_refused_where_deepspeed_refuses(bf16: dict, zero: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _load(bf16=bf16, zero_optimization=zero)


def test_bf16_masters_refuse_other_grad_accum_dtype() -> None:
    with pytest.raises(ConfigError, match="data_types.grad_accum_dtype"):
        _load(bf16=_MASTER, zero_optimization={"stage": 1}, data_types={"grad_accum_dtype": "fp32"})
