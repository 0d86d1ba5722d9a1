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


@pytest.mark.parametrize(("given", "stored"), [("auto", None), (None, None), ([], ()), (["a*b", "c"], ("a*b", "c"))])
def test_keep_in_fp32_modules_takes_auto_or_a_list_of_patterns(given: Any, stored: Any) -> None:
    c = load_config(cfg(data_types={"keep_in_fp32_modules": given}), dp_world_size=1)
    assert c.data_types.keep_in_fp32_modules == stored


@pytest.mark.parametrize("given", ["router", 3, [1]])
def test_keep_in_fp32_modules_refuses_other_values(given: Any) -> None:
    with pytest.raises(ConfigError, match=r"^data_types.keep_in_fp32_modules: got .*expected a list of strings"):
        load_config(cfg(data_types={"keep_in_fp32_modules": given}), dp_world_size=1)


def test_keep_fp32_pattern_reads_each_submodules_lists_under_its_path() -> None:
    import torch
    from torch import nn

    from zeroshard.runtime.keep_fp32 import fp32_buffers, keep_fp32_pattern

    class Inner(nn.Module):
        _keep_in_fp32_modules_strict = ["bias*"]
        _keep_in_fp32_modules = ["norm"]

        def __init__(self) -> None:
            super().__init__()
            for name in ("bias_a", "norm", "other"):
                self.register_buffer(name, torch.zeros(2))

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = Inner()
            self.register_buffer("bias_top", torch.zeros(2))  # outside the submodule: not its name
            self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))

    model = Outer()

    def kept(setting: Any, dtype: torch.dtype | None) -> set[str]:
        return set(fp32_buffers(model, keep_fp32_pattern(model, setting, dtype)).values())

    assert kept(None, torch.bfloat16) == {"layer.bias_a"}
    assert kept(None, torch.float16) == {"layer.bias_a", "layer.norm"}
    assert kept(None, None) == set()                          # fp32 training keeps nothing special
    assert kept(("bias*",), torch.bfloat16) == {"layer.bias_a", "bias_top"}
    assert kept(("*",), torch.bfloat16) == {"layer.bias_a", "layer.norm", "layer.other", "bias_top"}  # not int
    assert kept((), torch.float16) == set()
