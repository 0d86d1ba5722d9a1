"""`data_types.param_dtype` / `buffer_dtype` (DeepSpeed 0.19) at config load: param_dtype may only
agree with the precision fp16/bf16 `enabled` select (DeepSpeed asserts the same, so the error is
also an AssertionError); buffer_dtype takes DeepSpeed's dtype names."""

from __future__ import annotations

from typing import Any

import pytest

from zeroshard.config import load_config
from zeroshard.errors import ConfigConflictError, ConfigError


def cfg(**extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, **extra}


@pytest.mark.parametrize(("stated", "precision"), [("bf16", {"bf16": {"enabled": True}}),
                                                   ("fp16", {"fp16": {"enabled": True}}), ("fp32", {})])
def test_param_dtype_that_agrees_is_accepted(stated: str, precision: dict[str, Any]) -> None:
    c = load_config(cfg(data_types={"param_dtype": stated}, **precision), dp_world_size=1)
    assert c.data_types.param_dtype == stated == c.precision


@pytest.mark.parametrize(("stated", "precision"), [("fp16", {"bf16": {"enabled": True}}),
                                                   ("fp32", {"bf16": {"enabled": True}}),
                                                   ("bf16", {"fp16": {"enabled": True}}), ("bf16", {})])
def test_param_dtype_that_disagrees_is_refused(stated: str, precision: dict[str, Any]) -> None:
    with pytest.raises(ConfigConflictError, match=rf"^data_types.param_dtype='{stated}' conflicts") as err:
        load_config(cfg(data_types={"param_dtype": stated}, **precision), dp_world_size=1)
    assert isinstance(err.value, AssertionError) and isinstance(err.value, ConfigError)


def test_buffer_dtype_defaults_to_none_and_takes_dtype_names() -> None:
    assert load_config(cfg(), dp_world_size=1).data_types.buffer_dtype is None
    assert load_config(cfg(data_types={"buffer_dtype": "bf16"}), dp_world_size=1).data_types.buffer_dtype == "bf16"
    with pytest.raises(ConfigError, match="data_types.buffer_dtype"):
        load_config(cfg(data_types={"buffer_dtype": "int8"}), dp_world_size=1)
