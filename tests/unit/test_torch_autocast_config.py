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


@pytest.mark.parametrize("key", ["bf16_master_weights_and_grads", "bf16_optimizer_states"])
def test_bf16_low_precision_masters_are_refused_by_name(key: str) -> None:
    with pytest.raises(NotSupportedError, match=f"bf16.{key}"):
        _load(bf16={"enabled": True, key: True}, zero_optimization={"stage": 3})
