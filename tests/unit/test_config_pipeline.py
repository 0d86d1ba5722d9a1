"""config/pipeline.py: what a PipelineModule's config is refused for, once at initialize, by name;
and the accumulation dtype decided once in config/ for the strategies and the pipeline."""

from __future__ import annotations

import doctest
from typing import Any

import pytest

import zeroshard.config.pipeline as pipeline_checks
from zeroshard.config import load_config
from zeroshard.config.pipeline import check_for_pipeline
from zeroshard.errors import ConfigConflictError, ConfigError, NotSupportedError


def _cfg(**extra: Any) -> Any:
    return load_config({"train_batch_size": 4, **extra}, dp_world_size=1)


@pytest.mark.parametrize(("extra", "virtual", "error", "match"), [
    ({"managed_gradient_accumulation": False}, 1, ConfigConflictError,
     "managed_gradient_accumulation=False is not supported with pipeline parallelism"),
    ({"gradient_allreduce_op": "sum"}, 1, NotSupportedError, "gradient_allreduce_op='sum' with a PipelineModule"),
    ({}, 2, ConfigError, r'pipeline.schedule: "1f1b" runs one stage per rank, but the PipelineModule has '
                         r"virtual_stages=2"),
    ({"pipeline": {"schedule": "gpipe"}}, 3, ConfigError, '"gpipe" runs one stage per rank'),
])
def test_refused_by_name(extra: dict, virtual: int, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        check_for_pipeline(_cfg(**extra), virtual)


@pytest.mark.parametrize(("schedule", "virtual"), [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2),
                                                   ("interleaved_zero_bubble", 3), ("interleaved_1f1b", 1)])
def test_accepted(schedule: str, virtual: int) -> None:
    check_for_pipeline(_cfg(pipeline={"schedule": schedule}), virtual)


@pytest.mark.parametrize(("extra", "want"), [
    ({}, None),
    ({"data_types": {"grad_accum_dtype": "fp32"}}, "fp32"),
    ({"bf16": {"enabled": True}}, "fp32"),
    ({"fp16": {"enabled": True}}, "fp32"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}, "bf16"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
      "zero_optimization": {"stage": 1}}, "bf16"),
])
def test_accumulation_dtype_is_decided_once(extra: dict, want: str | None) -> None:
    assert _cfg(**extra).accumulation_dtype == want


def test_doctest() -> None:
    result = doctest.testmod(pipeline_checks)
    assert result.attempted > 0 and result.failed == 0
